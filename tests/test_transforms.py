"""The entry points under JAX's transformations (`jax_kda.transforms`, README
"Transformations"), on the XLA backend: `jax.vmap` of fused_verify, accept, flush,
prefill and of a whole verify + accept step folds the mapped requests into one batch,
bitwise the unmapped call on the concatenated batch; a mapped cache, weights or layer
is refused naming the entry; differentiating through fused_verify, prefill or flush
raises naming what to differentiate instead, and those references differentiate."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from compare import assert_same_bits, assert_same_cache, assert_scaled_close
from jax_kda import KdaConfig, PrefillInputs, accept, flush, fused_verify, prefill
from jax_kda.ref import stock_prefill, stock_verify

CONFIG = KdaConfig(heads=2, tokens=4)
NUM_SLOTS, NUM_RECORDS, LAYERS = 6, 5, 2
V = 2  # mapped instances, of B = 2 requests each
SLOTS, ROWS = [1, 3, 2, 5], [0, 2, 1, 4]  # instance 0: slots 1, 3; instance 1: 2, 5
PROMPT = 9


def arrays(values):
    return jnp.asarray(values, jnp.int32)


def instances(tree):
    """Every leaf's [V B, ...] rows as [V, B, ...]: instance v holds rows v B .. v B + B - 1."""
    return jax.tree.map(lambda a: a.reshape((V, -1) + a.shape[1:]), tree)


def prompts(key, lengths, resume=None, width=PROMPT):
    """PrefillInputs of random tokens, [B, width, ...], for the requests at SLOTS / ROWS."""
    B, H = len(SLOTS), CONFIG.heads
    k = jax.random.split(key, 4)
    bf16 = lambda i, shape: jax.random.normal(k[i], (B, width) + shape).astype(jnp.bfloat16)
    return PrefillInputs(x=bf16(0, (3, H, 128)), f_a=bf16(1, (128,)), beta=bf16(2, (H,)),
                         gate=bf16(3, (H, 128)), lengths=arrays(lengths), slots=arrays(SLOTS),
                         record_rows=arrays(ROWS), resume=resume)


@pytest.fixture
def problem(draw):
    """(params, cache, verify inputs, prefill inputs) of the four requests."""
    params = draw.params(draw.key(41), CONFIG)
    cache = draw.cache(draw.key(42), CONFIG, NUM_SLOTS, NUM_RECORDS)
    inputs = draw.inputs(draw.key(43), CONFIG, arrays(SLOTS), arrays(ROWS))
    pieces = prompts(draw.key(44), [PROMPT, 4, 0, 7], resume=jnp.asarray([1, 0, 1, 0], bool))
    return params, cache, inputs, pieces


