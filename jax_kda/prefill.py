"""prefill: the KDA layer over whole prompts or pieces of them, leaving each request's
cache exactly as its first verify expects (docs/spec.md, "Prefill": checkpoint, window
at positions 0..2, pending 0). The public entry: its checks, then the backend's plan per
head shard (`jax_kda.backends`) around the prompt step (`jax_kda.steps`).

A prompt starts from a zero state and zero conv history; a later piece of it resumes
from the request's cache: the checkpoint with its kept records folded in, as a verify
replays them, and the window's history. The recurrence runs in chunks of dense matrix
products (`jax_kda.prompt_chunks`). Tokens past a piece's length are identities
(decay 1, beta 0, hence u = 0) and their outputs are zero.
"""
from __future__ import annotations

from jax_kda.backends import check_backend, prefiller
from jax_kda.config import KdaConfig
from jax_kda.pytrees import KdaCache, KdaParams, PrefillInputs
from jax_kda.transforms import per_head_entry
from jax_kda.validate import check_prefill


def prefill(params: KdaParams, cache: KdaCache, inputs: PrefillInputs, config: KdaConfig,
            *, backend: str = "auto", layer=None):
    """Runs the KDA layer over a batch of prompts, or pieces of prompts, and writes each
    request's cache.

    Args:
      params: the layer's weights (`KdaParams`; stacked with `layer`).
      cache: the decode state (`KdaCache`; stacked with `layer`); only the rows of live
        requests change.
      inputs: the prompts (`PrefillInputs`: x [B, P, 3, H, K] bf16, ..., lengths [B],
        resume [B] for the rows that continue a prompt from the cache).
      config: the static `KdaConfig` (its tokens only size the cache's records).
      backend: where the prompt's convolution and chunks run: "cutedsl" (CuTe DSL
        kernels, CUDA GPUs of compute capability >= 9.0: the scan over chunks for chunks
        of a multiple of 16 tokens, and the convolution and the chunks' operands too at
        lower_bound >= about -5.2, not the softplus gate's), "jax" (XLA,
        any device) or "auto": where the chunks suit the scan kernel and
        `kernel_available()`, the kernels on CUDA and XLA on every other platform, chosen
        when the program is lowered; else "jax" (`jax_kda.backends`). The gate
        projection and gated norm are XLA's either way.
      layer: for stacked params and cache, the layer to run (a Python int or an int32
        scalar, e.g. traced in `lax.scan`); None for one layer's.

    Returns:
      (out [B, P, H, K] bf16, cache): outputs past a prompt's length and of padding rows
      are zero. For each live request, state[slot] is the state after its piece,
      conv[slot][..., 0:3] the last three raw inputs of the prompt so far (zeros before
      a new prompt shorter than three) and pending[record_row] is 0 (the kept records
      folded in); records and the rest of the window are left as they were. A prompt
      prefilled in pieces equals it prefilled at once within FP32 rounding. Inside
      `jax.jit` with the cache donated, the buffers are updated in place. Head-sharded
      arrays: as `fused_verify`.
    """
    check_backend(backend)
    layer = check_prefill(params, cache, inputs, config, layer)
    entry = per_head_entry("prefill", prefiller(backend), config,
                           "jax_kda.ref.stock_prefill (same signature)")
    return entry(dict(params=params, cache=cache, layer=layer), dict(inputs=inputs))
