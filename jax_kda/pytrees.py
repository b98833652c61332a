"""The arrays a KDA layer holds, as registered pytree dataclasses (SPEC.md section 2).

Sizes: B requests, T tokens, H heads, K = 128, RQ record tokens, S state slots (slot 0
is the null slot), R record rows. Every field is an array; nothing here is static.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jax_kda.config import CONV_TAPS, K, KdaConfig


def _pytree(cls):
    fields = [f.name for f in dataclasses.fields(cls)]
    return jax.tree_util.register_dataclass(cls, data_fields=fields, meta_fields=[])


@_pytree
@dataclasses.dataclass(frozen=True)
class KdaParams:
    """Weights of one KDA layer.

    conv_weight: [3, 4, H, K] f32 or bf16, depthwise conv taps (part q/k/v, tap, channel).
    conv_bias: [3, H, K] (conv_weight's dtype) or None.
    a_log: [H] f32.
    dt_bias: [H, K] f32.
    f_b: [H, K, K] bf16, the gate up-projection: feature row, rank column.
    norm_weight: [K] f32 or bf16, the gated RMSNorm weight shared by the heads.
    """

    conv_weight: jax.Array
    conv_bias: jax.Array | None
    a_log: jax.Array
    dt_bias: jax.Array
    f_b: jax.Array
    norm_weight: jax.Array


@_pytree
@dataclasses.dataclass(frozen=True)
class KdaCache:
    """Per-request decode state: the checkpoint plus the records of the last verify.

    state: [S, H, K, K] f32, checkpoint per slot, [value row, key column].
    conv: [S, 3, H, K, RQ + 2] bf16, convolution window per slot.
    corrections: [R, H, RQ, K] f32, recorded u_t per value row.
    key_gates: [R, H, RQ, 2, K] bf16, recorded key (index 0) and raw gate (index 1).
    pending: [R] int32, accepted tokens of the last verify not yet in the checkpoint.

    The state as of a request's last accepted token is (checkpoint, records, pending)
    together; `flush` folds it into the checkpoint alone.
    """

    state: jax.Array
    conv: jax.Array
    corrections: jax.Array
    key_gates: jax.Array
    pending: jax.Array


@_pytree
@dataclasses.dataclass(frozen=True)
class VerifyInputs:
    """One verify step's per-token inputs.

    x: [B, T, 3, H, K] bf16, q, k, v projections before the short convolution.
    f_a: [B, T, K] bf16, the gate's low-rank activations.
    beta: [B, T, H] bf16, beta logits (sigmoid inside).
    gate: [B, T, H, K] bf16, output-gate logits (sigmoid inside the norm).
    slots: [B] int32, state slot per request; <= 0 (or >= S) is a padding row.
    record_rows: [B] int32, record row per request; < 0 (or >= R) keeps no records.
    """

    x: jax.Array
    f_a: jax.Array
    beta: jax.Array
    gate: jax.Array
    slots: jax.Array
    record_rows: jax.Array


def init_cache(config: KdaConfig, num_slots: int, num_records: int) -> KdaCache:
    """A zeroed cache of `num_slots` state slots (slot 0 is the null slot, so >= 2 to
    hold a request) and `num_records` record rows (>= 1)."""
    if not isinstance(num_slots, int) or num_slots < 2:
        raise ValueError(f"num_slots: expected an int >= 2 (slot 0 is null), got {num_slots!r}")
    if not isinstance(num_records, int) or num_records < 1:
        raise ValueError(f"num_records: expected an int >= 1, got {num_records!r}")
    H, RQ = config.heads, config.rq
    return KdaCache(
        state=jnp.zeros((num_slots, H, K, K), jnp.float32),
        conv=jnp.zeros((num_slots, 3, H, K, RQ + CONV_TAPS - 2), jnp.bfloat16),
        corrections=jnp.zeros((num_records, H, RQ, K), jnp.float32),
        key_gates=jnp.zeros((num_records, H, RQ, 2, K), jnp.bfloat16),
        pending=jnp.zeros((num_records,), jnp.int32),
    )


@_pytree
@dataclasses.dataclass(frozen=True)
class PrefillInputs:
    """A batch of prompts for `prefill`, each run from a zero state and conv history.

    x: [B, L, 3, H, K] bf16, q, k, v projections before the short convolution.
    f_a: [B, L, K] bf16, the gate's low-rank activations.
    beta: [B, L, H] bf16, beta logits (sigmoid inside).
    gate: [B, L, H, K] bf16, output-gate logits (sigmoid inside the norm).
    lengths: [B] int32, tokens of each prompt (clamped to [0, L]); the rest is padding.
    slots: [B] int32, state slot per request; <= 0 (or >= S) is a padding row.
    record_rows: [B] int32, record row whose pending count is reset; < 0 (or >= R): none.
    """

    x: jax.Array
    f_a: jax.Array
    beta: jax.Array
    gate: jax.Array
    lengths: jax.Array
    slots: jax.Array
    record_rows: jax.Array
