"""Prefill: the KDA layer over whole prompts, leaving each request's cache exactly as its
first verify expects (SPEC.md section 3: checkpoint, window at positions 0..2, pending 0).

A prompt starts from a zero state and zero conv history. The recurrence runs in chunks
of CHUNK tokens with no per-token state chain: the chunked verify of a chunk from its
starting state gives its u and o, and the closed-form replay of the same tokens gives
the state the next chunk starts from (`jax_kda.chunked`). Tokens past a prompt's length
are identities (decay 1, beta 0, hence u = 0) and their outputs are zero.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax_kda import chunked
from jax_kda.config import CONV_TAPS, K, KdaConfig
from jax_kda.layer import gated_rmsnorm
from jax_kda.operands import locate, prepare_tokens
from jax_kda.pytrees import KdaCache, KdaParams, PrefillInputs
from jax_kda.validate import BF16, I32, check_cache, check_params, expect

CHUNK = 16  # fastest of 16/32/64 on CPU; memory of P [B, H, CHUNK, CHUNK, K] ~ CHUNK^2


def check_prefill(params: KdaParams, cache: KdaCache, inputs: PrefillInputs,
                  config: KdaConfig) -> tuple[int, int]:
    """Trace-time check of every argument of a prefill; returns (B, L)."""
    check_params(params, config)
    check_cache(cache, config)
    if not isinstance(inputs, PrefillInputs):
        raise TypeError(f"inputs: expected a PrefillInputs, got {type(inputs).__name__}")
    H = config.heads
    sizes = expect("x", inputs.x, [("B", None), ("L", None), (None, 3), ("H", H), (None, K)],
                   (BF16,))
    B, L = sizes["B"], sizes["L"]
    expect("f_a", inputs.f_a, [("B", B), ("L", L), (None, K)], (BF16,))
    expect("beta", inputs.beta, [("B", B), ("L", L), ("H", H)], (BF16,))
    expect("gate", inputs.gate, [("B", B), ("L", L), ("H", H), (None, K)], (BF16,))
    for name in ("lengths", "slots", "record_rows"):
        expect(name, getattr(inputs, name), [("B", B)], (I32,))
    return B, L


def run_prefill(params: KdaParams, cache: KdaCache, inputs: PrefillInputs,
                config: KdaConfig, recurrence):
    """The prefill around a recurrence(q, k, v, beta, d) -> (final state [B, H, K, K],
    o [B, H, L, K] bf16 values) that starts from a zero state; shared with
    `reference.stock_prefill`. Returns (out [B, L, H, K] bf16, cache)."""
    B, L = check_prefill(params, cache, inputs, config)
    where = locate(cache, inputs.slots, inputs.record_rows, config.rq)
    history = jnp.zeros((B, 3, CONV_TAPS - 1, config.heads, K), jnp.float32)
    tokens = prepare_tokens(params, inputs.x, inputs.f_a, inputs.beta, history, config)
    lengths = jnp.clip(inputs.lengths, 0, L)
    valid = jnp.arange(L)[None, :] < lengths[:, None]  # [B, L]
    # Past the length: identity tokens, zeroed too so that any padding (even NaN) is inert.
    mask = lambda a, fill: jnp.where(valid.reshape(B, 1, L, *(1,) * (a.ndim - 3)), a, fill)
    state, o = recurrence(mask(tokens.q, 0.0), mask(tokens.k, 0.0), mask(tokens.v, 0.0),
                          mask(tokens.beta, 0.0), mask(tokens.d, 1.0))

    out = gated_rmsnorm(jnp.swapaxes(o, 1, 2), inputs.gate, params.norm_weight, config.eps)
    keep = valid & where.live[:, None]
    out = jnp.where(keep[:, :, None, None], out, jnp.zeros_like(out))
    # The last three inputs sit at padded positions length .. length + 2.
    padded = jnp.pad(inputs.x, ((0, 0), (CONV_TAPS - 1, 0), (0, 0), (0, 0), (0, 0)))
    at = (lengths[:, None] + jnp.arange(CONV_TAPS - 1))[:, :, None, None, None]
    window = jnp.transpose(jnp.take_along_axis(padded, at, axis=1), (0, 2, 3, 4, 1))
    return out, KdaCache(
        state=cache.state.at[where.slot].set(state, mode="drop"),
        conv=cache.conv.at[where.slot, ..., :CONV_TAPS - 1].set(window, mode="drop"),
        corrections=cache.corrections,
        key_gates=cache.key_gates,
        pending=cache.pending.at[where.record].set(0, mode="drop"),
    )


def chunked_recurrence(q, k, v, beta, d):
    """The recurrence from a zero state as a scan over chunks of CHUNK tokens.

    q, k, v, d: [B, H, L, K]; beta: [B, H, L]. Returns (state [B, H, K, K], o [B, H, L,
    K] bf16 values).
    """
    B, H, L = beta.shape
    pad = -L % CHUNK
    widths = lambda a: ((0, 0), (0, 0), (0, pad)) + ((0, 0),) * (a.ndim - 3)
    # [B, H, L, ...] -> [chunks, B, H, CHUNK, ...]; padded tokens are identities too.
    split = lambda a, fill: jnp.moveaxis(
        jnp.pad(a, widths(a), constant_values=fill).reshape(
            (B, H, (L + pad) // CHUNK, CHUNK) + a.shape[3:]), 2, 0)

    def step(state, chunk):
        q, k, v, beta, d = chunk
        u, o = chunked.verify(state, q, k, v, beta, d)
        return chunked.replay(state, u, k, d), o

    chunks = (split(q, 0.0), split(k, 0.0), split(v, 0.0), split(beta, 0.0), split(d, 1.0))
    state, o = jax.lax.scan(step, jnp.zeros((B, H, K, K), jnp.float32), chunks)
    return state, jnp.moveaxis(o, 0, 2).reshape(B, H, L + pad, K)[:, :, :L]


@functools.partial(jax.jit, static_argnames="config")
def prefill(params: KdaParams, cache: KdaCache, inputs: PrefillInputs, config: KdaConfig):
    """Runs the KDA layer over a batch of prompts and writes each request's cache.

    Args:
      params: the layer's weights (`KdaParams`).
      cache: the decode state (`KdaCache`); only the rows of live requests change.
      inputs: the prompts (`PrefillInputs`: x [B, L, 3, H, K] bf16, ..., lengths [B]).
      config: the static `KdaConfig` (its tokens only size the cache's records).

    Returns:
      (out [B, L, H, K] bf16, cache): outputs past a prompt's length and of padding rows
      are zero. For each live request, state[slot] is the state after its prompt,
      conv[slot][..., 0:3] its last three raw inputs (zeros before a short prompt) and
      pending[record_row] is 0; records and the rest of the window are left as they
      were. Inside `jax.jit` with the cache donated, the buffers are updated in place.
    """
    return run_prefill(params, cache, inputs, config, chunked_recurrence)
