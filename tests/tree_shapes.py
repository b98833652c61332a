"""Token trees for the tests (docs/spec.md, "Token trees"): parents of every shape, a
random path a runner would accept, and the bad-branch scenario every implementation
must pass."""
import dataclasses

import jax.numpy as jnp
import numpy as np

from compare import assert_same_bits
from jax_kda import accept
from jax_kda.testing import random_parents

SHAPES = ("chain", "star", "binary", "random")
BAD_NODE = 2  # `check_bad_branch`: the bad branch's first node, before good node 3


def tree_of(shape, rng, batch, tokens):
    """[B, T] int32 parents of a tree of `shape` for every request."""
    t = np.arange(tokens)
    one = {"chain": t - 1, "star": np.minimum(t - 1, 0), "binary": (t - 1) // 2}
    if shape == "random":
        return random_parents(rng, batch, tokens)
    return jnp.asarray(np.broadcast_to(np.where(t == 0, -1, one[shape]), (batch, tokens)),
                       jnp.int32)


def a_path(rng, parents, tokens):
    """[T] int32: a random path of the tree (node 0 down to a random node), padded
    with random nodes past its end, and how many of its entries a runner would accept
    (the whole path or a prefix, sometimes 0)."""
    node = int(rng.integers(0, tokens))
    path = [node]
    while parents[node] >= 0:
        node = int(parents[node])
        path.append(node)
    path = path[::-1]
    count = int(rng.integers(0, len(path) + 1))
    return path + list(rng.integers(0, tokens, tokens - len(path))), count


def check_bad_branch(verify, spoiled, params, cache, inputs, config, copy=lambda tree: tree):
    """Two branches interleaved, node t's parent t - 2 past node 1 (the odd nodes and
    node 0 one branch, the even nodes past 0 another), and a NaN in node BAD_NODE
    (`spoiled(inputs, BAD_NODE)` makes it) of request 0: every node of the bad branch is
    NaN, the good branch's outputs and records (its nodes before and after the bad one)
    are bitwise those of a clean run, and after accepting the path 0, 1, 3 the next verify
    is the clean run's, bit for bit and finite. verify(params, cache, inputs) -> (out,
    cache); cache() gives the cache to start from, afresh each run (a verify may donate
    it); copy: a copy of a cache that outlives a donation."""
    B, T = inputs.slots.shape[0], config.tokens
    parents = [-1, 0] + [t - 2 for t in range(2, T)]
    good = [0] + list(range(1, T, 2))
    bad = list(range(BAD_NODE, T, 2))
    inputs = dataclasses.replace(inputs, parents=jnp.asarray([parents] * B, jnp.int32))
    path = jnp.asarray([[0, 1, 3] + [0] * (T - 3)] * B, jnp.int32)
    accepted = jnp.full((B,), 3, jnp.int32)
    results = []
    for spoilt in (inputs, spoiled(inputs, BAD_NODE)):
        out, after = verify(params, cache(), spoilt)
        kept = accept(after, inputs.record_rows, accepted, config, path=path)
        results.append((out, copy(after), verify(params, kept, inputs)))
    (out, after, nxt), (bad_out, bad_after, bad_nxt) = results
    assert np.all(np.isnan(np.asarray(bad_out[0, bad], np.float32))), "the bad branch"
    assert_same_bits(bad_out[0, good], out[0, good], "the other branch's outputs")
    assert_same_bits(bad_out[1:], out[1:], "another request")
    row = int(inputs.record_rows[0])
    assert_same_bits(bad_after.corrections[row][:, good], after.corrections[row][:, good],
                     "records")
    assert np.all(np.isfinite(np.asarray(bad_nxt[0], np.float32)))
    assert_same_bits(bad_nxt[0], nxt[0], "the next step's out")
    for name, leaf in vars(nxt[1]).items():
        assert_same_bits(getattr(bad_nxt[1], name), leaf, f"the next step's {name}")
