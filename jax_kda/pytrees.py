"""The arrays a KDA layer holds, as registered pytree dataclasses (docs/spec.md, "Data").

Sizes: B requests, T tokens, H heads, K = 128, RQ record tokens, W = RQ + 3 window
positions, S state slots (slot 0 is the null slot), R record rows. Every field is an
array; nothing here is static. Params and caches of L stacked layers carry a leading
layer axis on every leaf (as `jax.tree.map(jnp.stack, ...)` of per-layer ones makes
them); a step's inputs never do.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jax_kda.config import K, KdaConfig, integer


def _pytree(cls):
    """A dataclass registered as a pytree of its fields and for `jax.export`."""
    fields = [f.name for f in dataclasses.fields(cls)]
    jax.tree_util.register_dataclass(cls, data_fields=fields, meta_fields=[])
    jax.export.register_pytree_node_serialization(
        cls, serialized_name=f"jax_kda.{cls.__name__}",
        serialize_auxdata=lambda _: b"", deserialize_auxdata=lambda _: ())
    return cls


@_pytree
@dataclasses.dataclass(frozen=True)
class KdaParams:
    """Weights of one KDA layer (each with a leading [L] when stacked).

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
    """Per-request decode state: the checkpoint plus the records of the last verify
    (each with a leading [L] when stacked).

    state: [S, H, K, K] `KdaConfig.state_dtype` (f32 by default, or bf16), checkpoint
      per slot, [value row, key column].
    conv: [S, 3, H, K, W] bf16, convolution window per slot: the three inputs before
      record token 0, then at position j + 3 the input of record token j.
    corrections: [R, H, RQ, K] f32, recorded u_t per value row.
    key_gates: [R, H, RQ, 2, K] bf16, recorded key (index 0) and raw gate (index 1).
    pending: [R, H] int32, per record row and head: n >= 0 accepted tokens kept in the
      records (positions 0..n-1) and not yet in the checkpoint, or, while the last
      verify awaits its `accept`, -(m + 1): it kept m records and wrote its own after
      them (`awaiting`, `kept`).
    nodes: [R, H, RQ] int32 with trees (`KdaConfig.trees`), else None: while the last
      verify awaits its accept, each of its records' parent node; once accepted, the
      record positions of the kept tokens in replay order (docs/spec.md, "Token
      trees").

    The state as of a request's last accepted token is (checkpoint, records, pending,
    nodes) together; `flush` folds it into the checkpoint alone.
    """

    state: jax.Array
    conv: jax.Array
    corrections: jax.Array
    key_gates: jax.Array
    pending: jax.Array
    nodes: jax.Array | None = None


AWAITING = -1  # pending of a record row awaiting the accept of a verify that kept nothing


def awaiting(kept_count):
    """pending of a record row whose last verify kept `kept_count` records and awaits
    its accept: -(kept_count + 1) (an int or an int32 array)."""
    return AWAITING - kept_count


def kept(pending, record_tokens: int):
    """The records a verify of the row keeps and replays, [...] int32 from pending
    [...] int32: pending itself where >= 0, m where it awaits an accept
    (pending = -(m + 1): a forgotten accept rejects the last verify's tokens), clamped
    to [0, record_tokens]."""
    return jnp.clip(jnp.where(pending < 0, ~pending, pending), 0, record_tokens)


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
    parents: [B, T] int32 or None: with trees (`KdaConfig.trees`), each node's parent
      (-1 for node 0, then 0 <= parents[b, t] < t); None is the chain (docs/spec.md,
      "Token trees").
    """

    x: jax.Array
    f_a: jax.Array
    beta: jax.Array
    gate: jax.Array
    slots: jax.Array
    record_rows: jax.Array
    parents: jax.Array | None = None


def cache_shapes(config: KdaConfig, num_slots: int, num_records: int,
                 layers: int | None = None) -> KdaCache:
    """The cache's shapes and dtypes (`jax.ShapeDtypeStruct`s): the state in
    config.state_dtype; nodes None without trees."""
    H, RQ, W = config.heads, config.rq, config.window
    lead = () if layers is None else (layers,)
    S, R = num_slots, num_records
    struct = lambda shape, dtype: jax.ShapeDtypeStruct(lead + shape, dtype)
    return KdaCache(
        state=struct((S, H, K, K), config.state_dtype),
        conv=struct((S, 3, H, K, W), jnp.bfloat16),
        corrections=struct((R, H, RQ, K), jnp.float32),
        key_gates=struct((R, H, RQ, 2, K), jnp.bfloat16),
        pending=struct((R, H), jnp.int32),
        nodes=struct((R, H, RQ), jnp.int32) if config.trees else None,
    )


def init_cache(config: KdaConfig, num_slots: int, num_records: int, *,
               layers: int | None = None) -> KdaCache:
    """A zeroed cache of `num_slots` state slots (slot 0 is the null slot, so >= 2 to
    hold a request) and `num_records` record rows (>= 1); `layers`: L stacked layers
    (a leading [L] on every leaf), None for one layer."""
    sizes = {}
    for name, value, least in (("num_slots", num_slots, 2), ("num_records", num_records, 1),
                               ("layers", layers, 1)):
        if name == "layers" and value is None:
            continue
        sizes[name] = integer(value, lambda v: v >= least)
        if sizes[name] is None:
            extra = " (slot 0 is null)" if name == "num_slots" else ""
            raise ValueError(f"{name}: expected an int >= {least}{extra}, got {value!r}")
    num_slots, num_records, layers = (sizes.get(n) for n in ("num_slots", "num_records",
                                                               "layers"))
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype),
                        cache_shapes(config, num_slots, num_records, layers))


@_pytree
@dataclasses.dataclass(frozen=True)
class PrefillInputs:
    """A batch of prompts, or pieces of prompts, for `prefill`.

    x: [B, P, 3, H, K] bf16, q, k, v projections before the short convolution.
    f_a: [B, P, K] bf16, the gate's low-rank activations.
    beta: [B, P, H] bf16, beta logits (sigmoid inside).
    gate: [B, P, H, K] bf16, output-gate logits (sigmoid inside the norm).
    lengths: [B] int32, tokens of each prompt (clamped to [0, P]); the rest is padding.
    slots: [B] int32, state slot per request; <= 0 (or >= S) is a padding row.
    record_rows: [B] int32, the request's record row (its kept records are folded in
      where it resumes, and its pending count is reset); < 0 (or >= R): none.
    resume: [B] bool or None: True continues the request from its cache (its checkpoint
      with the kept records folded in, the window's history), as a later piece of its
      prompt; False, or None for every row, starts it from a zero state and history.
    """

    x: jax.Array
    f_a: jax.Array
    beta: jax.Array
    gate: jax.Array
    lengths: jax.Array
    slots: jax.Array
    record_rows: jax.Array
    resume: jax.Array | None = None
