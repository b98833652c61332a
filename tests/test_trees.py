"""Token trees (docs/spec.md, "Token trees") on the JAX paths, the stock scan and the XLA
backend, against the independent float64 model: trees of every shape (chain, star,
binary, random) at T = 2, 8 and 16 over episodes of verifies, path accepts (of every
length, broken, forgotten, repeated) and flushes; a NaN in one branch; parents the
contract reads otherwise; a prefill that resumes a path; vmap and export with parents;
the errors."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import bad_values
import numpy_model
from compare import assert_same_bits, bf16_ulps, differing_bits, out_error, scaled_error
from jax_kda import (KdaConfig, PrefillInputs, accept, check_inputs, flush, fused_verify,
                     init_cache, prefill)
from jax_kda.ref import stock_prefill
from poison import poison
from tree_shapes import SHAPES, a_path, check_bad_branch, tree_of

NUM_SLOTS, NUM_RECORDS, HEADS, STEPS = 7, 5, 2, 3
# as tests/test_parity.py's against the model (the same rounding points, a tree's path
# is a chain's token by token); nodes, like pending, are set by rule
TOLERANCES = {"out": 4 * 2**-8, "state": 1e-5, "corrections": 2**-8, "keys": 1,
              "gates": 0, "window": 0, "pending": 0, "nodes": 0}


def errors(out, cache, expected_out, expected):
    key_gates, expected_key_gates = np.asarray(cache.key_gates), expected.key_gates
    return {
        "out": out_error(out, expected_out),
        "state": scaled_error(cache.state, expected.state),
        "corrections": scaled_error(cache.corrections, expected.corrections),
        "keys": float(bf16_ulps(key_gates[..., 0, :], expected_key_gates[..., 0, :]).max()),
        "gates": float(bf16_ulps(key_gates[..., 1, :], expected_key_gates[..., 1, :]).max()),
        "window": differing_bits(cache.conv, expected.conv),
        "pending": differing_bits(cache.pending, expected.pending),
        "nodes": differing_bits(cache.nodes, expected.nodes),
    }


@pytest.mark.parametrize("tokens", [2, 8, 16])
@pytest.mark.parametrize("shape", SHAPES)
def test_episode_against_the_model(tokens, shape, implementation, draw):
    config = KdaConfig(heads=HEADS, tokens=tokens, trees=True, gate_mode=tokens % 3 % 2)
    seed = 1000 + 10 * tokens + SHAPES.index(shape)
    rng = np.random.default_rng(seed)
    keys = jax.random.split(draw.key(seed), 2 + STEPS)
    params = draw.params(keys[0], config)
    cache = draw.cache(keys[1], config, NUM_SLOTS, NUM_RECORDS)
    slots = jnp.asarray([3, 0, 1, 5], jnp.int32)  # a padding row among them
    rows = jnp.asarray([2, 4, 0, -1], jnp.int32)  # and a request without records
    worst = {}
    for step in range(STEPS):
        cache = poison(cache, config, slots, rows)
        parents = tree_of(shape, rng, 4, tokens)
        inputs = dataclasses.replace(draw.inputs(keys[2 + step], config, slots, rows),
                                     parents=parents)
        out, after = implementation(params, cache, inputs, config)
        model_out, model_cache = numpy_model.verify(params, cache, inputs, config)
        assert np.all(np.isfinite(model_out)), "the model read a poisoned value"
        for quantity, value in errors(out, after, model_out, model_cache).items():
            worst[quantity] = max(worst.get(quantity, 0.0), value)
        reads = [numpy_model.tree_parents(p, tokens) for p in np.asarray(parents)]
        paths, counts = zip(*(a_path(rng, p, tokens) for p in reads))
        path, accepted = jnp.asarray(paths, jnp.int32), jnp.asarray(counts, jnp.int32)
        if step == 1:  # a path broken after its first node
            path = path.at[0, 1].set((path[0, 1] + 1) % tokens)
        cache = accept(after, rows, accepted, config, path=path)
        expected = numpy_model.accept(after, rows, accepted, config, path=path)
        worst["pending"] += differing_bits(cache.pending, expected.pending)
        worst["nodes"] += differing_bits(cache.nodes, expected.nodes)
    flushed = flush(params, cache, slots, rows, config)
    expected = numpy_model.flush(params, cache, slots, rows, config)
    worst["state"] = max(worst["state"], scaled_error(flushed.state, expected.state))
    worst["window"] += differing_bits(flushed.conv, expected.conv)
    too_big = {k: v for k, v in worst.items() if not v <= TOLERANCES[k]}
    assert not too_big, f"errors above TOLERANCES: {too_big}"


def test_a_chain_tree_is_the_chain(implementations, draw):
    """parents t - 1 give the chain's results, within FP32 reordering (a tree's masked
    form; the stock steps in a loop rather than a scan, which XLA may fuse otherwise)."""
    config = KdaConfig(heads=HEADS, tokens=5, trees=True)
    params = draw.params(draw.key(11), config)
    cache = draw.cache(draw.key(12), config, NUM_SLOTS, NUM_RECORDS)
    inputs = draw.inputs(draw.key(13), config, jnp.asarray([1, 2], jnp.int32),
                         jnp.asarray([0, 3], jnp.int32))
    chain = dataclasses.replace(inputs, parents=tree_of("chain", None, 2, 5))
    for verify in implementations.values():
        out, after = verify(params, cache, inputs, config)
        tree_out, tree_after = verify(params, cache, chain, config)
        assert out_error(tree_out, out) <= 2**-8
        assert scaled_error(tree_after.corrections, after.corrections) <= 1e-6
        # the convolution's taps gathered rather than sliced: a fusion of its own
        assert bf16_ulps(tree_after.key_gates, after.key_gates).max() <= 1
        for field in ("conv", "pending", "nodes"):
            assert_same_bits(getattr(tree_after, field), getattr(after, field), field)


def test_a_bad_branch_reaches_no_other(implementation, draw):
    """tests/tree_shapes.py's `check_bad_branch`, the bad node's x.v NaN."""
    config = KdaConfig(heads=HEADS, tokens=5, trees=True)
    params = draw.params(draw.key(21), config)
    cache = draw.cache(draw.key(22), config, NUM_SLOTS, NUM_RECORDS)
    inputs = draw.inputs(draw.key(23), config, jnp.asarray([2, 4], jnp.int32),
                         jnp.asarray([1, 2], jnp.int32))
    check_bad_branch(lambda p, c, i: implementation(p, c, i, config),
                     lambda i, node: bad_values.spoiled(i, "x.v", node, "nan"), params,
                     lambda: cache, inputs, config)


def awaiting_cache(config, draw, parents):
    """A cache whose record row 0 awaits the accept of a verify of `parents` ([T])."""
    params = draw.params(draw.key(31), config)
    cache = draw.cache(draw.key(32), config, NUM_SLOTS, NUM_RECORDS)
    inputs = dataclasses.replace(
        draw.inputs(draw.key(33), config, jnp.asarray([1], jnp.int32),
                    jnp.asarray([0], jnp.int32)),
        parents=jnp.asarray([parents], jnp.int32))
    return fused_verify(params, cache, inputs, config, backend="jax")[1]


PATHS = [  # (path, accepted, kept): the accept keeps a prefix of the path
    ([0, 2, 3, 0], 3, 3),  # a whole path
    ([0, 2, 3, 0], 2, 2),  # a prefix of it
    ([0, 2, 3, 0], 0, 0),  # nothing
    ([0, 2, 3, 0], 9, 3),  # a count past T is clamped, the path ends at node 3
    ([0, 1, 3, 0], 3, 2),  # node 3 is not a child of node 1: the path ends there
    ([2, 3, 0, 0], 2, 0),  # the first entry must be node 0
    ([0, 7, 0, 0], 2, 1),  # a node past T ends it
    ([0, -1, 0, 0], 2, 1),  # a negative one too
]


@pytest.mark.parametrize("path, accepted, kept", PATHS,
                         ids=[f"{p}-a{a}" for p, a, _ in PATHS])
def test_accept_keeps_a_path(path, accepted, kept, draw):
    config = KdaConfig(heads=HEADS, tokens=4, trees=True)
    cache = awaiting_cache(config, draw, [-1, 0, 0, 2])
    rows = jnp.asarray([0], jnp.int32)
    new = accept(cache, rows, jnp.asarray([accepted], jnp.int32), config,
                 path=jnp.asarray([path], jnp.int32))
    np.testing.assert_array_equal(np.asarray(new.pending)[0], kept)
    np.testing.assert_array_equal(np.asarray(new.nodes)[0, :, :kept],
                                  np.broadcast_to(path[:kept], (HEADS, kept)))
    for field in ("state", "conv", "corrections", "key_gates"):  # only pending and nodes
        assert_same_bits(getattr(new, field), getattr(cache, field), field)
    assert_same_bits(accept(new, rows, jnp.asarray([accepted], jnp.int32), config,
                            path=jnp.asarray([path], jnp.int32)).nodes, new.nodes,
                     "a repeated accept")
    if kept < min(accepted, 4):
        with pytest.raises(ValueError, match=rf"path\[0, {kept}\]={path[kept]} is not "):
            check_inputs(cache, jnp.asarray([1], jnp.int32), rows, config,
                         accepted=jnp.asarray([accepted], jnp.int32),
                         path=jnp.asarray([path], jnp.int32))


def test_a_forgotten_accept_replays_nothing(draw):
    """Without the accept the next verify replays none of the tree's nodes: it equals a
    verify after accepting 0."""
    config = KdaConfig(heads=HEADS, tokens=4, trees=True)
    cache = awaiting_cache(config, draw, [-1, 0, 0, 2])
    params = draw.params(draw.key(31), config)
    inputs = draw.inputs(draw.key(34), config, jnp.asarray([1], jnp.int32),
                         jnp.asarray([0], jnp.int32))
    forgot = fused_verify(params, cache, inputs, config, backend="jax")
    rejected = fused_verify(params, accept(cache, inputs.record_rows, jnp.zeros(1, jnp.int32),
                                           config), inputs, config, backend="jax")
    assert_same_bits(forgot[0], rejected[0], "out")


def test_parents_out_of_range_are_read_as_the_contract_says(implementation, draw):
    """Node 0's parent is -1 whatever is given, a node t's outside [0, t) is 0: the
    results are those of the tree so read, bit for bit, and check_inputs reports each."""
    config = KdaConfig(heads=HEADS, tokens=5, trees=True)
    params = draw.params(draw.key(41), config)
    cache = draw.cache(draw.key(42), config, NUM_SLOTS, NUM_RECORDS)
    inputs = draw.inputs(draw.key(43), config, jnp.asarray([1, 2], jnp.int32),
                         jnp.asarray([0, 1], jnp.int32))
    given = jnp.asarray([[3, 0, 5, -4, 1], [-1, 0, 1, 3, 2]], jnp.int32)
    read = jnp.asarray([[-1, 0, 0, 0, 1], [-1, 0, 1, 0, 2]], jnp.int32)
    out, after = implementation(params, cache, dataclasses.replace(inputs, parents=given),
                                config)
    same_out, same = implementation(params, cache, dataclasses.replace(inputs, parents=read),
                                    config)
    assert_same_bits(out, same_out, "out")
    for field, leaf in vars(after).items():
        assert_same_bits(leaf, getattr(same, field), field)
    with pytest.raises(ValueError) as found:
        check_inputs(cache, inputs.slots, inputs.record_rows, config, parents=given)
    text = str(found.value)
    for message in ("parents[0, 0]=3 is not -1", "parents[0, 2]=5 is outside [0, 2)",
                    "parents[0, 3]=-4 is outside [0, 3)", "parents[1, 3]=3 is outside [0, 3)"):
        assert message in text


@pytest.mark.parametrize("name", ["xla", "stock"])
def test_prefill_resumes_an_accepted_path(name, draw):
    """A resumed prefill (and a flush: a resumed piece of length 0) folds the accepted
    path's records in and reads its last three inputs as history, as the model does."""
    config = KdaConfig(heads=HEADS, tokens=6, trees=True)
    params = draw.params(draw.key(51), config)
    cache = draw.cache(draw.key(52), config, NUM_SLOTS, NUM_RECORDS)
    piece = draw.inputs(draw.key(54), config, jnp.asarray([1, 4], jnp.int32),
                        jnp.asarray([2, 0], jnp.int32))
    prompts = PrefillInputs(piece.x, piece.f_a, piece.beta, piece.gate,
                            jnp.asarray([6, 0], jnp.int32), piece.slots, piece.record_rows,
                            resume=jnp.asarray([True, True]))
    run = {"xla": prefill, "stock": jax.jit(stock_prefill, static_argnames="config")}[name]
    out, after = run(params, cache, prompts, config=config)
    model_out, model_cache = numpy_model.prefill(params, cache, prompts, config)
    assert out_error(out, model_out) <= TOLERANCES["out"]
    assert scaled_error(after.state, model_cache.state) <= TOLERANCES["state"]
    assert differing_bits(after.conv, model_cache.conv) == 0


