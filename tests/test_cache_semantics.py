"""What a verify, accept and flush may and may not touch in the cache (docs/spec.md,
steps 0-9 and "The runner's protocol"): padding rows, requests and records outside the
batch, out-of-range indices, per-head pending and its clamping, the window's offset,
and flush's equivalence with the deferred replay; each against the NumPy model."""
import dataclasses

import numpy as np
import jax.numpy as jnp
import pytest

import numpy_model
from compare import (MODEL_STATE_TOL, assert_matches_model, assert_out_close,
                     assert_same_bits, assert_same_cache, assert_scaled_close, bits)
from jax_kda import AWAITING, KdaConfig, accept, flush
from poison import poison

# flush replays with the chunked closed form, a verify with its own recurrence: the
# results differ by FP32 reordering (~1e-5 of the state's scale) and, through a
# flipped o_t rounding, by a few bf16 ulps (2^-8 relative) of an output.
FLUSH_OUT_RTOL = 4 * 2**-8
FLUSH_STATE_TOL = 1e-5

CONFIG = KdaConfig(heads=2, tokens=4, record_tokens=6)  # records longer than a step
NUM_SLOTS, NUM_RECORDS = 6, 5
FIELDS = ("state", "conv", "corrections", "key_gates", "pending")


def setup(draw, seed, slots, record_rows, config=CONFIG, pending=None):
    """Random params, a cache poisoned where the batch must not read (the null slot,
    unread records and window positions: poison.py), and inputs for the batch.
    pending: [R, H] values to start from (random_cache's, the same in both heads, if
    None)."""
    keys = [draw.key(seed + i) for i in range(3)]
    params = draw.params(keys[0], config)
    cache = draw.cache(keys[1], config, NUM_SLOTS, NUM_RECORDS)
    if pending is not None:
        cache = dataclasses.replace(cache, pending=jnp.asarray(pending, jnp.int32))
    inputs = draw.inputs(keys[2], config, jnp.asarray(slots, jnp.int32),
                         jnp.asarray(record_rows, jnp.int32))
    return params, poison(cache, config, slots, record_rows), inputs


def with_indices(inputs, slots=None, record_rows=None):
    fields = {}
    if slots is not None:
        fields["slots"] = jnp.asarray(slots, jnp.int32)
    if record_rows is not None:
        fields["record_rows"] = jnp.asarray(record_rows, jnp.int32)
    return dataclasses.replace(inputs, **fields)


def test_padding_and_untouched_rows(implementation, draw):
    S, R = NUM_SLOTS, NUM_RECORDS
    # live (2, 1); padding: slot 0, negative slot, slot >= S, each naming a real record
    # row; live requests with a record row >= R and with none.
    slots = [2, 0, -1, S + 1, 4, 5]
    record_rows = [1, 3, 0, 4, R + 2, -1]
    params, cache, inputs = setup(draw, 1, slots, record_rows)
    out, new = implementation(params, cache, inputs, CONFIG)
    assert_matches_model(out, new, *numpy_model.verify(params, cache, inputs, CONFIG))
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
            assert_same_bits(new.pending[row], cache.pending[row], f"pending[{row}]")
    np.testing.assert_array_equal(np.asarray(new.pending[1]), [AWAITING] * CONFIG.heads)
    assert not np.array_equal(bits(new.state[2]), bits(cache.state[2])), "slot 2 not replayed"
    assert not np.array_equal(bits(new.corrections[1]), bits(cache.corrections[1]))


def test_out_of_range_record_row_keeps_no_records(implementation, draw):
    # a live request's record row >= R behaves exactly as -1: no replay, no records
    params, cache, inputs = setup(draw, 2, [3, 1], [NUM_RECORDS, 2])
    out, new = implementation(params, cache, inputs, CONFIG)
    out_none, new_none = implementation(params, cache, with_indices(inputs, record_rows=[-1, 2]),
                                        CONFIG)
    assert_same_bits(out, out_none, "out")
    assert_same_cache(new, new_none)
    assert_matches_model(out, new, *numpy_model.verify(params, cache, inputs, CONFIG))


@pytest.mark.parametrize("stored, clamped", [(-(CONFIG.rq + 5), CONFIG.rq), (-3, 2),
                                             (CONFIG.rq + 5, CONFIG.rq)],
                         ids=["awaiting_past_RQ", "awaiting", "above_RQ"])
def test_pending_is_clamped_per_head(implementation, draw, stored, clamped):
    # head 0 of record row 1 holds a count outside [0, RQ] or awaits an accept (-(m + 1):
    # m kept records), head 1 a different valid count: each head replays its own kept
    # count, clamped, and reads its window from its own offset
    pending = lambda n: [[1, 3], [n, 2], [2, 2], [4, 1], [3, 3]]
    params, cache, inputs = setup(draw, 3 + clamped, [4, 2], [1, 3], pending=pending(stored))
    _, cache_clamped, _ = setup(draw, 3 + clamped, [4, 2], [1, 3], pending=pending(clamped))
    out, new = implementation(params, cache, inputs, CONFIG)
    out_clamped, new_clamped = implementation(params, cache_clamped, inputs, CONFIG)
    assert_same_bits(out, out_clamped, "out")
    assert_same_cache(new, new_clamped)  # pending ends AWAITING in both
    # and the clamp is to [0, RQ] (RQ > T replays records past T), as the model does
    assert_matches_model(out, new, *numpy_model.verify(params, cache, inputs, CONFIG))


