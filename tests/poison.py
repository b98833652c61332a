"""NaN in every part of a cache a verify may not read, so that a stray read shows."""
import dataclasses

import jax.numpy as jnp
import numpy as np

from numpy_model import history_positions, kept_records


def poison(cache, config, slots=None, record_rows=None, layer=None):
    """NaN where a verify must not read: in the null slot, in every record its (record
    row, head) does not keep (at or past the kept count; with trees, every position but
    the kept path's: a verify overwrites T of those and must leave the rest), and, given
    the batch's `slots` and `record_rows`, in every window position of a live request's
    slot outside the three it reads (window[n .. n+2] per head, with trees those of the
    path's last three). Works on stacked caches too: every layer's null slot and unread
    records are poisoned, the window in `layer` (the layer the batch runs in) only.

    Built in NumPy on the host (eager jnp ops would compile a kernel per shape)."""
    new = {name: np.array(getattr(cache, name)) for name in ("state", "conv", "corrections",
                                                              "key_gates")}
    pending = np.asarray(cache.pending)
    nodes = None if cache.nodes is None else np.asarray(cache.nodes)
    stacked = pending.ndim == 3
    n = kept_records(pending, config.rq)
    unread = np.arange(config.rq) >= n[..., None]  # [(L,) R, H, RQ]
    if nodes is not None:  # the kept path's positions are read, every other one not
        unread = np.ones_like(unread)
        for index in np.ndindex(n.shape):
            unread[index][nodes[index][:n[index]]] = False
    new["corrections"][unread] = np.nan
    new["key_gates"][unread] = np.nan
    null = (slice(None), 0) if stacked else (0,)
    new["state"][null] = np.nan
    new["conv"][null] = np.nan
    if slots is not None:
        conv = new["conv"][layer] if stacked else new["conv"]  # a view: [S, 3, H, K, W]
        layer_pending = pending[layer] if stacked else pending
        layer_nodes = nodes if nodes is None or not stacked else nodes[layer]
        S, R = conv.shape[0], layer_pending.shape[0]
        for slot, rec in zip(np.asarray(slots).tolist(), np.asarray(record_rows).tolist()):
            if not 0 < slot < S:
                continue
            for h in range(config.heads):
                count = int(kept_records(layer_pending[rec, h], config.rq)) if 0 <= rec < R else 0
                read = (history_positions(layer_nodes, rec, h, count) if 0 <= rec < R
                        else [0, 1, 2])
                outside = np.ones(conv.shape[-1], bool)
                outside[read] = False
                conv[slot, :, h, :, outside] = np.nan
    return dataclasses.replace(cache, **{name: jnp.asarray(value)
                                         for name, value in new.items()})