def test_vmap_and_export_take_parents(draw):
    config = KdaConfig(heads=HEADS, tokens=4, trees=True)
    params = draw.params(draw.key(61), config)
    cache = draw.cache(draw.key(62), config, NUM_SLOTS, NUM_RECORDS)
    inputs = [dataclasses.replace(
        draw.inputs(draw.key(63 + i), config, jnp.asarray([1 + 2 * i, 2 + 2 * i], jnp.int32),
                    jnp.asarray([2 * i, 2 * i + 1], jnp.int32)),
        parents=tree_of("random", np.random.default_rng(i), 2, 4)) for i in range(2)]
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *inputs)
    step = functools.partial(fused_verify, config=config, backend="jax")
    out, after = jax.vmap(lambda i: step(params, cache, i), out_axes=(0, None))(stacked)
    whole = jax.tree.map(lambda *a: jnp.concatenate(a), *inputs)
    one_out, one = step(params, cache, whole)
    assert_same_bits(out.reshape(one_out.shape), one_out, "out")
    assert_same_bits(after.nodes, one.nodes, "nodes")
    exported = jax.export.export(jax.jit(step))(params, cache, inputs[0])
    back = jax.export.deserialize(exported.serialize())
    assert_same_bits(back.call(params, cache, inputs[0])[0], step(params, cache, inputs[0])[0],
                     "exported out")


