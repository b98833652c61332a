"""Random, realistically scaled weights, caches and inputs for tests, benchmarks and
examples (never zeros: they hide unwritten outputs)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_kda.config import CONV_TAPS, K, KdaConfig
from jax_kda.pytrees import KdaCache, KdaParams, VerifyInputs, cache_shapes


def random_params(key, config: KdaConfig, *, conv_dtype=jnp.float32, conv_bias=True,
                  norm_dtype=jnp.float32, layers: int | None = None) -> KdaParams:
    """Weights scaled as a trained layer's: raw gates and decays spread over their range;
    `layers`: L stacked layers, each drawn on its own."""
    if layers is not None:
        each = [random_params(jax.random.fold_in(key, i), config, conv_dtype=conv_dtype,
                              conv_bias=conv_bias, norm_dtype=norm_dtype)
                for i in range(layers)]
        return jax.tree.map(lambda *leaves: jnp.stack(leaves), *each)
    H = config.heads
    k = jax.random.split(key, 6)
    normal = lambda i, shape, s: s * jax.random.normal(k[i], shape, jnp.float32)
    return KdaParams(
        conv_weight=normal(0, (3, CONV_TAPS, H, K), 0.5).astype(conv_dtype),
        conv_bias=normal(1, (3, H, K), 0.2).astype(conv_dtype) if conv_bias else None,
        a_log=jnp.log(jax.random.uniform(k[2], (H,), jnp.float32, 1.0, 16.0)),
        dt_bias=normal(3, (H, K), 0.5),
        f_b=normal(4, (H, K, K), K**-0.5).astype(jnp.bfloat16),
        norm_weight=(1.0 + normal(5, (K,), 0.1)).astype(norm_dtype),
    )


def random_cache(key, config: KdaConfig, num_slots: int, num_records: int, *,
                 layers: int | None = None) -> KdaCache:
    """A cache as a running decode leaves it: every buffer random, each record row's
    pending in [1, T] (the same in every head and layer, as the protocol keeps it), every
    other buffer different in every layer; with trees, each row's kept tokens at
    increasing record positions from 0, as an accepted path leaves them."""
    shapes = cache_shapes(config, num_slots, num_records, layers)
    k = jax.random.split(key, 6)
    pending = jax.random.randint(k[4], (num_records, 1), 1, config.tokens + 1, jnp.int32)
    nodes = None
    if config.trees:
        RQ = config.rq
        later = jax.vmap(lambda key: jax.random.permutation(key, RQ - 1) + 1)(
            jax.random.split(k[5], num_records))  # [R, RQ - 1]: positions past 0
        chosen = jnp.sort(jnp.where(jnp.arange(RQ - 1) < pending - 1, later, RQ), axis=-1)
        positions = jnp.minimum(jnp.concatenate([jnp.zeros_like(pending), chosen], -1),
                                RQ - 1)
        nodes = jnp.broadcast_to(positions[:, None, :], shapes.nodes.shape)
    return KdaCache(
        state=(0.5 * jax.random.normal(k[0], shapes.state.shape, jnp.float32)).astype(
            shapes.state.dtype),
        conv=jax.random.normal(k[1], shapes.conv.shape).astype(jnp.bfloat16),
        corrections=jax.random.normal(k[2], shapes.corrections.shape, jnp.float32),
        key_gates=jax.random.normal(k[3], shapes.key_gates.shape).astype(jnp.bfloat16),
        pending=jnp.broadcast_to(pending, shapes.pending.shape),
        nodes=nodes,
    )


def random_inputs(key, config: KdaConfig, slots, record_rows) -> VerifyInputs:
    """One step's random token inputs for requests at `slots` / `record_rows` ([B])."""
    slots = jnp.asarray(slots, jnp.int32)
    B, T, H = slots.shape[0], config.tokens, config.heads
    k = jax.random.split(key, 4)
    bf16 = lambda i, shape: jax.random.normal(k[i], shape).astype(jnp.bfloat16)
    return VerifyInputs(
        x=bf16(0, (B, T, 3, H, K)),
        f_a=bf16(1, (B, T, K)),
        beta=bf16(2, (B, T, H)),
        gate=bf16(3, (B, T, H, K)),
        slots=slots,
        record_rows=jnp.asarray(record_rows, jnp.int32),
    )


def random_parents(rng: np.random.Generator, batch: int, tokens: int):
    """[B, T] int32: a random tree per request, node t's parent drawn from 0 .. t - 1."""
    parents = [[-1] + [int(rng.integers(0, t)) for t in range(1, tokens)]
               for _ in range(batch)]
    return jnp.asarray(parents, jnp.int32)


def random_accepted(rng: np.random.Generator, record_rows, tokens: int):
    """Accepted counts 1..T per request, as sampling would give."""
    return jnp.asarray(rng.integers(1, tokens + 1, size=len(record_rows)), jnp.int32)
