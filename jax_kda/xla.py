"""The XLA backend of `fused_verify` ("jax"): the chunked (WY) verify and the closed-form
replay (`jax_kda.chunked`) on the batch's rows of the cache, jitted, for any device."""
from __future__ import annotations

import functools

import jax

from jax_kda import chunked
from jax_kda.config import KdaConfig
from jax_kda.pytrees import KdaCache, KdaParams, VerifyInputs
from jax_kda.rows import verify_rows


def chunked_recurrence(state, replay, tokens):
    """Closed-form replay, then the chunked verify from S_n: (S_n, u, o)."""
    state_n = chunked.replay(state, *replay)
    u, o = chunked.verify(state_n, tokens.q, tokens.k, tokens.v, tokens.beta, tokens.d)
    return state_n, u, o


@functools.partial(jax.jit, static_argnames="config")
def xla_verify(params: KdaParams, cache: KdaCache, inputs: VerifyInputs, layer=None, *,
               config: KdaConfig):
    """`fused_verify`'s "jax" backend on checked arguments: (out [B, T, H, K] bf16,
    cache). layer: the int32 layer of stacked params and cache, or None."""
    return verify_rows(params, cache, inputs, config, layer, chunked_recurrence)
