"""The runner's side of deferred replay (docs/spec.md, "The runner's protocol"): `accept`
says how many tokens of the last verify were accepted; `flush` folds them into the
checkpoint ahead of time (before a request is evicted, snapshotted or handed to code
that expects a plain state).

Both are plain functions of traced operations: call them inside the jitted step that
donates the cache, where they update its rows in place. `accept` changes only
`pending`, so called on its own it copies nothing else either.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jax_kda import wy
from jax_kda.cache_rows import (locate, read_history, read_replay, read_state, two_rows,
                                write, write_pending, write_state)
from jax_kda.config import CONV_TAPS, KdaConfig
from jax_kda.partitioning import per_head
from jax_kda.pytrees import KdaCache, KdaParams, kept
from jax_kda.transforms import request_batched
from jax_kda.validate import check_accept, check_flush


def accept(cache: KdaCache, record_rows, accepted, config: KdaConfig) -> KdaCache:
    """Records how many of the last verify's T tokens each request accepted.

    record_rows, accepted: [B] int32. For every b with 0 <= record_rows[b] < R whose
    record row awaits an accept (pending -(m + 1) < 0: its last verify kept m records),
    pending becomes m + accepted[b] clamped to [0, T] (the sum at most RQ), in every
    head (and layer of a stacked cache); 0 rejects the whole verify. A row that awaits
    no accept (accepted already, flushed, prefilled) is left as it is, so a repeated
    accept changes nothing. Only `pending` is read and written.
    """
    check_accept(cache, record_rows, accepted, config)
    _, pending = _accept_entry(config.tokens, config.rq)(
        dict(cache=cache.pending), dict(record_rows=record_rows, accepted=accepted))
    return dataclasses.replace(cache, pending=pending)


@functools.lru_cache(maxsize=None)
def _accept_entry(tokens: int, record_tokens: int):
    """`_accept` as `transforms.request_batched` runs it: a mapped axis of record_rows and
    accepted folds into the batch under `jax.vmap`. Only the (integer) pending goes
    through it: the cache's other leaves pass by, differentiable as they are."""
    def run(shared, requests):
        return None, _accept(shared["cache"], requests["record_rows"], requests["accepted"],
                             tokens, record_tokens)

    return request_batched("accept", run)


@functools.partial(jax.jit, static_argnums=(3, 4))
def _accept(pending, record_rows, accepted, tokens, record_tokens):
    R = pending.shape[-2]
    rows = jnp.where((record_rows >= 0) & (record_rows < R), record_rows, R)
    old = pending[..., jnp.minimum(rows, R - 1), :]  # [(L,) B, H]
    counted = kept(old, record_tokens) + jnp.clip(accepted, 0, tokens)[:, None]
    new = jnp.where(old < 0, jnp.minimum(counted, record_tokens), old)
    return pending.at[..., rows, :].set(new, mode="drop")


def flush(params: KdaParams, cache: KdaCache, slots, record_rows,
          config: KdaConfig) -> KdaCache:
    """Folds each request's pending tokens into its checkpoint, in every layer of a
    stacked cache (params stacked alike).

    slots, record_rows: [B] int32, as in VerifyInputs (padding rows and out-of-range
    indices are skipped). For each request the state S_n with its n kept records
    replayed (a row awaiting an accept keeps the records before its last verify's) is
    written to its slot, its conv window moves so that positions 0..2 hold the last
    three inputs, and pending becomes 0; the records stay. A verify after a flush gives
    the outputs of one without it, and the same state as of each accepted token (to FP32
    rounding). Call it inside the jitted step that donates the cache (or as
    `jax.jit(flush, static_argnames="config", donate_argnums=1)`) to update the rows in
    place. Head-sharded arrays: as `fused_verify`.
    """
    check_flush(params, cache, slots, record_rows, config)
    _, cache = _flush_entry(config)(dict(params=params, cache=cache),
                                    dict(slots=slots, record_rows=record_rows))
    return cache


@functools.lru_cache(maxsize=None)
def _flush_entry(config: KdaConfig):
    """`_flush_layers`, split by heads where they are sharded (`per_head`), as
    `transforms.request_batched` runs it: a mapped axis of slots and record_rows folds
    into the batch under `jax.vmap`, differentiation raises."""
    def run(shared, requests):
        return None, per_head(_flush_layers, config, shared["params"], shared["cache"],
                              requests["slots"], requests["record_rows"])

    return request_batched(
        "flush", run, instead="jax_kda.ref.stock_prefill on a resumed piece of length 0 "
                              "(a flush of one layer: docs/spec.md, \"Prefill\")")


def _flush_layers(params, cache, slots, record_rows, *, config):
    """`_flush` of one layer's params and cache, or of every layer of stacked ones."""
    one = functools.partial(_flush, slots=slots, record_rows=record_rows, config=config)
    return one(params, cache) if cache.state.ndim == 4 else jax.vmap(one)(params, cache)


@functools.partial(jax.jit, static_argnames="config")
def _flush(params, cache, slots, record_rows, config):
    rows = locate(cache, *two_rows((slots, record_rows)), config)
    state_0 = read_state(cache, rows)
    state_n = wy.replay(state_0, *read_replay(params, cache, rows, config))
    history = jnp.moveaxis(read_history(cache, rows), 2, -1)
    conv = write(cache.conv, None, (rows.slot, ..., slice(0, CONV_TAPS - 1)), history)
    return dataclasses.replace(cache, state=write_state(cache, rows, state_0, state_n,
                                                        rows.n > 0),
                               conv=conv, pending=write_pending(cache, rows, 0))
