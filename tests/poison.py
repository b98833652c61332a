"""NaN in every part of a cache a verify may not read, so that a stray read shows."""
import jax.numpy as jnp
import numpy as np

from jax_kda import KdaCache


def poison(cache, config):
    """NaN in the null slot and in every record past its pending count (a verify
    overwrites those up to T and must leave the rest)."""
    n = np.clip(np.asarray(cache.pending), 0, config.rq)
    unread = (np.arange(config.rq)[None, :] >= n[:, None])[:, None, :]
    return KdaCache(
        state=cache.state.at[0].set(jnp.nan), conv=cache.conv.at[0].set(jnp.nan),
        corrections=jnp.where(unread[..., None], jnp.nan, cache.corrections),
        key_gates=jnp.where(unread[..., None, None], jnp.nan, cache.key_gates),
        pending=cache.pending)
