"""What every JAX verify shares around its recurrence: reading a batch's operands out of
the cache (SPEC.md steps 0-4) and writing its results back (steps 6-8).

Out-of-range indices never touch memory: a slot outside [1, S) is a padding row, a
record row outside [0, R) keeps no records; reads are clamped and masked, writes go to
an index past the buffer and are dropped.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jax_kda.config import KdaConfig
from jax_kda.layer import convolve, decay, gate_projection, gated_rmsnorm, l2_normalize
from jax_kda.pytrees import KdaCache, KdaParams, VerifyInputs


class Indices(NamedTuple):
    """Where a batch lives in the cache. live: [B] bool (a real request); slot, record:
    [B] int32, in range or past the buffer (writes there are dropped); n: [B] int32,
    the clamped pending count (0 for a request with no records)."""

    live: jax.Array
    slot: jax.Array
    record: jax.Array
    n: jax.Array


class Replay(NamedTuple):
    """The previous verify's records of each request, [B, H, RQ, K], zeroed past n:
    u (corrections), kn (normalized keys) and d (decays, 1 past n)."""

    u: jax.Array
    kn: jax.Array
    d: jax.Array


class Tokens(NamedTuple):
    """This step's per-token operands. q, k: [B, H, T, K] normalized (q scaled); v:
    [B, H, T, K]; d: [B, H, T, K] decays; beta: [B, H, T]; key, raw_g: [B, T, H, K]
    bf16 values recorded for the next replay; history: [B, 3, 3, H, K] the conv inputs
    before x_0 (part, position)."""

    q: jax.Array
    k: jax.Array
    v: jax.Array
    d: jax.Array
    beta: jax.Array
    key: jax.Array
    raw_g: jax.Array
    history: jax.Array


def locate(cache: KdaCache, slots, record_rows, rq: int) -> Indices:
    """The batch's slots and record rows, validated against the buffers' sizes."""
    S, R = cache.state.shape[0], cache.pending.shape[0]
    live = (slots > 0) & (slots < S)
    has_records = live & (record_rows >= 0) & (record_rows < R)
    record = jnp.where(has_records, record_rows, R)
    n = jnp.where(has_records, jnp.clip(cache.pending[jnp.minimum(record, R - 1)], 0, rq), 0)
    return Indices(live, jnp.where(live, slots, S), record, n)


def read_state(cache: KdaCache, where: Indices):
    """S_0 per request: [B, H, K, K] (padding rows read the null slot)."""
    return cache.state[jnp.where(where.live, where.slot, 0)]


def read_replay(params: KdaParams, cache: KdaCache, where: Indices,
                config: KdaConfig) -> Replay:
    """The records the replay folds in, masked past each request's n."""
    R = cache.pending.shape[0]
    record = jnp.minimum(where.record, R - 1)
    keep = jnp.arange(config.rq)[None, :] < where.n[:, None]  # [B, RQ]
    keep = keep[:, None, :, None]
    u = jnp.where(keep, cache.corrections[record], 0.0)
    key_gates = cache.key_gates[record].astype(jnp.float32)  # [B, H, RQ, 2, K]
    kn = jnp.where(keep, l2_normalize(key_gates[..., 0, :]), 0.0)
    d = decay(jnp.moveaxis(key_gates[..., 1, :], 1, 2), params.a_log, params.dt_bias,
              config.lower_bound)
    return Replay(u, kn, jnp.where(keep, jnp.moveaxis(d, 1, 2), 1.0))


def read_history(cache: KdaCache, where: Indices):
    """The three conv inputs before this step: window[o .. o+2], o = max(n - 1, 0).
    Returns [B, 3, 3, H, K] bf16 values (part, position, head, channel)."""
    window = cache.conv[jnp.where(where.live, where.slot, 0)]  # [B, 3, H, K, W]
    offset = jnp.maximum(where.n - 1, 0)[:, None, None, None, None] + jnp.arange(3)
    history = jnp.take_along_axis(window, offset, axis=-1).astype(jnp.float32)
    return jnp.moveaxis(history, -1, 2)


def prepare_tokens(params: KdaParams, inputs_x, f_a, beta, history,
                   config: KdaConfig) -> Tokens:
    """Convolution, SiLU, norms, gate projection, decays and betas of the T tokens.

    inputs_x: [B, T, 3, H, K] bf16; f_a: [B, T, K]; beta: [B, T, H]; history as
    `read_history` returns it.
    """
    y = convolve(history, inputs_x, params.conv_weight, params.conv_bias)
    q, key, v = (jnp.swapaxes(y[:, :, i], 1, 2) for i in range(3))  # [B, H, T, K]
    raw_g = gate_projection(f_a, params.f_b, config.gate_mode)
    d = decay(raw_g, params.a_log, params.dt_bias, config.lower_bound)
    return Tokens(
        q=l2_normalize(q, config.query_scale),
        k=l2_normalize(key),
        v=v,
        d=jnp.swapaxes(d, 1, 2),
        beta=jax.nn.sigmoid(jnp.swapaxes(beta.astype(jnp.float32), 1, 2)),
        key=jnp.swapaxes(key, 1, 2),
        raw_g=raw_g,
        history=history,
    )


def write_back(params: KdaParams, cache: KdaCache, inputs: VerifyInputs, where: Indices,
               tokens: Tokens, state_n, u, o, config: KdaConfig):
    """Gated RMSNorm of o, and the cache after the step (SPEC.md steps 6-8).

    state_n: [B, H, K, K] replayed checkpoint (written only where n > 0); u, o:
    [B, H, T, K] corrections and bf16 recurrence outputs. Returns (out [B, T, H, K]
    bf16, cache); padding rows' outputs are zero and their cache entries untouched.
    """
    S, T = cache.state.shape[0], config.tokens
    out = gated_rmsnorm(jnp.swapaxes(o, 1, 2), inputs.gate, params.norm_weight, config.eps)
    out = jnp.where(where.live[:, None, None, None], out, jnp.zeros_like(out))
    state = cache.state.at[jnp.where(where.n > 0, where.slot, S)].set(state_n, mode="drop")
    window_x = jnp.transpose(inputs.x, (0, 2, 3, 4, 1))  # [B, 3, H, K, T]
    history = jnp.moveaxis(tokens.history[:, :, 1:], 2, -1).astype(jnp.bfloat16)
    conv = cache.conv.at[where.slot, ..., :T + 2].set(
        jnp.concatenate([history, window_x], axis=-1), mode="drop")
    corrections = cache.corrections.at[where.record, :, :T].set(u, mode="drop")
    records = jnp.stack([tokens.key, tokens.raw_g], axis=-2)  # [B, T, H, 2, K]
    key_gates = cache.key_gates.at[where.record, :, :T].set(
        jnp.swapaxes(records, 1, 2).astype(jnp.bfloat16), mode="drop")
    return out, KdaCache(state, conv, corrections, key_gates, cache.pending)
