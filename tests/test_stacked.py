"""Stacked layers (docs/spec.md, "Data"): params and caches of L layers with a leading
[L] on every leaf. fused_verify(layer=i) and prefill(layer=i) run layer i in place,
exactly as the per-layer call on layer i's slices and touching no other layer; a
lax.scan over the layers (layer traced, the cache in the carry) is a Python loop of
per-layer calls; accept and flush take the stacked cache whole; and the scanned step
costs no more at S = 1025 slots than at S = 17 (test_donation.py's yardstick)."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import numpy_model
from compare import (assert_out_close, assert_same_bits, assert_same_cache,
                     assert_scaled_close, assert_ulps_close)
from jax_kda import AWAITING, KdaConfig, PrefillInputs, accept, flush, fused_verify, prefill
from jax_kda import init_cache
from jax_kda import cache_rows
from poison import poison
from timing import Repeated, growth, yardstick_program

CONFIG = KdaConfig(heads=2, tokens=3, record_tokens=5)
LAYERS, NUM_SLOTS, NUM_RECORDS = 3, 6, 5
SLOTS, ROWS = [4, 0, 2, 5], [3, 1, 0, -1]  # with a padding row and one without records
# against the float64 model, as in test_parity.py (a flipped bf16 rounding moves an
# output by a few ulps of 2^-8 of its row's scale; FP32 states within ~1e-5)
OUT_RTOL, STATE_TOL = 4 * 2**-8, 1e-5
verify = functools.partial(fused_verify, backend="jax")


def layer_slice(tree, i):
    return jax.tree.map(lambda a: a[i], tree)


@functools.cache
def stacked_arguments(seed):
    """Stacked params and cache (every layer different, pending differing between
    layers and heads, poisoned where no verify of the batch reads) and per-layer
    inputs [L] of VerifyInputs."""
    from conftest import DRAW as draw
    params = draw.params(draw.key(seed), CONFIG, layers=LAYERS)
    cache = draw.cache(draw.key(seed + 1), CONFIG, NUM_SLOTS, NUM_RECORDS, layers=LAYERS)
    rng = np.random.default_rng(seed)
    pending = rng.integers(-1, CONFIG.rq + 2, size=cache.pending.shape)
    cache = dataclasses.replace(cache, pending=jnp.asarray(pending, jnp.int32))
    for layer in range(LAYERS):
        cache = poison(cache, CONFIG, SLOTS, ROWS, layer=layer)
    slots, rows = jnp.asarray(SLOTS, jnp.int32), jnp.asarray(ROWS, jnp.int32)
    inputs = [draw.inputs(draw.key(seed + 2 + i), CONFIG, slots, rows) for i in range(LAYERS)]
    return params, cache, inputs


def test_layer_call_equals_the_per_layer_call():
    params, cache, inputs = stacked_arguments(1)
    traced_verify = jax.jit(lambda p, c, i, n: verify(p, c, i, CONFIG, layer=n))
    for layer in range(LAYERS):
        out, new = verify(params, cache, inputs[layer], CONFIG, layer=layer)
        one_out, one = verify(layer_slice(params, layer), layer_slice(cache, layer),
                              inputs[layer], CONFIG)
        assert_same_bits(out, one_out, f"out of layer {layer}")
        assert_same_cache(layer_slice(new, layer), one, f"layer {layer}")
        for other in set(range(LAYERS)) - {layer}:
            assert_same_cache(layer_slice(new, other), layer_slice(cache, other),
                              f"layer {other} after a verify of layer {layer}")
        # a traced layer is the Python int's
        traced_out, traced = traced_verify(params, cache, inputs[layer], jnp.int32(layer))
        assert_same_bits(traced_out, out, "traced out")
        assert_same_cache(traced, new, "traced")


@pytest.mark.parametrize("layer", [0, LAYERS - 1])
def test_layer_call_matches_the_model(implementation, layer):
    params, cache, inputs = stacked_arguments(2)
    out, new = implementation(params, cache, inputs[layer], CONFIG, layer=layer)
    model_out, model = numpy_model.verify(params, cache, inputs[layer], CONFIG, layer=layer)
    assert np.all(np.isfinite(model_out)), "the model read a poisoned value"
    assert_out_close(out, model_out, OUT_RTOL)
    assert_scaled_close(new.state, model.state, STATE_TOL, "state")
    assert_scaled_close(new.corrections, model.corrections, 2**-8, "corrections")
    assert_ulps_close(new.key_gates, model.key_gates, 1, "key_gates")
    for field in ("conv", "pending"):
        assert_same_bits(getattr(new, field), getattr(model, field), field)


def scanned_step(params, cache, inputs, accepted, config=CONFIG):
    """The runner's step over every layer: a lax.scan of verifies with the layer
    traced and the cache in the carry, then one accept of the stacked cache.
    inputs: VerifyInputs with a leading [L] (one step's inputs per layer)."""

    def body(cache, layer_inputs):
        layer, step_inputs = layer_inputs
        out, cache = verify(params, cache, step_inputs, config, layer=layer)
        return cache, out

    layers = jnp.arange(inputs.slots.shape[0], dtype=jnp.int32)
    cache, out = jax.lax.scan(body, cache, (layers, inputs))
    return out, accept(cache, inputs.record_rows[0], accepted, config)


def test_scan_over_layers_equals_a_loop():
    params, cache, inputs = stacked_arguments(3)
    accepted = jnp.asarray([2, 3, 1, 3], jnp.int32)
    stacked_inputs = jax.tree.map(lambda *a: jnp.stack(a), *inputs)
    out, new = jax.jit(scanned_step)(params, cache, stacked_inputs, accepted)
    for layer in range(LAYERS):
        one_out, one = verify(layer_slice(params, layer), layer_slice(cache, layer),
                              inputs[layer], CONFIG)
        one = accept(one, inputs[layer].record_rows, accepted, CONFIG)
        assert_same_bits(out[layer], one_out, f"out of layer {layer}")
        assert_same_cache(layer_slice(new, layer), one, f"layer {layer}")


def test_accept_takes_the_stacked_cache_whole():
    _, cache, _ = stacked_arguments(4)
    # rows 1 and 3 await in some layers and heads only: accept sets those, every layer
    pending = np.asarray(cache.pending).copy()
    pending[:, 3] = AWAITING
    pending[1, 1, 0] = AWAITING
    cache = dataclasses.replace(cache, pending=jnp.asarray(pending))
    rows = jnp.asarray([3, 1, -1, NUM_RECORDS], jnp.int32)
    accepted = jnp.asarray([9, 2, 1, 1], jnp.int32)
    new = accept(cache, rows, accepted, CONFIG)
    model = numpy_model.accept(cache, rows, accepted, CONFIG)
    assert_same_cache(new, model)
    expected = pending.copy()
    expected[:, 3] = CONFIG.tokens  # 9 clamped to T
    expected[:, 1] = np.where(pending[:, 1] == AWAITING, 2, pending[:, 1])
    assert np.sum(pending[:, 1] == AWAITING) < pending[:, 1].size  # some await none
    np.testing.assert_array_equal(np.asarray(new.pending), expected)


def test_flush_takes_the_stacked_cache_whole():
    params, cache, inputs = stacked_arguments(5)
    slots, rows = inputs[0].slots, inputs[0].record_rows
    new = flush(params, cache, slots, rows, CONFIG)
    model = numpy_model.flush(params, cache, slots, rows, CONFIG)
    assert_scaled_close(new.state, model.state, STATE_TOL, "state")
    for field in ("conv", "corrections", "key_gates", "pending"):
        assert_same_bits(getattr(new, field), getattr(model, field), field)
    for layer in range(LAYERS):
        one = flush(layer_slice(params, layer), layer_slice(cache, layer), slots, rows, CONFIG)
        assert_same_cache(layer_slice(new, layer), one, f"layer {layer}")


@pytest.mark.parametrize("resume", [False, True], ids=["new", "resumed"])
def test_prefill_of_one_layer(resume):
    """A new prompt, and a piece resuming from layer 1's checkpoint, records and window."""
    params, cache, inputs = stacked_arguments(6)
    prompts = PrefillInputs(inputs[0].x, inputs[0].f_a, inputs[0].beta, inputs[0].gate,
                            jnp.asarray([3, 2, 1, 0], jnp.int32), inputs[0].slots,
                            inputs[0].record_rows, jnp.full((4,), resume))
    layer = 1
    out, new = prefill(params, cache, prompts, CONFIG, layer=layer)
    one_out, one = prefill(layer_slice(params, layer), layer_slice(cache, layer), prompts,
                           CONFIG)
    assert_same_bits(out, one_out, "out")
    assert_same_cache(layer_slice(new, layer), one, "layer 1")
    for other in (0, 2):
        assert_same_cache(layer_slice(new, other), layer_slice(cache, other), f"layer {other}")
    model_out, model = numpy_model.prefill(params, cache, prompts, CONFIG, layer=layer)
    assert_out_close(out, model_out, OUT_RTOL)
    assert_scaled_close(new.state, model.state, STATE_TOL, "state")
    for field in ("conv", "corrections", "key_gates", "pending"):
        assert_same_bits(getattr(new, field), getattr(model, field), field)
    # a traced layer out of range: every row a padding row, nothing written
    out, new = jax.jit(lambda p, c, i, n: prefill(p, c, i, CONFIG, layer=n))(
        params, cache, prompts, jnp.int32(LAYERS))
    assert_same_bits(out, jnp.zeros_like(out), "out")
    assert_same_cache(new, cache)


# The scanned step's growth from S = 17 to 1025 slots beyond the windows' known O(S)
# round trip on XLA:CPU (test_donation.py's BF16_UPCAST, timed on its own here: one
# read and one write of the batch's window rows per layer, in a scan like the step's),
# as a fraction of one pass over one layer's larger state (see test_donation.py's
# GROWTH): 30% per layer. Whole-buffer work in the scanned verify happens once per
# layer: a copy of the carry or a pass over a layer's state costs >= ~50% each time.
# T = 2 (W = 5): the window as small beside the state as it can be (test_donation.py).
TIMED = KdaConfig(heads=2, tokens=2)
SMALL, LARGE, TIMED_LAYERS = 17, 1025, 2
GROWTH = 0.3 * TIMED_LAYERS


def timed_arguments(num_slots):
    from conftest import DRAW as draw
    params = draw.params(draw.key(7), TIMED, layers=TIMED_LAYERS)
    cache = init_cache(TIMED, num_slots, NUM_RECORDS, layers=TIMED_LAYERS)
    cache = dataclasses.replace(cache, pending=jnp.ones_like(cache.pending))
    slots, rows = jnp.asarray([3, 7], jnp.int32), jnp.asarray([1, 4], jnp.int32)
    inputs = [draw.inputs(draw.key(8 + i), TIMED, slots, rows) for i in range(TIMED_LAYERS)]
    return params, cache, jax.tree.map(lambda *a: jnp.stack(a), *inputs)


def scanned_window(conv):
    slots, width = jnp.asarray([3, 7], jnp.int32), TIMED.tokens + 3

    def body(conv, layer):
        values = cache_rows.read(conv, layer, slots)[..., ::-1][..., :width]
        return cache_rows.write(conv, layer, (slots, ..., slice(0, width)), values), None

    return jax.lax.scan(body, conv, jnp.arange(TIMED_LAYERS, dtype=jnp.int32))[0]


class Decoding:
    def __init__(self, num_slots):
        self.params, self.cache, self.inputs = timed_arguments(num_slots)
        self.accepted = jnp.ones((2,), jnp.int32)
        self.step = jax.jit(functools.partial(scanned_step, config=TIMED), donate_argnums=1)

    def __call__(self):
        _, self.cache = self.step(self.params, self.cache, self.inputs, self.accepted)
        jax.block_until_ready(self.cache)


def test_scanned_step_time_does_not_grow_with_slots():
    steps = {S: Decoding(S) for S in (SMALL, LARGE)}
    window = jax.jit(scanned_window, donate_argnums=0)
    windows = [Repeated(window, jnp.zeros_like(steps[S].cache.conv)) for S in (SMALL, LARGE)]
    one_pass = Repeated(yardstick_program(),
                        jnp.zeros((LARGE, TIMED.heads, 128, 128), jnp.float32))
    before = steps[LARGE].cache.state.unsafe_buffer_pointer()

    excess, times = growth(steps[SMALL], steps[LARGE], one_pass, windows, GROWTH)
    assert excess < GROWTH, f"the scanned step at S = {SMALL} and {LARGE}: {times} ms"
    assert steps[LARGE].cache.state.unsafe_buffer_pointer() == before, "state not in place"
