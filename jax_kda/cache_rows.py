"""A batch's rows of the cache, for every JAX path (docs/spec.md, steps 0-2 and 7-9):
where each request lives, reading its checkpoint, records and history, and writing its
results back, in one layer of a stacked cache or in a cache of one layer.

Only the batch's rows are gathered and scattered (O(B) work, none in S, R or L).
Out-of-range indices never touch memory: a slot outside [1, S) (or a layer outside
[0, L)) is a padding row, a record row outside [0, R) keeps no records; reads are
clamped and masked, writes go to an index past the buffer and are dropped.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jax_kda.config import CONV_TAPS, KdaConfig
from jax_kda.layer import Tokens, decay, l2_normalize
from jax_kda.pytrees import KdaCache, KdaParams, awaiting, kept
from jax_kda.tree import node_parents


class Rows(NamedTuple):
    """Where a batch lives in the cache. live: [B] bool (a real request); slot, record:
    [B] int32, in range or past the buffer (writes there are dropped); n: [B, H] int32,
    the records kept per head (`pytrees.kept`; 0 for a request with no records); layer:
    the int32 layer of a stacked cache (clamped into range), or None; order: with trees,
    [B, H, RQ] int32, the record positions of the kept tokens in replay order (clamped
    into the row), None where record j is at position j."""

    live: jax.Array
    slot: jax.Array
    record: jax.Array
    n: jax.Array
    layer: jax.Array | None
    order: jax.Array | None = None


class Replay(NamedTuple):
    """The records a verify or flush folds in, [B, H, RQ, K], zeroed past n: u
    (corrections), kn (normalized keys) and d (decays, 1 past n)."""

    u: jax.Array
    kn: jax.Array
    d: jax.Array


def layer_of(tree, layer):
    """The leaves of one layer of a stacked pytree (params), or the tree itself when
    layer is None; a gather of that layer's weights only."""
    if layer is None:
        return tree
    return jax.tree.map(lambda a: a[layer], tree)


def two_rows(batch):
    """A batch of one request as two, the second a padding row (slot 0): XLA makes a
    one-row gather or scatter a dynamic slice, around which it copies the whole
    buffer. batch: a pytree of [B, ...] leaves (slots among them); other batches as
    they are."""
    B = jax.tree.leaves(batch)[0].shape[0]
    if not isinstance(B, int) or B != 1:
        return batch
    return jax.tree.map(lambda a: jnp.concatenate([a, jnp.zeros_like(a)]), batch)


def pad_rows(a, rows: int):
    """a [B, ...] with zero rows appended up to `rows` (`two_rows`' padding row)."""
    return jnp.pad(a, ((0, rows - a.shape[0]),) + ((0, 0),) * (a.ndim - 1))


def locate(cache: KdaCache, slots, record_rows, config: KdaConfig, layer=None) -> Rows:
    """The batch's slots and record rows, validated against the buffers' sizes."""
    S, R = cache.state.shape[-4], cache.pending.shape[-2]
    live = (slots > 0) & (slots < S)
    if layer is not None:
        L = cache.state.shape[0]
        live = live & (layer >= 0) & (layer < L)
        layer = jnp.clip(layer, 0, L - 1)
    has_records = live & (record_rows >= 0) & (record_rows < R)
    record = jnp.where(has_records, record_rows, R)
    pending = read(cache.pending, layer, jnp.minimum(record, R - 1))  # [B, H]
    n = jnp.where(has_records[:, None], kept(pending, config.rq), 0)
    order = None
    if cache.nodes is not None:
        order = jnp.clip(read(cache.nodes, layer, jnp.minimum(record, R - 1)), 0,
                         config.rq - 1)
    return Rows(live, jnp.where(live, slots, S), record, n, layer, order)


def _where(layer, index):
    index = index if isinstance(index, tuple) else (index,)
    return index if layer is None else (layer,) + index


def read(buffer, layer, index):
    """buffer[layer, index] of a stacked buffer, buffer[index] of one layer's."""
    return buffer[_where(layer, index)]


def write(buffer, layer, index, values):
    """`read`'s rows set to values, rows past the buffer dropped; in place when the
    buffer is donated. Values are converted to the buffer's dtype, rounded to nearest
    even: a bf16 checkpoint's one rounding point (docs/spec.md, "State dtype"). (XLA:CPU
    alone converts a bf16 buffer to f32 and back around a gather or scatter, which costs
    O(buffer) there.)"""
    return buffer.at[_where(layer, index)].set(values.astype(buffer.dtype), mode="drop")


def write_pending(cache: KdaCache, rows: Rows, value):
    """cache.pending with each (record row, head) of the batch set to `value` (an int,
    or [B, H] int32). The values are computed from the rows' read (`locate`): XLA
    copies a buffer before a scatter whose values do not depend on its read of that
    buffer."""
    settled = jnp.where(rows.n >= 0, jnp.int32(value), rows.n)
    return write(cache.pending, rows.layer, rows.record, settled)


def read_state(cache: KdaCache, rows: Rows):
    """S_0 per request: [B, H, K, K] f32, a bf16 checkpoint widened exactly (padding
    rows read the null slot)."""
    state = read(cache.state, rows.layer, jnp.where(rows.live, rows.slot, 0))
    return state.astype(jnp.float32)