def test_window_holds_history_then_the_tokens(implementation, draw):
    # after a verify from offset n (here 1 in head 0, RQ = 6 in head 1), window[0..2] is
    # the history it read, window[3..T+2] the raw inputs, positions past T + 2 as before
    T = CONFIG.tokens
    pending = [[1, 1], [2, 2], [1, CONFIG.rq], [0, 0], [3, 3]]
    params, cache, inputs = setup(draw, 9, [3], [2], pending=pending)
    _, new = implementation(params, cache, inputs, CONFIG)
    window, before = np.asarray(new.conv[3]), np.asarray(cache.conv[3])  # [3, H, K, W]
    for h, n in enumerate((1, CONFIG.rq)):
        assert_same_bits(window[:, h, :, :3], before[:, h, :, n:n + 3], f"history {h}")
        assert_same_bits(window[:, h, :, 3:T + 3],
                         np.moveaxis(np.asarray(inputs.x)[0, :, :, h], 0, -1), f"tokens {h}")
        assert_same_bits(window[:, h, :, T + 3:], before[:, h, :, T + 3:], f"past T+2 {h}")
    assert np.all(np.isfinite(window[:, :, :, :T + 3].astype(np.float32)))


def test_accept_sets_awaiting_rows_of_the_batch_only(draw):
    cache = draw.cache(draw.key(5), CONFIG, NUM_SLOTS, NUM_RECORDS)
    # rows 0, 3 and 4 await an accept; row 4 is not in the batch; row 2 awaits none
    pending = np.asarray(cache.pending).copy()
    pending[[0, 3, 4]] = AWAITING
    cache = dataclasses.replace(cache, pending=jnp.asarray(pending))
    record_rows = jnp.asarray([3, -1, NUM_RECORDS, 0, NUM_RECORDS + 7, 2], jnp.int32)
    accepted = jnp.asarray([2, 4, 3, 1, 4, 3], jnp.int32)
    new = accept(cache, record_rows, accepted, CONFIG)
    expected = pending.copy()
    expected[3], expected[0] = 2, 1
    np.testing.assert_array_equal(np.asarray(new.pending), expected)
    model = numpy_model.accept(cache, record_rows, accepted, CONFIG)
    assert_same_bits(new.pending, model.pending, "pending vs model")
    assert_same_cache(new, cache, fields=FIELDS[:-1])


def test_flush_then_verify_equals_verify(implementation, draw):
    # flush, then verify, then both runs' checkpoints must agree (the flushed run's
    # verify replays nothing, the other replays the pending tokens itself); pending
    # differs between heads (row 4: 3 and 6 = RQ > T; row 0: 1 and 0)
    slots, record_rows = [5, 0, 2, 3], [4, 1, 0, -1]
    pending = [[1, 0], [2, 2], [3, 1], [4, 4], [3, CONFIG.rq]]
    params, cache, inputs = setup(draw, 6, slots, record_rows, pending=pending)
    flushed = flush(params, cache, inputs.slots, inputs.record_rows, CONFIG)
    model = numpy_model.flush(params, cache, inputs.slots, inputs.record_rows, CONFIG)
    assert_scaled_close(flushed.state, model.state, MODEL_STATE_TOL, "flushed state")
    for field in ("conv", "corrections", "key_gates", "pending"):
        assert_same_bits(getattr(flushed, field), getattr(model, field), f"flushed {field}")

    np.testing.assert_array_equal(np.asarray(flushed.pending)[[4, 0]], 0)
    untouched = [1, 2, 3]  # the padding row's record row 1 and rows outside the batch
    assert_same_bits(np.asarray(flushed.pending)[untouched], np.asarray(cache.pending)[untouched],
                     "pending")
    for field in ("corrections", "key_gates"):
        assert_same_bits(getattr(flushed, field), getattr(cache, field), field)
    for slot in (0, 1, 3, 4):  # null, outside the batch, no records
        assert_same_bits(flushed.state[slot], cache.state[slot], f"state[{slot}]")
        assert_same_bits(flushed.conv[slot], cache.conv[slot], f"conv[{slot}]")

    out, new = implementation(params, cache, inputs, CONFIG)
    out_flushed, new_flushed = implementation(params, flushed, inputs, CONFIG)
    assert_out_close(out_flushed, out, FLUSH_OUT_RTOL)
    for field in ("state", "corrections"):
        assert_scaled_close(getattr(new_flushed, field), getattr(new, field), FLUSH_STATE_TOL,
                            field)
    for field in ("conv", "key_gates", "pending"):
        assert_same_bits(getattr(new_flushed, field), getattr(new, field), field)
