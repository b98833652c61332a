"""The runner's side of deferred replay: `accept` records how many tokens of the last
verify were accepted; `flush` folds them into the checkpoint ahead of time (before a
request is evicted, snapshotted or handed to code that expects a plain state)."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax_kda import chunked
from jax_kda.config import KdaConfig
from jax_kda.operands import locate, read_history, read_replay, read_state
from jax_kda.pytrees import KdaCache, KdaParams
from jax_kda.validate import I32, check_cache, check_params, expect


@jax.jit
def accept(cache: KdaCache, record_rows, accepted) -> KdaCache:
    """pending[record_rows[b]] = accepted[b] for every b with 0 <= record_rows[b] < R.

    record_rows, accepted: [B] int32; accepted counts are 1..T after a verify of T
    tokens (other values are clamped to [0, RQ] by the next verify). Donate the cache
    to update `pending` in place.
    """
    R = expect("cache.pending", cache.pending, [("R", None)], (I32,))["R"]
    B = expect("record_rows", record_rows, [("B", None)], (I32,))["B"]
    expect("accepted", accepted, [("B", B)], (I32,))
    rows = jnp.where((record_rows >= 0) & (record_rows < R), record_rows, R)
    pending = cache.pending.at[rows].set(accepted, mode="drop")
    return KdaCache(cache.state, cache.conv, cache.corrections, cache.key_gates, pending)


@functools.partial(jax.jit, static_argnames="config")
def flush(params: KdaParams, cache: KdaCache, slots, record_rows,
          config: KdaConfig) -> KdaCache:
    """Folds each request's pending tokens into its checkpoint.

    slots, record_rows: [B] int32, as in VerifyInputs (padding rows and out-of-range
    indices are skipped). For each request the replayed state S_n is written to its
    slot, its conv window moves so that positions 0..2 hold the last three inputs, and
    pending becomes 0; the records stay. A verify after a flush gives the same result
    as one without it. Donate the cache to update it in place.
    """
    check_params(params, config)
    S, _ = check_cache(cache, config)
    B = expect("slots", slots, [("B", None)], (I32,))["B"]
    expect("record_rows", record_rows, [("B", B)], (I32,))
    where = locate(cache, slots, record_rows, config.rq)
    state_n = chunked.replay(read_state(cache, where),
                             *read_replay(params, cache, where, config))
    state = cache.state.at[jnp.where(where.n > 0, where.slot, S)].set(state_n, mode="drop")
    history = jnp.moveaxis(read_history(cache, where), 2, -1).astype(jnp.bfloat16)
    conv = cache.conv.at[where.slot, ..., :3].set(history, mode="drop")
    pending = cache.pending.at[where.record].set(0, mode="drop")
    return KdaCache(state, conv, cache.corrections, cache.key_gates, pending)
