"""NaN in every part of a cache a verify may not read, so that a stray read shows."""
import dataclasses

import jax.numpy as jnp
import numpy as np

from numpy_model import kept_records


def poison(cache, config, slots=None, record_rows=None, layer=None):
    """NaN where a verify must not read: in the null slot, in every record at or past
    its (record row, head)'s kept count (a verify overwrites T of those and must leave
    the rest), and, given the batch's `slots` and `record_rows`, in every window
    position of a live request's slot outside the three it reads (window[n .. n+2] per
    head). Works on stacked caches too: every layer's null slot and unread records are
    poisoned, the window in `layer` (the layer the batch runs in) only.

    Built in NumPy on the host (eager jnp ops would compile a kernel per shape)."""
    new = {name: np.array(getattr(cache, name)) for name in ("state", "conv", "corrections",
                                                              "key_gates")}
    pending = np.asarray(cache.pending)
    stacked = pending.ndim == 3
    n = kept_records(pending, config.rq)
    unread = np.arange(config.rq) >= n[..., None]  # [(L,) R, H, RQ]
    new["corrections"][unread] = np.nan
    new["key_gates"][unread] = np.nan
    null = (slice(None), 0) if stacked else (0,)
    new["state"][null] = np.nan
    new["conv"][null] = np.nan
    if slots is not None:
        conv = new["conv"][layer] if stacked else new["conv"]  # a view: [S, 3, H, K, W]
        layer_pending = pending[layer] if stacked else pending
        S, R = conv.shape[0], layer_pending.shape[0]
        for slot, rec in zip(np.asarray(slots).tolist(), np.asarray(record_rows).tolist()):
            if not 0 < slot < S:
                continue
            starts = (kept_records(layer_pending[rec], config.rq) if 0 <= rec < R
                      else np.zeros(config.heads, int))
            for h, start in enumerate(starts.tolist()):
                outside = np.ones(conv.shape[-1], bool)
                outside[start:start + 3] = False
                conv[slot, :, h, :, outside] = np.nan
    return dataclasses.replace(cache, **{name: jnp.asarray(value)
                                         for name, value in new.items()})
