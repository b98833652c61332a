"""The two JAX references of a verify, with fused_verify's signature
(params, cache, inputs, config) -> (out, cache):

- `stock_verify`: the stock per-token recurrence, replay and verify each a
  `jax.lax.scan` over tokens; nothing clever: the ground truth.
- `chunked_verify`: the chunked (WY) verify and closed-form replay (`jax_kda.chunked`),
  jitted, no per-token state chain; it is also fused_verify's "jax" backend.
- `stock_prefill`: `jax_kda.prefill` with the per-token scan in place of its chunks.

Both share the stock pointwise pieces (`jax_kda.layer`) and the cache reads and writes
(`jax_kda.operands`); they differ only in how the recurrence is computed.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax_kda import chunked
from jax_kda.config import KdaConfig
from jax_kda.layer import HIGHEST, round_bf16
from jax_kda.operands import (locate, prepare_tokens, read_history, read_replay,
                              read_state, write_back)
from jax_kda.prefill import run_prefill
from jax_kda.pytrees import KdaCache, KdaParams, PrefillInputs, VerifyInputs
from jax_kda.validate import check_verify


def _verify(params, cache, inputs, config, recurrence):
    check_verify(params, cache, inputs, config)
    where = locate(cache, inputs.slots, inputs.record_rows, config.rq)
    history = read_history(cache, where)
    tokens = prepare_tokens(params, inputs.x, inputs.f_a, inputs.beta, history, config)
    state_n, u, o = recurrence(read_state(cache, where),
                               read_replay(params, cache, where, config), tokens)
    return write_back(params, cache, inputs, where, tokens, state_n, u, o, config)


def stock_step(S, token):
    """One token of the stock recurrence: (S, (q, k, v, d, beta)) -> (S, (u, bf16 o)),
    vectors [B, H, K], beta [B, H]."""
    q, k, v, d, beta = token
    S = S * d[:, :, None, :]
    u = beta[..., None] * (v - jnp.einsum("bhrc,bhc->bhr", S, k, precision=HIGHEST))
    S = S + u[..., :, None] * k[..., None, :]
    o = jnp.einsum("bhrc,bhc->bhr", S, q, precision=HIGHEST)
    return S, (u, round_bf16(o))


def stock_recurrence(state, replay, tokens):
    """Replay then verify, one token per scan step: (S_n, u, o)."""

    def replay_step(S, token):
        u, kn, d = token  # each [B, H, K]
        return S * d[:, :, None, :] + u[..., :, None] * kn[..., None, :], None

    per_token = lambda a: jnp.moveaxis(a, 2, 0)
    state_n, _ = jax.lax.scan(replay_step, state, tuple(map(per_token, replay)))

    operands = tuple(map(per_token, (tokens.q, tokens.k, tokens.v, tokens.d, tokens.beta)))
    _, (u, o) = jax.lax.scan(stock_step, state_n, operands)
    return state_n, jnp.moveaxis(u, 0, 2), jnp.moveaxis(o, 0, 2)


def chunked_recurrence(state, replay, tokens):
    """Closed-form replay, then the chunked verify from S_n: (S_n, u, o)."""
    state_n = chunked.replay(state, *replay)
    u, o = chunked.verify(state_n, tokens.q, tokens.k, tokens.v, tokens.beta, tokens.d)
    return state_n, u, o


def stock_verify(params: KdaParams, cache: KdaCache, inputs: VerifyInputs,
                 config: KdaConfig):
    """The stock per-token recurrence (SPEC.md section 3): the ground truth.

    Returns (out [B, T, H, K] bf16, cache). Not jitted; wrap it in `jax.jit` with
    `static_argnames="config"` to run it fast.
    """
    return _verify(params, cache, inputs, config, stock_recurrence)


@functools.partial(jax.jit, static_argnames="config")
def chunked_verify(params: KdaParams, cache: KdaCache, inputs: VerifyInputs,
                   config: KdaConfig):
    """The chunked (WY) verify with the closed-form replay (SPEC.md section 3), jitted.

    Returns (out [B, T, H, K] bf16, cache). Called inside a jit that donates the cache,
    the cache's buffers are updated in place.
    """
    return _verify(params, cache, inputs, config, chunked_recurrence)


def stock_prefill_recurrence(q, k, v, beta, d):
    """The prompt from a zero state, one token per scan step: (state, o)."""
    per_token = lambda a: jnp.moveaxis(a, 2, 0)
    zero = jnp.zeros(k.shape[:2] + (k.shape[-1],) * 2, jnp.float32)
    state, (_, o) = jax.lax.scan(stock_step, zero, tuple(map(per_token, (q, k, v, d, beta))))
    return state, jnp.moveaxis(o, 0, 2)


def stock_prefill(params: KdaParams, cache: KdaCache, inputs: PrefillInputs,
                  config: KdaConfig):
    """`jax_kda.prefill` with the stock per-token recurrence: the ground truth.

    Returns (out [B, L, H, K] bf16, cache). Not jitted, like `stock_verify`.
    """
    return run_prefill(params, cache, inputs, config, stock_prefill_recurrence)
