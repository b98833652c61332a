"""Heads sharded over devices: where each array of a layer keeps its heads, the
`PartitionSpec`s of a head-sharded layout, and the config a shard runs with.

The verify, accept, flush and prefill are independent per head, so a layer whose
head-indexed arrays are split by heads over a mesh axis (tensor parallelism) runs with
no communication: each device runs its H / shards heads on its own slices, with
`local_config`. Under `jax.shard_map` the user does that split (in_specs and out_specs
from `head_specs` and `output_spec`); under `jax.jit` with head-sharded inputs the
library's GSPMD rule does it (`jax_kda.partitioning`). docs/design.md, "Sharding".
"""
from __future__ import annotations

import dataclasses

import jax
from jax.sharding import PartitionSpec as P

from jax_kda.config import KdaConfig, integer
from jax_kda.pytrees import KdaCache, KdaParams, PrefillInputs, VerifyInputs

# The head axis of each head-indexed field, counted from the end: the same stacked (a
# leading [L]) or not. Fields not here (f_a, norm_weight, slots, record_rows, parents,
# lengths, resume) are shared by the heads: every shard holds them whole.
HEAD_AXES = {
    "x": -2, "beta": -1, "gate": -2,  # VerifyInputs, PrefillInputs
    "conv_weight": -2, "conv_bias": -2, "a_log": -1, "dt_bias": -2, "f_b": -3,  # KdaParams
    "state": -3, "conv": -3, "corrections": -3, "key_gates": -4, "pending": -1,  # KdaCache
    "nodes": -2,
}
OUTPUT_HEAD_AXIS = -2  # out [B, N, H, K] of a verify (N = T) or a prefill (N = P)
LAYER_TREES = (KdaParams, KdaCache, VerifyInputs, PrefillInputs)


def spec_at(ndim: int, head_axis: int, axis) -> P:
    """The spec of an [ndim] array whose heads (at head_axis, from the end) go over the
    mesh axis `axis` (a name, a tuple of names, or None: not sharded)."""
    return P(*(None,) * (ndim + head_axis), axis)


def leaf_specs(tree, axis, other):
    """`head_specs`, with other(leaf) the spec of each array outside the library's
    dataclasses."""
    def field(name, value):
        if value is None:
            return None
        return spec_at(value.ndim, HEAD_AXES[name], axis) if name in HEAD_AXES else P()

    def fields(node):
        if not isinstance(node, LAYER_TREES):
            return other(node)
        return type(node)(**{f.name: field(f.name, getattr(node, f.name))
                             for f in dataclasses.fields(node)})

    return jax.tree.map(fields, tree, is_leaf=lambda n: isinstance(n, LAYER_TREES))


def head_specs(tree, axis):
    """The `PartitionSpec`s of a head-sharded layout, a tree like `tree`.

    tree: any pytree of arrays (or `jax.ShapeDtypeStruct`s) holding `KdaParams`,
      `KdaCache`, `VerifyInputs`, `PrefillInputs`, stacked (a leading [L]) or not, and
      other arrays (a layer index, accepted counts).
    axis: the mesh axis (or tuple of axes) the heads go over.

    Returns the tree with each array's spec: its head axis over `axis` (x [B, N, 3, H,
    K] -> P(None, None, None, axis), state [(L,) S, H, K, K] -> P((None,) None, axis),
    ...), P() (whole on every device) for the arrays shared by the heads (f_a,
    norm_weight, slots, record_rows, ...) and for arrays outside those dataclasses.
    For `jax.shard_map`'s in_specs and out_specs, or `NamedSharding`s for `jax.jit`;
    a verify's or prefill's `out` takes `output_spec(axis)`.
    """
    return leaf_specs(tree, axis, lambda _: P())


def output_spec(axis) -> P:
    """The spec of out [B, N, H, K] (a verify's or a prefill's) with its heads over
    `axis`."""
    return spec_at(4, OUTPUT_HEAD_AXIS, axis)


def local_config(config: KdaConfig, shards: int) -> KdaConfig:
    """The config of one shard of `shards` (>= 1, dividing config.heads): heads =
    H / shards, the rest as in `config`. Under `jax.shard_map` the body calls the
    library with it."""
    count = integer(shards, lambda v: v >= 1 and config.heads % v == 0)
    if count is None:
        raise ValueError(f"shards: expected an int >= 1 dividing config.heads="
                         f"{config.heads}, got {shards!r}")
    return dataclasses.replace(config, heads=config.heads // count)
