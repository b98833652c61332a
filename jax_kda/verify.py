"""fused_verify: one speculative verify step of a KDA layer with the deferred replay
commit, on the CuTe DSL kernel where it runs and in pure JAX elsewhere."""
from __future__ import annotations

import jax

from jax_kda.config import KdaConfig
from jax_kda.pytrees import KdaCache, KdaParams, VerifyInputs
from jax_kda.reference import chunked_verify
from jax_kda.validate import check_verify

BACKENDS = ("auto", "jax", "cutedsl")


def cutedsl_supported(device=None) -> bool:
    """True where the CuTe DSL kernel can run: a CUDA GPU of compute capability >= 9.0
    (the default device unless one is given) and nvidia-cutlass-dsl installed."""
    device = jax.devices()[0] if device is None else device
    if device.platform != "gpu" or not hasattr(device, "compute_capability"):
        return False
    major = int(str(device.compute_capability).split(".")[0])
    if major < 9:
        return False
    try:
        import cutlass  # noqa: F401
    except ImportError:
        return False
    return True


def _kernel_fits(config: KdaConfig, batch: int, params: KdaParams) -> bool:
    """Whether some split of the kernel fits the shared memory (see `kernel_split`)."""
    from jax_kda.ffi import kernel_split

    try:
        kernel_split(config, batch, params.conv_bias is not None)
    except ValueError:
        return False
    return True


def fused_verify(params: KdaParams, cache: KdaCache, inputs: VerifyInputs,
                 config: KdaConfig, *, backend: str = "auto"):
    """Replays each request's accepted tokens into its checkpoint, verifies this step's
    T tokens from it, and records them for the next step (SPEC.md section 3).

    Args:
      params: the layer's weights (`KdaParams`).
      cache: the decode state (`KdaCache`).
      inputs: this step's `VerifyInputs` (x [B, T, 3, H, K] bf16, ...).
      config: the static `KdaConfig`.
      backend: "cutedsl" (the fused CuTe DSL kernel, CUDA GPUs of compute capability
        >= 9.0), "jax" (the chunked form in XLA, any device) or "auto" (the kernel
        where it runs and its CTA fits the shared memory, else "jax").

    Returns:
      (out [B, T, H, K] bf16, cache). Inside `jax.jit` with the cache donated, the
      cache's buffers are updated in place. Then call `accept` with the number of
      tokens each request accepted.

    Shape, dtype and config errors raise at trace time. Out-of-range slots are padding
    rows (zero output, nothing read or written), out-of-range record rows keep no
    records, pending counts are clamped to [0, RQ]: see `check_inputs` to find them.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    batch = check_verify(params, cache, inputs, config)
    if backend == "auto":
        backend = "cutedsl" if cutedsl_supported() and _kernel_fits(config, batch,
                                                                     params) else "jax"
    if backend == "jax":
        return chunked_verify(params, cache, inputs, config)
    from jax_kda.ffi import cutedsl_verify  # the kernel and its custom call, lazily

    return cutedsl_verify(params, cache, inputs, config)
