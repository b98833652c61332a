"""Random, realistically scaled weights, caches and inputs for tests, benchmarks and
examples (never zeros: they hide unwritten outputs)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_kda.config import CONV_TAPS, K, KdaConfig
from jax_kda.pytrees import KdaCache, KdaParams, VerifyInputs


def random_params(key, config: KdaConfig, *, conv_dtype=jnp.float32, conv_bias=True,
                  norm_dtype=jnp.float32) -> KdaParams:
    """Weights scaled as a trained layer's: raw gates and decays spread over their range."""
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


def random_cache(key, config: KdaConfig, num_slots: int, num_records: int) -> KdaCache:
    """A cache as a running decode leaves it: every buffer random, pending in [1, T]."""
    H, RQ = config.heads, config.rq
    k = jax.random.split(key, 5)
    return KdaCache(
        state=0.5 * jax.random.normal(k[0], (num_slots, H, K, K), jnp.float32),
        conv=jax.random.normal(k[1], (num_slots, 3, H, K, RQ + CONV_TAPS - 2)).astype(
            jnp.bfloat16),
        corrections=jax.random.normal(k[2], (num_records, H, RQ, K), jnp.float32),
        key_gates=jax.random.normal(k[3], (num_records, H, RQ, 2, K)).astype(jnp.bfloat16),
        pending=jax.random.randint(k[4], (num_records,), 1, config.tokens + 1, jnp.int32),
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


def random_accepted(rng: np.random.Generator, record_rows, tokens: int):
    """Accepted counts 1..T per request, as sampling would give."""
    return jnp.asarray(rng.integers(1, tokens + 1, size=len(record_rows)), jnp.int32)