ERRORS = [
    ("parents without trees", dict(trees=False), "parents",
     "parents: given, but config.trees is False"),
    ("parents of another T", dict(trees=True), "parents5",
     r"parents: expected \[B=2, T=4\] int32, got \[2, 5\] int32"),
    ("a cache without nodes", dict(trees=True), "no nodes",
     r"cache.nodes: expected an array \[R, H, RQ\] int32 with config.trees, got None"),
    ("the kernel's spilling build", dict(trees=True, tokens=13), "cutedsl",
     r"backend='cutedsl': the verify kernel takes no tree of tokens=13"),
]


@pytest.mark.parametrize("fields, case, message", [e[1:] for e in ERRORS],
                         ids=[e[0] for e in ERRORS])
def test_errors(fields, case, message, draw):
    config = KdaConfig(heads=HEADS, **{"tokens": 4, **fields})
    params = draw.params(draw.key(71), config)
    cache = init_cache(config, NUM_SLOTS, NUM_RECORDS)
    inputs = draw.inputs(draw.key(72), config, jnp.asarray([1, 2], jnp.int32),
                         jnp.asarray([0, 1], jnp.int32))
    T = 5 if case == "parents5" else config.tokens
    inputs = dataclasses.replace(inputs, parents=jnp.zeros((2, T), jnp.int32))
    backend = "jax"
    if case == "no nodes":
        cache = dataclasses.replace(cache, nodes=None)
    if case == "cutedsl":
        backend = "cutedsl"
    with pytest.raises(ValueError, match=message):
        fused_verify(params, cache, inputs, config, backend=backend)
    if case == "parents":
        with pytest.raises(ValueError, match="path: given, but config.trees is False"):
            accept(cache, inputs.record_rows, inputs.slots, config,
                   path=jnp.zeros((2, 4), jnp.int32))
