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


def accept(cache: KdaCache, record_rows, accepted, config: KdaConfig, *,
           path=None) -> KdaCache:
    """Records how many of the last verify's T tokens each request accepted (with
    trees: which path).

    record_rows, accepted: [B] int32. For every b with 0 <= record_rows[b] < R whose
    record row awaits an accept (pending -(m + 1) < 0: its last verify kept m records),
    pending becomes m + accepted[b] clamped to [0, T] (the sum at most RQ), in every
    head (and layer of a stacked cache); 0 rejects the whole verify. A row that awaits
    no accept (accepted already, flushed, prefilled) is left as it is, so a repeated
    accept changes nothing. path: with `config.trees`, [B, T] int32, the accepted nodes
    in order (node 0 first, each next a child of the one before: the first entry that
    is not ends the path there), the first accepted[b] of them counting; None is the
    chain 0 .. a - 1 (docs/spec.md, "Token trees"). Only `pending` (and with trees
    `nodes`, O(B T) entries) is read and written.
    """
    check_accept(cache, record_rows, accepted, config, path)
    shared = dict(cache=dict(pending=cache.pending, nodes=cache.nodes))
    requests = dict(record_rows=record_rows, accepted=accepted, path=path)
    _, counted = _accept_entry(config.tokens, config.rq)(shared, requests)
    return dataclasses.replace(cache, **counted)


@functools.lru_cache(maxsize=None)
def _accept_entry(tokens: int, record_tokens: int):
    """`_accept` as `transforms.request_batched` runs it: a mapped axis of record_rows,
    accepted and path folds into the batch under `jax.vmap`. Only the integer pending
    and nodes go through it: the cache's other leaves pass by, differentiable as they
    are."""
    def run(shared, requests):
        return None, _accept(shared["cache"]["pending"], shared["cache"]["nodes"],
                             requests["record_rows"], requests["accepted"], requests["path"],
                             tokens, record_tokens)

    return request_batched("accept", run)


@functools.partial(jax.jit, static_argnums=(5, 6))
def _accept(pending, nodes, record_rows, accepted, path, tokens, record_tokens):
    R = pending.shape[-2]
    rows = jnp.where((record_rows >= 0) & (record_rows < R), record_rows, R)
    old = pending[..., jnp.minimum(rows, R - 1), :]  # [(L,) B, H]
    m = kept(old, record_tokens)
    count = jnp.clip(accepted, 0, tokens)[:, None]
    if nodes is None:
        new = jnp.where(old < 0, jnp.minimum(m + count, record_tokens), old)
        return dict(pending=pending.at[..., rows, :].set(new, mode="drop"), nodes=None)
    links = nodes[..., jnp.minimum(rows, R - 1), :, :]  # [(L,) B, H, RQ]
    steps = jnp.arange(tokens) if path is None else path[:, None, :]  # the path's nodes
    steps = jnp.broadcast_to(steps, old.shape + (tokens,))
    if path is not None:
        count = jnp.minimum(count, path_length(links, m, steps, tokens))
    new = jnp.where(old < 0, jnp.minimum(m + count, record_tokens), old)
    # nodes[m + i] := m + steps[i] for i < the accepted count: the path's record positions
    i = jnp.arange(record_tokens) - m[..., None]  # [(L,) B, H, RQ]
    taken = jnp.take_along_axis(steps, jnp.clip(i, 0, tokens - 1), axis=-1)
    order = jnp.where((i >= 0) & (i < (new - m)[..., None]), m[..., None] + taken, links)
    order = jnp.where((old < 0)[..., None], order, links)
    return dict(pending=pending.at[..., rows, :].set(new, mode="drop"),
                nodes=nodes.at[..., rows, :, :].set(order, mode="drop"))


def path_length(links, m, steps, tokens: int):
    """[...] int32: how many leading entries of `steps` ([..., T] node indices) make a
    path of the tree an awaited verify recorded (`links` [..., RQ]: node t's parent at
    m + t): node 0 first (its parent -1), each next a child of the one before."""
    RQ = links.shape[-1]
    parent = jnp.take_along_axis(links, jnp.clip(m[..., None] + steps, 0, RQ - 1), axis=-1)
    before = jnp.concatenate([jnp.full_like(steps[..., :1], -1), steps[..., :-1]], axis=-1)
    ok = (steps >= 0) & (steps < tokens) & (parent == before)
    return jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=-1), axis=-1)


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
