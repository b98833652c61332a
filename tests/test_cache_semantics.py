"""What a verify, accept and flush may and may not touch in the cache: padding rows,
requests and records outside the batch, out-of-range indices, pending clamping, and
flush's equivalence with the deferred replay."""
import numpy as np
import jax
import jax.numpy as jnp
import pytest

import numpy_model
from jax_kda import KdaCache, KdaConfig, accept, flush
from jax_kda.pytrees import VerifyInputs

# flush replays with the chunked closed form, a verify with its own recurrence: the
# results differ by FP32 reordering (~1e-5 of the state's scale) and, through a
# flipped o_t rounding, by a few bf16 ulps (2^-8 relative) of an output.
FLUSH_OUT_RTOL = 4 * 2**-8
FLUSH_STATE_RTOL = 1e-5
# the float64 model, for the same reasons (see test_parity.py's TOLERANCES)
MODEL_OUT_RTOL = 4 * 2**-8
MODEL_STATE_RTOL = 1e-5

CONFIG = KdaConfig(heads=2, tokens=4, record_tokens=6)  # records longer than a step
NUM_SLOTS, NUM_RECORDS = 6, 5
FIELDS = ("state", "conv", "corrections", "key_gates", "pending")


def bits(array):
    """The array's bytes, so NaNs and signed zeros compare exactly."""
    array = np.asarray(array)
    return array.view(np.dtype(f"u{array.dtype.itemsize}"))


def assert_same_bits(actual, expected, what):
    np.testing.assert_array_equal(bits(actual), bits(expected), err_msg=what)


