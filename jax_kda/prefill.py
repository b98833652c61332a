"""Prefill: the KDA layer over whole prompts, leaving each request's cache exactly as its
first verify expects (docs/spec.md, "Prefill": checkpoint, window at positions 0..2,
pending 0).

A prompt starts from a zero state and zero conv history. The recurrence runs in chunks
of CHUNK tokens with no per-token state chain: the chunked verify of a chunk from its
starting state gives its u and o, and the closed-form replay of the same tokens gives
the state the next chunk starts from (`jax_kda.chunked`). Tokens past a prompt's length
are identities (decay 1, beta 0, hence u = 0) and their outputs are zero.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jax_kda import chunked
from jax_kda.config import CONV_TAPS, K, KdaConfig
from jax_kda.layer import gated_rmsnorm
from jax_kda.pytrees import KdaCache, KdaParams, PrefillInputs
from jax_kda.rows import layer_of, locate, prepare_tokens, two_rows, write, write_pending
from jax_kda.validate import (BF16, check_cache, check_layer, check_params, check_rows,
                              expect, typed)

CHUNK = 16  # fastest of 16/32/64 on CPU; memory of P [B, H, CHUNK, CHUNK, K] ~ CHUNK^2


def check_prefill(params: KdaParams, cache: KdaCache, inputs: PrefillInputs,
                  config: KdaConfig, layer=None):
    """Trace-time check of every argument of a prefill; returns the int32 layer of a
    stacked call (None otherwise)."""
    stacked = layer is not None
    _, _, L = check_cache(cache, config, stacked)
    check_params(params, config, L if stacked else False)
    typed("inputs", inputs, PrefillInputs)
    H = config.heads
    sizes = expect("x", inputs.x, [("B", None), ("P", None), (None, 3), ("H", H), (None, K)],
                   (BF16,))
    B, P = sizes["B"], sizes["P"]
    expect("f_a", inputs.f_a, [("B", B), ("P", P), (None, K)], (BF16,))
    expect("beta", inputs.beta, [("B", B), ("P", P), ("H", H)], (BF16,))
    expect("gate", inputs.gate, [("B", B), ("P", P), ("H", H), (None, K)], (BF16,))
    for name in ("lengths", "slots", "record_rows"):
        check_rows(name, getattr(inputs, name), B)
    return check_layer(layer, L) if stacked else None


def run_prefill(params: KdaParams, cache: KdaCache, inputs: PrefillInputs,
                config: KdaConfig, layer, recurrence):
    """The prefill around a recurrence(state, q, k, v, beta, d) -> (final state
    [B, H, K, K], o [B, H, P, K] bf16 values) from a zero state; shared with
    `ref.stock_prefill`. Returns (out [B, P, H, K] bf16, cache)."""
    batch = inputs.x.shape[0]
    inputs = two_rows(inputs)
    B, P = inputs.x.shape[:2]
    rows = locate(cache, inputs.slots, inputs.record_rows, config, layer)
    params = layer_of(params, rows.layer)
    history = jnp.zeros((B, 3, CONV_TAPS - 1, config.heads, K), jnp.float32)
    tokens = prepare_tokens(params, inputs.x, inputs.f_a, inputs.beta, history, config)
    lengths = jnp.clip(inputs.lengths, 0, P)
    valid = jnp.arange(P)[None, :] < lengths[:, None]  # [B, P]
    # Past the length: identity tokens, zeroed too so that any padding (even NaN) is inert.
    mask = lambda a, fill: jnp.where(valid.reshape(B, 1, P, *(1,) * (a.ndim - 3)), a, fill)
    zero = jnp.zeros((B, config.heads, K, K), jnp.float32)
    state, o = recurrence(zero, mask(tokens.q, 0.0), mask(tokens.k, 0.0),
                          mask(tokens.v, 0.0), mask(tokens.beta, 0.0), mask(tokens.d, 1.0))

    out = gated_rmsnorm(jnp.swapaxes(o, 1, 2), inputs.gate, params.norm_weight, config.eps)
    keep = valid & rows.live[:, None]
    out = jnp.where(keep[:, :, None, None], out, jnp.zeros_like(out))
    # The last three inputs sit at padded positions length .. length + 2.
    padded = jnp.pad(inputs.x, ((0, 0), (CONV_TAPS - 1, 0), (0, 0), (0, 0), (0, 0)))
    at = (lengths[:, None] + jnp.arange(CONV_TAPS - 1))[:, :, None, None, None]
    window = jnp.transpose(jnp.take_along_axis(padded, at, axis=1), (0, 2, 3, 4, 1))
    return out[:batch], dataclasses.replace(
        cache,
        state=write(cache.state, rows.layer, rows.slot, state),
        conv=write(cache.conv, rows.layer, (rows.slot, ..., slice(0, CONV_TAPS - 1)), window),
        pending=write_pending(cache, rows, 0),
    )


def chunked_recurrence(state, q, k, v, beta, d):
    """The recurrence from `state` as a scan over chunks of CHUNK tokens.

    q, k, v, d: [B, H, P, K]; beta: [B, H, P]. Returns (state [B, H, K, K], o [B, H, P,
    K] bf16 values).
    """
    B, H, P = beta.shape
    pad = -P % CHUNK
    widths = lambda a: ((0, 0), (0, 0), (0, pad)) + ((0, 0),) * (a.ndim - 3)
    # [B, H, P, ...] -> [chunks, B, H, CHUNK, ...]; padded tokens are identities too.
    split = lambda a, fill: jnp.moveaxis(
        jnp.pad(a, widths(a), constant_values=fill).reshape(
            (B, H, (P + pad) // CHUNK, CHUNK) + a.shape[3:]), 2, 0)

    def step(state, chunk):
        q, k, v, beta, d = chunk
        u, o = chunked.verify(state, q, k, v, beta, d)
        return chunked.replay(state, u, k, d), o

    chunks = (split(q, 0.0), split(k, 0.0), split(v, 0.0), split(beta, 0.0), split(d, 1.0))
    state, o = jax.lax.scan(step, state, chunks)
    return state, jnp.moveaxis(o, 0, 2).reshape(B, H, P + pad, K)[:, :, :P]


@functools.partial(jax.jit, static_argnames="config")
def _prefill(params, cache, inputs, config, layer):
    return run_prefill(params, cache, inputs, config, layer, chunked_recurrence)


def prefill(params: KdaParams, cache: KdaCache, inputs: PrefillInputs, config: KdaConfig,
            *, layer=None):
    """Runs the KDA layer over a batch of prompts and writes each request's cache.

    Args:
      params: the layer's weights (`KdaParams`; stacked with `layer`).
      cache: the decode state (`KdaCache`; stacked with `layer`); only the rows of live
        requests change.
      inputs: the prompts (`PrefillInputs`: x [B, P, 3, H, K] bf16, ..., lengths [B]).
      config: the static `KdaConfig` (its tokens only size the cache's records).
      layer: for stacked params and cache, the layer to run (a Python int or an int32
        scalar, e.g. traced in `lax.scan`); None for one layer's.

    Returns:
      (out [B, P, H, K] bf16, cache): outputs past a prompt's length and of padding rows
      are zero. For each live request, state[slot] is the state after its prompt,
      conv[slot][..., 0:3] its last three raw inputs (zeros before a short prompt) and
      pending[record_row] is 0; records and the rest of the window are left as they
      were. Inside `jax.jit` with the cache donated, the buffers are updated in place.
    """
    layer = check_prefill(params, cache, inputs, config, layer)
    return _prefill(params, cache, inputs, config, layer)