def read_replay(params: KdaParams, cache: KdaCache, rows: Rows,
                config: KdaConfig) -> Replay:
    """The records the replay folds in, masked past each (request, head)'s n; params
    of the rows' layer."""
    R = cache.pending.shape[-2]
    record = jnp.minimum(rows.record, R - 1)
    keep = (jnp.arange(config.rq)[None, None, :] < rows.n[:, :, None])[..., None]
    in_order = lambda a: a if rows.order is None else jnp.take_along_axis(
        a, rows.order.reshape(rows.order.shape + (1,) * (a.ndim - 3)), axis=2)
    u = jnp.where(keep, in_order(read(cache.corrections, rows.layer, record)), 0.0)
    key_gates = in_order(read(cache.key_gates, rows.layer, record)).astype(jnp.float32)
    kn = jnp.where(keep, l2_normalize(key_gates[..., 0, :]), 0.0)
    d = decay(jnp.moveaxis(key_gates[..., 1, :], 1, 2), params.a_log, params.dt_bias,
              config.lower_bound)
    return Replay(u, kn, jnp.where(keep, jnp.moveaxis(d, 1, 2), 1.0))


def history_positions(rows: Rows):
    """[B, H, 3] int32: the window positions of the three conv inputs before this step,
    those of the last three kept tokens: n .. n + 2, or with trees order[j] + 3 for
    j = n - 3 .. n - 1 (j < 0: j + 3, the inputs before record 0)."""
    j = rows.n[..., None] + jnp.arange(CONV_TAPS - 1) - (CONV_TAPS - 1)  # [B, H, 3]
    if rows.order is None:
        return j + CONV_TAPS - 1
    kept = jnp.take_along_axis(rows.order, jnp.maximum(j, 0), axis=-1)
    return jnp.where(j >= 0, kept, j) + CONV_TAPS - 1


def read_history(cache: KdaCache, rows: Rows):
    """The three conv inputs before this step (`history_positions`) per head. Returns
    [B, 3, 3, H, K] bf16 values (part, position, head, channel)."""
    window = read(cache.conv, rows.layer, jnp.where(rows.live, rows.slot, 0))
    offset = history_positions(rows)[:, None, :, None, :]  # [B, 1, H, 1, 3]
    history = jnp.take_along_axis(window, offset, axis=-1).astype(jnp.float32)
    return jnp.moveaxis(history, -1, 2)


def write_state(cache: KdaCache, rows: Rows, state_0, state_n, folded):
    """cache.state with S_n written in the heads where `folded` ([B, H] bool), S_0 kept
    in a request's other heads; a request with none folded is not written. (S_0 is
    `read_state`'s, so a bf16 checkpoint's heads that keep it round back to themselves.)"""
    S = cache.state.shape[-4]
    state = jnp.where(folded[..., None, None], state_n, state_0)
    return write(cache.state, rows.layer, jnp.where(folded.any(1), rows.slot, S), state)


def keeps(rows: Rows, config: KdaConfig):
    """[B, H] bool: where a verify keeps the n replayed tokens in the records and writes
    its T after them instead of writing S_n (checkpoint_every > 1 and n + T <= RQ)."""
    room = rows.n + config.tokens <= config.rq
    return room & (config.checkpoint_every > 1)


def write_step(cache: KdaCache, rows: Rows, x, history, tokens: Tokens, u, keep,
               config: KdaConfig) -> KdaCache:
    """The cache's records, window and pending after a verify (steps 7-9): per head, the
    T new records at positions base..base+T-1, the window [history, x_0 .. x_{T-1}] at
    base..base+T+2, and pending awaiting(base), with base = n where `keep` ([B, H], see
    `keeps`), else 0; with trees, each node's parent in `nodes` at its record position.
    x: [B, T, 3, H, K] bf16; history: `read_history`'s; u: [B, H, T, K]. Each head's
    rows go to its own offset: scatters of [K] (records) and [3, K] (window) pieces, O(B)
    work."""
    T, H = config.tokens, config.heads
    base = jnp.where(keep, rows.n, 0)  # [B, H]
    heads = jnp.arange(H)[None, :, None]
    record_at = (rows.record[:, None, None], heads, base[..., None] + jnp.arange(T))
    corrections = write(cache.corrections, rows.layer, record_at, u)
    records = jnp.stack([tokens.key, tokens.raw_g], axis=-2)  # [B, T, H, 2, K]
    key_gates = write(cache.key_gates, rows.layer, record_at, jnp.swapaxes(records, 1, 2))
    # [B, H, T + 3, 3 parts, K]: the index's array dims lead, its slices follow
    window = jnp.concatenate([jnp.moveaxis(history, 1, 2).astype(jnp.bfloat16), x], axis=1)
    window = jnp.transpose(window, (0, 3, 1, 2, 4))
    window_at = (rows.slot[:, None, None], slice(None), heads, slice(None),
                 base[..., None] + jnp.arange(T + CONV_TAPS - 1))
    conv = write(cache.conv, rows.layer, window_at, window)
    nodes = cache.nodes
    if nodes is not None:
        parents = node_parents(tokens.parents, T)  # [B or 1, T]
        nodes = write(nodes, rows.layer, record_at,
                      jnp.broadcast_to(parents[:, None, :], base.shape + (T,)))
    return KdaCache(cache.state, conv, corrections, key_gates,
                    write_pending(cache, rows, awaiting(base)), nodes)
