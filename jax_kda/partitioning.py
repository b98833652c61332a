"""How a verify, flush or prefill runs on head-sharded arrays under plain `jax.jit`: each
device runs it on its own heads with `sharding.local_config`, and the heads are never
gathered (docs/design.md, "Sharding").

`per_head(body, config, *args)` is `body(*args, config=config)`, split by heads over
the mesh axis on which the largest head-indexed operand (the cache's state) has them:

- where that split is in the arrays' types (a mesh axis of `jax.sharding.AxisType
  .Explicit`), it is known while tracing: a `jax.shard_map` over that axis;
- else (GSPMD: `AxisType.Auto`, or a jit's `in_shardings`) a
  `jax.experimental.custom_partitioning` op: its sharding rule ties the head axes of
  all operands and results to one factor and keeps every other axis whole; its partition
  callback runs `body` on each device's slices. On one device, and inside a
  `jax.shard_map` over every mesh axis, the op is `body` itself, inlined.

Both backends go through it: the XLA backend's body is plain JAX, the kernel's its custom
call.
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec as P

from jax_kda.config import KdaConfig
from jax_kda.sharding import OUTPUT_HEAD_AXIS, leaf_specs, local_config, spec_at

HEADS = "heads"  # the head axis in a layout, before the mesh axis is known


class Layout(NamedTuple):
    """(ndim, head axis or None) of each flat operand and result."""

    operands: tuple
    results: tuple


def per_head(body, config: KdaConfig, *args):
    """body(*args, config=config), run per head shard where the heads are sharded.

    args: pytrees of arrays, head-indexed where they are fields of the library's
    dataclasses (`sharding.HEAD_AXES`), whole on every device otherwise. body returns
    such trees too, its bare arrays being outputs [B, N, H, K].
    """
    plain = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), args)
    results = jax.eval_shape(functools.partial(body, config=config), *plain)
    layout = Layout(_entries(args, lambda _: P()),
                    _entries(results, lambda a: spec_at(a.ndim, OUTPUT_HEAD_AXIS, HEADS)))
    leaves = jax.tree.leaves(args)
    split = _split(leaves, layout.operands, [jax.typeof(a).sharding for a in leaves])
    if split is None:
        return _partitioned(body, config, layout, *args)
    mesh, axis = split
    operands, outputs = (_shardings(mesh, entries, axis, tree) for entries, tree in
                         ((layout.operands, args), (layout.results, results)))
    run = jax.shard_map(functools.partial(body, config=local_config(config, _size(mesh, axis))),
                        mesh=mesh, axis_names=set(_names(axis)),
                        in_specs=jax.tree.map(lambda s: s.spec, operands),
                        out_specs=jax.tree.map(lambda s: s.spec, outputs))
    return run(*jax.reshard(args, operands))  # a local slice where an operand was whole


def _entries(tree, other) -> tuple:
    """(ndim, head axis or None) of each leaf of `tree`; other(leaf): the spec of a leaf
    outside the library's dataclasses."""
    specs = jax.tree.leaves(leaf_specs(tree, HEADS, other))
    return tuple((leaf.ndim, spec.index(HEADS) if HEADS in spec else None)
                 for leaf, spec in zip(jax.tree.leaves(tree), specs))


def _split(leaves, entries, shardings):
    """(mesh, axis): the mesh axis (or tuple of axes) on which `shardings` put the heads
    of the largest head-indexed leaf that has them split; None where none has."""
    found = []
    for leaf, (ndim, head), sharding in zip(leaves, entries, shardings):
        spec = tuple(getattr(sharding, "spec", ())) + (None,) * ndim
        if head is not None and spec[head] is not None:
            found.append((math.prod(leaf.shape), sharding.mesh, spec[head]))
    return max(found, key=lambda f: f[0])[1:] if found else None


def _names(axis) -> tuple:
    return axis if isinstance(axis, tuple) else (axis,)


def _size(mesh, axis) -> int:
    """Devices the mesh axis (or tuple of axes) spans."""
    return math.prod(mesh.shape[a] for a in _names(axis))


def _shardings(mesh, entries, axis, like):
    """`NamedSharding`s of the flat `entries`, heads over `axis`, in `like`'s tree."""
    specs = [P() if head is None else spec_at(ndim, head - ndim, axis)
             for ndim, head in entries]
    return jax.tree.structure(like).unflatten([NamedSharding(mesh, s) for s in specs])


def _run(body, config, layout, *args):
    return body(*args, config=config)


_partitioned = custom_partitioning(_run, static_argnums=(0, 1, 2))


def _rule(body, config, layout: Layout, mesh, operand_types, result_types):
    """Shardy's rule: factor h for every head axis; every other axis a factor of its own
    that is kept whole."""
    def factors(entries, side):
        return [" ".join("h" if d == head else f"{side}{i}_{d}" for d in range(ndim))
                for i, (ndim, head) in enumerate(entries)]

    operands, results = factors(layout.operands, "a"), factors(layout.results, "r")
    whole = tuple(f for f in " ".join(operands + results).split() if f != "h")
    return (", ".join(operands) + " -> " + ", ".join(results),
            {"need_replication_factors": whole})


def _head_split(mesh, layout: Layout, arg_shapes):
    """(axis, shards) of the operands as GSPMD has sharded them: (None, 1) unsplit."""
    leaves = jax.tree.leaves(arg_shapes)
    split = _split(leaves, layout.operands, [s.sharding for s in leaves])
    return (None, 1) if split is None else (split[1], _size(mesh, split[1]))


def _partition(body, config, layout: Layout, mesh, arg_shapes, result_shape):
    axis, shards = _head_split(mesh, layout, arg_shapes)
    return (mesh, functools.partial(body, config=local_config(config, shards)),
            _shardings(mesh, layout.results, axis, result_shape),
            _shardings(mesh, layout.operands, axis, arg_shapes))


def _infer(body, config, layout: Layout, mesh, arg_shapes, result_shape):
    """The results' shardings for XLA's GSPMD propagation (Shardy uses `_rule`)."""
    return _shardings(mesh, layout.results, _head_split(mesh, layout, arg_shapes)[0],
                      result_shape)


_partitioned.def_partition(_partition, infer_sharding_from_operands=_infer,
                           sharding_rule=_rule)
