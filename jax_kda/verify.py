"""fused_verify: one speculative verify step of a KDA layer with the deferred replay
commit, on the CuTe DSL kernel where it runs and in XLA elsewhere."""
from __future__ import annotations

import functools

import jax

from jax_kda.config import KdaConfig
from jax_kda.partitioning import per_head
from jax_kda.pytrees import KdaCache, KdaParams, VerifyInputs
from jax_kda.transforms import request_batched
from jax_kda.validate import check_verify
from jax_kda.xla import xla_verify

BACKENDS = ("auto", "jax", "cutedsl")


def _cuda_major(device) -> int | None:
    """The major compute capability of a CUDA GPU, None for any other device."""
    if device.platform != "gpu" or not hasattr(device, "compute_capability"):
        return None
    return int(str(device.compute_capability).split(".")[0])


def kernel_available(device=None) -> bool:
    """True where `backend="auto"` may take the kernels for CUDA: nvidia-cutlass-dsl is
    installed (they compile for sm_90a on any host) and `device` (the default device
    unless one is given) is no CUDA GPU of compute capability < 9.0."""
    device = jax.devices()[0] if device is None else device
    major = _cuda_major(device)
    if major is not None and major < 9:
        return False
    try:
        import cutlass  # noqa: F401 - installed or not
    except ImportError:
        return False
    return True


def cutedsl_supported(device=None) -> bool:
    """True where the CuTe DSL kernel can run: a CUDA GPU of compute capability >= 9.0
    (the default device unless one is given) and nvidia-cutlass-dsl installed."""
    device = jax.devices()[0] if device is None else device
    return _cuda_major(device) is not None and kernel_available(device)


@functools.lru_cache(maxsize=None)
def on_cuda(kernel, xla):
    """A backend (args..., config=) that runs `kernel` where the program runs on CUDA and
    `xla` on every other platform, chosen when it is lowered (`jax.lax.platform_dependent`):
    a program lowered for the CPU neither lowers nor compiles the kernel, one exported for
    ["cuda", "cpu"] carries both."""

    def run(*args, config: KdaConfig):
        return jax.lax.platform_dependent(*args, cuda=functools.partial(kernel, config=config),
                                          default=functools.partial(xla, config=config))

    return run


def fused_verify(params: KdaParams, cache: KdaCache, inputs: VerifyInputs,
                 config: KdaConfig, *, backend: str = "auto", layer=None):
    """Replays each request's accepted tokens into its checkpoint, verifies this step's
    T tokens from it, and records them for the next step (docs/spec.md).

    Args:
      params: the layer's weights (`KdaParams`).
      cache: the decode state (`KdaCache`).
      inputs: this step's `VerifyInputs` (x [B, T, 3, H, K] bf16, ...).
      config: the static `KdaConfig`.
      backend: "cutedsl" (the fused CuTe DSL kernel, CUDA GPUs of compute capability
        >= 9.0), "jax" (the chunked form in XLA, any device) or "auto": where the
        kernel's CTA fits the shared memory and `kernel_available()`, the kernel on
        CUDA and "jax" on every other platform, chosen when the program is lowered (an
        export for ["cuda", "cpu"] carries both); else "jax".
      layer: with stacked params and cache (a leading layer axis L on every leaf), the
        layer to run: a Python int or an int32 scalar (e.g. traced in `lax.scan`). The
        layer's rows are read and written in the stacked buffers, nothing is sliced
        or copied; a traced layer outside [0, L) makes every row a padding row.

    Returns:
      (out [B, T, H, K] bf16, cache). Inside `jax.jit` with the cache donated, the
      cache's buffers are updated in place. Then call `accept` with the number of
      tokens each request accepted.

    Shape, dtype and config errors raise at trace time. Out-of-range slots are padding
    rows (zero output, nothing read or written), out-of-range record rows keep no
    records, pending counts are clamped to [0, RQ]: see `check_inputs` to find them.

    On arrays whose heads are split over a mesh axis (`head_specs`), each device runs
    its own heads: under `jax.shard_map` call it with `local_config`, under plain
    `jax.jit` with `config` (docs/design.md, "Sharding").
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    batch, layer = check_verify(params, cache, inputs, config, layer)
    if backend == "auto" and not (kernel_available() and _kernel_fits(config, batch)):
        backend = "jax"
    return _entry(config, backend)(dict(params=params, cache=cache, layer=layer),
                                   dict(inputs=inputs))


@functools.lru_cache(maxsize=None)
def _entry(config: KdaConfig, backend: str):
    """The backend's verify, split by heads where they are sharded (`per_head`), as
    `transforms.request_batched` runs it: a mapped axis of the inputs folds into the
    batch under `jax.vmap`, differentiation raises."""
    if backend == "jax":
        verify = xla_verify
    else:
        from jax_kda.ffi import cutedsl_verify  # the kernel's custom call, lazily

        verify = cutedsl_verify if backend == "cutedsl" else on_cuda(cutedsl_verify, xla_verify)

    def run(shared, requests):
        return per_head(verify, config, shared["params"], shared["cache"], requests["inputs"],
                        shared["layer"])

    return request_batched("fused_verify", run,
                           instead="jax_kda.ref.stock_verify (same signature)")


def _kernel_fits(config: KdaConfig, batch: int) -> bool:
    """Whether some split of the kernel fits the shared memory (see `kernel_split`)."""
    from jax_kda.ffi import kernel_split

    try:
        kernel_split(config, batch)
    except ValueError:
        return False
    return True