def assert_folds(run, args):
    """jax.vmap(run, out_axes=(0, None)) over the instances of args equals run on args
    (the concatenated batch), bitwise; run returns (out or None, cache)."""
    out_v, cache_v = jax.jit(jax.vmap(run, out_axes=(0, None)))(*instances(args))
    out, cache = jax.jit(run)(*args)
    if out is not None:
        assert out_v.shape == (V, out.shape[0] // V) + out.shape[1:]
        assert_same_bits(out_v.reshape(out.shape), out, "out")
    assert_same_cache(cache_v, cache)


def test_vmap_of_fused_verify_folds_into_the_batch(problem):
    """The inputs of two instances, two requests each, as one batch of four."""
    params, cache, inputs, _ = problem
    assert_folds(lambda i: fused_verify(params, cache, i, CONFIG, backend="jax"), (inputs,))


def test_vmap_of_prefill_folds_into_the_batch(problem):
    """New prompts and resumed pieces, of lengths 0..P, in two instances."""
    params, cache, _, pieces = problem
    assert_folds(lambda i: prefill(params, cache, i, CONFIG, backend="jax"), (pieces,))


def test_vmap_of_accept_folds_into_the_batch(problem):
    """record_rows mapped, accepted mapped or shared by the instances (in_axes None)."""
    params, cache, inputs, _ = problem
    _, awaiting = fused_verify(params, cache, inputs, CONFIG, backend="jax")
    run = lambda rows, accepted: (None, accept(awaiting, rows, accepted, CONFIG))
    assert_folds(run, (arrays(ROWS), arrays([1, 4, 0, 2])))
    mapped = jax.vmap(run, in_axes=(0, None), out_axes=(0, None))
    _, shared = jax.jit(mapped)(instances(arrays(ROWS)), arrays([3, 2]))
    assert_same_cache(shared, run(arrays(ROWS), arrays([3, 2, 3, 2]))[1])


def test_vmap_of_flush_folds_into_the_batch(problem):
    """slots and record_rows mapped: every request's kept records folded in."""
    params, cache, _, _ = problem
    assert_folds(lambda slots, rows: (None, flush(params, cache, slots, rows, CONFIG)),
                 (arrays(SLOTS), arrays(ROWS)))


def test_vmap_of_a_verify_accept_step(problem):
    """jax.vmap(step, out_axes=(0, None)) of a whole step: outputs mapped, one cache."""
    params, cache, inputs, _ = problem

    def step(inputs, accepted):
        out, awaiting = fused_verify(params, cache, inputs, CONFIG, backend="jax")
        return out, accept(awaiting, inputs.record_rows, accepted, CONFIG)

    assert_folds(step, (inputs, arrays([1, 4, 0, 2])))


def stacked(draw):
    return (draw.params(draw.key(45), CONFIG, layers=LAYERS),
            draw.cache(draw.key(46), CONFIG, NUM_SLOTS, NUM_RECORDS, layers=LAYERS))


# each entry called with the per-request arguments unmapped
CALLS = {
    "fused_verify": lambda params, cache, layer, inputs, pieces: fused_verify(
        params, cache, inputs, CONFIG, backend="jax", layer=layer),
    "prefill": lambda params, cache, layer, inputs, pieces: prefill(
        params, cache, pieces, CONFIG, backend="jax", layer=layer),
    "flush": lambda params, cache, layer, inputs, pieces: flush(
        params, cache, inputs.slots, inputs.record_rows, CONFIG),
    "accept": lambda params, cache, layer, inputs, pieces: accept(
        cache, inputs.record_rows, jnp.ones_like(inputs.record_rows), CONFIG),
}


@pytest.mark.parametrize("entry,argument", [
    ("fused_verify", "params"), ("fused_verify", "cache"), ("fused_verify", "layer"),
    ("prefill", "params"), ("prefill", "cache"), ("prefill", "layer"), ("flush", "params"),
    ("flush", "cache"), ("accept", "cache")])
def test_vmap_refuses_mapped_weights_cache_or_layer(entry, argument, problem, draw):
    """The cache, weights and layer are shared by every instance; mapping one raises a
    ValueError that names the entry and the argument."""
    params, cache, inputs, pieces = problem
    shared = dict(params=params, cache=cache, layer=None)
    if argument == "layer":
        shared = dict(zip(("params", "cache"), stacked(draw)), layer=jnp.int32(1))
        mapped = jnp.arange(V, dtype=jnp.int32)
    else:
        mapped = jax.tree.map(lambda a: jnp.stack([a] * V), shared[argument])
    run = lambda value: CALLS[entry](**dict(shared, **{argument: value}), inputs=inputs,
                                     pieces=pieces)
    with pytest.raises(ValueError, match=rf"^jax\.vmap of {entry}: {argument}: expected "
                                         r"unmapped \(in_axes None\), got mapped; the mapped "
                                         r"axis of .* folds into the batch B"):
        jax.vmap(run)(mapped)


DERIVATIVES = {
    "grad": lambda f, x: jax.grad(f)(x),
    "jvp": lambda f, x: jax.jvp(f, (x,), (jnp.ones_like(x),)),
    "vjp": lambda f, x: jax.vjp(f, x),
    "linearize": lambda f, x: jax.linearize(f, x),
}

# entry: (the new state as a function of the cache's state, what the error says)
STEPS = {
    "fused_verify": lambda p, c, i, pieces, backend: fused_verify(p, c, i, CONFIG,
                                                                  backend=backend)[1],
    "prefill": lambda p, c, i, pieces, backend: prefill(p, c, pieces, CONFIG,
                                                        backend=backend)[1],
}
REFUSED = {f"{name}-{backend}": (functools.partial(step, backend=backend),
                                 rf"differentiate jax_kda\.ref\.stock_{name.split('_')[-1]} "
                                 r"\(same signature\)")
           for name, step in STEPS.items() for backend in ("jax", "auto")}
REFUSED["flush"] = (lambda p, c, i, pieces: flush(p, c, i.slots, i.record_rows, CONFIG),
                    r"differentiate jax_kda\.ref\.stock_prefill on a resumed piece of length 0")


@pytest.mark.parametrize("derivative", list(DERIVATIVES))
@pytest.mark.parametrize("entry", list(REFUSED))
def test_differentiation_names_the_reference(entry, derivative, problem):
    """grad, jvp, vjp and linearize through the entry raise a TypeError naming it and
    the differentiable reference (any backend)."""
    params, cache, inputs, pieces = problem
    call, instead = REFUSED[entry]
    name = entry.split("-")[0]

    def new_state(state):
        return jnp.sum(call(params, dataclasses.replace(cache, state=state), inputs,
                            pieces).state)

    with pytest.raises(TypeError, match=rf"^{name} is inference-only and has no derivative; "
                                        rf"{instead}"):
        DERIVATIVES[derivative](new_state, cache.state)


def test_a_derivative_that_does_not_flow_through_is_unaffected(problem):
    """Differentiating a function that calls fused_verify on constants works."""
    params, cache, inputs, _ = problem
    out, _ = fused_verify(params, cache, inputs, CONFIG, backend="jax")
    scaled = lambda w: w * jnp.sum(
        fused_verify(params, cache, inputs, CONFIG, backend="jax")[0].astype(jnp.float32))
    assert jax.grad(scaled)(2.0) == jnp.sum(out.astype(jnp.float32))


def assert_gradients(gradients):
    """Every leaf finite and some of it nonzero."""
    for path, g in jax.tree_util.tree_flatten_with_path(gradients)[0]:
        g = np.asarray(g, np.float32)
        assert np.all(np.isfinite(g)) and np.any(g != 0), jax.tree_util.keystr(path)


def test_references_differentiate(problem):
    """jax.grad through stock_verify and stock_prefill, in inputs.x, the weights and the
    cache's state: finite and nonzero."""
    params, cache, inputs, pieces = problem

    def loss(reference, requests):
        def value(x, params, state):
            out, new = reference(params, dataclasses.replace(cache, state=state),
                                 dataclasses.replace(requests, x=x), CONFIG)
            return jnp.sum(out.astype(jnp.float32) ** 2) + jnp.sum(new.state ** 2)
        return jax.jit(jax.grad(value, argnums=(0, 1, 2)))(requests.x, params, cache.state)

    assert_gradients(loss(stock_verify, inputs))
    assert_gradients(loss(stock_prefill, pieces))


def test_stock_prefill_of_an_empty_resumed_piece_is_a_differentiable_flush(problem):
    """What flush's error offers instead: stock_prefill of length-0 resumed pieces leaves
    flush's cache (state to FP32 rounding: a per-token replay) and differentiates."""
    params, cache, inputs, _ = problem
    empty = prompts(jax.random.key(0), [0] * len(SLOTS), resume=jnp.ones(len(SLOTS), bool),
                    width=0)

    def flushed(state):
        return stock_prefill(params, dataclasses.replace(cache, state=state), empty,
                             CONFIG)[1]

    expected = flush(params, cache, arrays(SLOTS), arrays(ROWS), CONFIG)
    got = jax.jit(flushed)(cache.state)
    assert_scaled_close(got.state, expected.state, 1e-5, "state")
    assert_same_cache(got, expected, fields=("conv", "corrections", "key_gates", "pending"))
    assert_gradients(jax.grad(lambda s: jnp.sum(flushed(s).state ** 2))(cache.state))
