"""A verify's token tree (docs/spec.md, "Token trees"): its parents as the contract reads
them, each node's nearest ancestors, and which nodes lie on which node's path.

Nodes are numbered in topological order, node 0 the request's last sampled token (its
parent, -1, the request's state). Positions before node 0 continue a path into the
conv window's history: -1, -2, -3 are history[2], history[1], history[0].
"""
from __future__ import annotations

import jax.numpy as jnp


def node_parents(parents, tokens: int):
    """[B, T] int32: `parents` as the contract reads them: node 0's is -1, a node t's
    outside [0, t) is 0 (a child of node 0); None is the chain, t - 1."""
    t = jnp.arange(tokens)
    if parents is None:
        return (t - 1)[None, :]
    valid = (parents >= 0) & (parents < t)
    return jnp.where(t == 0, -1, jnp.where(valid, parents, 0)).astype(jnp.int32)


def parent_of(parents, nodes):
    """The parent of each of `nodes` ([B, ...] int32, positions >= -3) in the tree of
    `parents` ([B, T], as `node_parents` reads them); a history position's is the one
    before it."""
    B = parents.shape[0]
    flat = nodes.reshape(B, -1)
    found = jnp.take_along_axis(parents, jnp.maximum(flat, 0), axis=1)
    return jnp.where(flat >= 0, found, flat - 1).reshape(nodes.shape)


def nearest_ancestors(parents, depth: int):
    """[B, T, depth] int32: each node's `depth` nearest ancestors, nearest first, the
    window's history (-1, -2, ...) where its path is shorter."""
    B, T = parents.shape
    found = [jnp.broadcast_to(parents, (B, T))]
    for _ in range(depth - 1):
        found.append(parent_of(parents, found[-1]))
    return jnp.stack(found, axis=-1)


def ancestor_mask(parents):
    """[B, T, T] bool: [t, s] where node s is a strict ancestor of node t."""
    B, T = parents.shape
    rows = []
    for t in range(T):
        parent = parents[:, t]
        row = jnp.arange(T)[None, :] == parent[:, None]  # [B, T]: the parent itself
        if t:  # and the parent's ancestors (parent < t: its row is made)
            above = jnp.take_along_axis(jnp.stack(rows, axis=1),
                                        jnp.clip(parent, 0, t - 1)[:, None, None], axis=1)
            row = row | (above[:, 0] & (parent >= 0)[:, None])
        rows.append(row)
    return jnp.stack(rows, axis=1)