def assert_out_close(actual, expected, rtol):
    """Elementwise within rtol of |expected| plus the mean |expected| of its row."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    row_scale = np.mean(np.abs(expected), axis=-1, keepdims=True)
    assert np.all(np.abs(actual - expected) <= rtol * (np.abs(expected) + row_scale))


def setup(draw, seed, slots, record_rows, config=CONFIG):
    """Random params, a cache with a NaN null slot (padding rows must never read it
    into an output), and inputs for the given batch indices."""
    keys = jax.random.split(jax.random.key(seed), 3)
    params = draw.params(keys[0], config)
    cache = draw.cache(keys[1], config, NUM_SLOTS, NUM_RECORDS)
    cache = KdaCache(cache.state.at[0].set(jnp.nan), cache.conv.at[0].set(jnp.nan),
                     cache.corrections, cache.key_gates, cache.pending)
    inputs = draw.inputs(keys[2], config, jnp.asarray(slots, jnp.int32),
                         jnp.asarray(record_rows, jnp.int32))
    return params, cache, inputs


def with_indices(inputs, slots=None, record_rows=None):
    return VerifyInputs(inputs.x, inputs.f_a, inputs.beta, inputs.gate,
                        inputs.slots if slots is None else jnp.asarray(slots, jnp.int32),
                        inputs.record_rows if record_rows is None
                        else jnp.asarray(record_rows, jnp.int32))


def test_padding_and_untouched_rows(implementation, draw):
    S, R = NUM_SLOTS, NUM_RECORDS
    # live (2, 1); padding: slot 0, negative slot, slot >= S, each naming a real record
    # row; live requests with a record row >= R and with none.
    slots = [2, 0, -1, S + 1, 4, 5]
    record_rows = [1, 3, 0, 4, R + 2, -1]
    params, cache, inputs = setup(draw, 1, slots, record_rows)
    out, new = implementation(params, cache, inputs, CONFIG)
    out = np.asarray(out)

    padding = [1, 2, 3]
    assert_same_bits(out[padding], np.zeros_like(out[padding]), "padding outputs")
    assert np.all(np.isfinite(out.astype(np.float32))), "a live output read the null slot"
    # only slot 2 replays (its record row has pending >= 1); slots 4, 5 replay nothing
    for slot in range(S):
        if slot != 2:
            assert_same_bits(new.state[slot], cache.state[slot], f"state[{slot}]")
        if slot not in (2, 4, 5):
            assert_same_bits(new.conv[slot], cache.conv[slot], f"conv[{slot}]")
    for row in range(R):
        if row != 1:
            assert_same_bits(new.corrections[row], cache.corrections[row], f"corrections[{row}]")
            assert_same_bits(new.key_gates[row], cache.key_gates[row], f"key_gates[{row}]")
    assert_same_bits(new.pending, cache.pending, "pending")
    assert not np.array_equal(bits(new.state[2]), bits(cache.state[2])), "slot 2 not replayed"
    assert not np.array_equal(bits(new.corrections[1]), bits(cache.corrections[1]))


def test_out_of_range_record_row_keeps_no_records(implementation, draw):
    # a record row >= R behaves exactly as -1: no replay, no records
    params, cache, inputs = setup(draw, 2, [3, 1], [NUM_RECORDS, 2])
    out, new = implementation(params, cache, inputs, CONFIG)
    out_none, new_none = implementation(params, cache, with_indices(inputs, record_rows=[-1, 2]),
                                        CONFIG)
    assert_same_bits(out, out_none, "out")
    for field in FIELDS:
        assert_same_bits(getattr(new, field), getattr(new_none, field), field)


@pytest.mark.parametrize("stored, clamped", [(-3, 0), (CONFIG.rq + 5, CONFIG.rq)],
                         ids=["negative", "above_RQ"])
def test_pending_is_clamped(implementation, draw, stored, clamped):
    params, cache, inputs = setup(draw, 3 + clamped, [4, 2], [1, 3])
    pending = lambda n: KdaCache(cache.state, cache.conv, cache.corrections,
                                 cache.key_gates, cache.pending.at[1].set(n))
    out, new = implementation(params, pending(stored), inputs, CONFIG)
    out_clamped, new_clamped = implementation(params, pending(clamped), inputs, CONFIG)
    assert_same_bits(out, out_clamped, "out")
    for field in FIELDS[:-1]:
        assert_same_bits(getattr(new, field), getattr(new_clamped, field), field)
    # and the clamp is to [0, RQ] (RQ > T replays records past T), as the model does
    model_out, model = numpy_model.verify(params, pending(stored), inputs, CONFIG)
    assert_out_close(out, model_out, MODEL_OUT_RTOL)
    np.testing.assert_allclose(new.state, model.state, rtol=0, equal_nan=True,
                               atol=MODEL_STATE_RTOL * np.nanmax(np.abs(model.state)))


def test_accept_sets_pending_of_listed_rows_only(draw):
    cache = draw.cache(jax.random.key(5), CONFIG, NUM_SLOTS, NUM_RECORDS)
    record_rows = jnp.asarray([3, -1, NUM_RECORDS, 0, NUM_RECORDS + 7], jnp.int32)
    accepted = jnp.asarray([2, 4, 3, 1, 4], jnp.int32)
    new = accept(cache, record_rows, accepted)
    expected = np.array(cache.pending)
    expected[3], expected[0] = 2, 1
    np.testing.assert_array_equal(np.asarray(new.pending), expected)
    for field in FIELDS[:-1]:
        assert_same_bits(getattr(new, field), getattr(cache, field), field)


def test_flush_then_verify_equals_verify(implementation, draw):
    # flush, then verify, then both runs' checkpoints must agree (the flushed run's
    # verify replays nothing, the other replays the pending tokens itself)
    slots, record_rows = [5, 0, 2, 3], [4, 1, 0, -1]
    params, cache, inputs = setup(draw, 6, slots, record_rows)
    flushed = flush(params, cache, inputs.slots, inputs.record_rows, CONFIG)

    np.testing.assert_array_equal(np.asarray(flushed.pending)[[4, 0]], [0, 0])
    untouched = [1, 2, 3]  # the padding row's record row 1 and rows outside the batch
    np.testing.assert_array_equal(np.asarray(flushed.pending)[untouched],
                                  np.asarray(cache.pending)[untouched])
    for field in ("corrections", "key_gates"):
        assert_same_bits(getattr(flushed, field), getattr(cache, field), field)
    for slot in (0, 1, 3, 4):  # null, outside the batch, no records
        assert_same_bits(flushed.state[slot], cache.state[slot], f"state[{slot}]")
        assert_same_bits(flushed.conv[slot], cache.conv[slot], f"conv[{slot}]")

    out, new = implementation(params, cache, inputs, CONFIG)
    out_flushed, new_flushed = implementation(params, flushed, inputs, CONFIG)
    assert_out_close(out_flushed, out, FLUSH_OUT_RTOL)
    for field in ("state", "corrections"):
        expected = np.asarray(getattr(new, field))
        scale = np.nanmax(np.abs(expected))
        np.testing.assert_allclose(getattr(new_flushed, field), expected, rtol=0,
                                   atol=FLUSH_STATE_RTOL * scale, err_msg=field)
    for field in ("conv", "key_gates"):
        assert_same_bits(getattr(new_flushed, field), getattr(new, field), field)
