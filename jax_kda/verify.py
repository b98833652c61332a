"""fused_verify: one speculative verify step of a KDA layer with the deferred replay
commit, on the CuTe DSL kernel where it runs and in XLA elsewhere (the public entry:
its checks, then the backend's plan per head shard, `jax_kda.backends`)."""
from __future__ import annotations

from jax_kda.backends import check_backend, verifier
from jax_kda.config import KdaConfig
from jax_kda.pytrees import KdaCache, KdaParams, VerifyInputs
from jax_kda.transforms import per_head_entry
from jax_kda.validate import check_verify


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
        export for ["cuda", "cpu"] carries both); else "jax" (`jax_kda.backends`).
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
    check_backend(backend)
    _, layer = check_verify(params, cache, inputs, config, layer)
    entry = per_head_entry("fused_verify", verifier(backend), config,
                           "jax_kda.ref.stock_verify (same signature)")
    return entry(dict(params=params, cache=cache, layer=layer), dict(inputs=inputs))
