"""The runner's protocol (docs/spec.md, "The runner's protocol"): every mistake in its
table, what happens, against the NumPy model; and what check_inputs reports about it.

| mistake                                   | test                                      |
| no accept after a verify                  | test_forgotten_accept_replays_nothing     |
| accepted 0 (a rejected or cancelled step) | test_accepted_zero_rejects_the_verify     |
| a > T or a < 0                            | test_accepted_is_clamped                  |
| accept twice, or without a verify         | test_accept_twice_changes_nothing,        |
|                                           | test_accept_without_a_verify_...          |
| a slot or record row used twice           | test_duplicate_slot / _record_row         |
| negative indices                          | test_negative_indices                     |
| out-of-range layer (traced)               | test_out_of_range_layer_inside_jit        |
"""
import dataclasses
import re

import numpy as np
import jax
import jax.numpy as jnp
import pytest

import numpy_model
from compare import (assert_out_close, assert_same_bits, assert_same_cache,
                     assert_scaled_close, assert_ulps_close)
from jax_kda import AWAITING, KdaConfig, PrefillInputs, accept, check_inputs, flush, prefill
from poison import poison

# against the float64 model, as in test_parity.py: a flipped bf16 rounding of o_t or of
# a SiLU output moves an output by a few ulps of 2^-8 of its row's scale; FP32 states
# and corrections within ~1e-5 of their scale; recorded keys and gates within an ulp
OUT_RTOL = 4 * 2**-8
STATE_TOL = 1e-5
CORRECTIONS_TOL = 2**-8

CONFIG = KdaConfig(heads=2, tokens=4, record_tokens=5)  # RQ > T: stale records exist
T, RQ = CONFIG.tokens, CONFIG.rq
NUM_SLOTS, NUM_RECORDS, LAYERS = 6, 5, 2
SLOTS, ROWS = [2, 4], [1, 3]


def arrays(values):
    return jnp.asarray(values, jnp.int32)


def setup(draw, seed, slots=SLOTS, rows=ROWS, stacked=False):
    layers = LAYERS if stacked else None
    params = draw.params(draw.key(seed), CONFIG, layers=layers)
    cache = draw.cache(draw.key(seed + 1), CONFIG, NUM_SLOTS, NUM_RECORDS, layers=layers)
    inputs = [draw.inputs(draw.key(seed + 2 + i), CONFIG, arrays(slots), arrays(rows))
              for i in range(2)]
    return params, cache, inputs


def stale(cache, rows):
    """NaN in record positions T..RQ-1 of `rows`: a verify wrote 0..T-1 only, so no
    accept may make a later verify read past T."""
    rows = np.asarray(rows)
    return dataclasses.replace(
        cache, corrections=cache.corrections.at[rows, :, T:].set(jnp.nan),
        key_gates=cache.key_gates.at[rows, :, T:].set(jnp.nan))


def assert_model_verify(out, new, params, before, inputs):
    """A verify from `before` against the model's verify from the same cache."""
    model_out, model = numpy_model.verify(params, before, inputs, CONFIG)
    assert np.all(np.isfinite(model_out)), "the model read a poisoned value"
    assert_out_close(out, model_out, OUT_RTOL)
    assert_scaled_close(new.state, model.state, STATE_TOL, "state")
    assert_scaled_close(new.corrections, model.corrections, CORRECTIONS_TOL, "corrections")
    assert_ulps_close(new.key_gates, model.key_gates, 1, "key_gates")
    for field in ("conv", "pending"):
        assert_same_bits(getattr(new, field), getattr(model, field), field)


def first_verify(implementation, params, cache, inputs):
    cache = poison(cache, CONFIG, inputs.slots, inputs.record_rows)
    out, after = implementation(params, cache, inputs, CONFIG)
    assert_model_verify(out, after, params, cache, inputs)
    np.testing.assert_array_equal(np.asarray(after.pending)[ROWS], AWAITING)
    return stale(after, ROWS)


def report(*lines):
    return "^" + re.escape("check_inputs found:\n  " + "\n  ".join(lines)) + "$"


def test_forgotten_accept_replays_nothing(implementation, draw):
    params, cache, (first, second) = setup(draw, 1)
    after = first_verify(implementation, params, cache, first)
    with pytest.raises(ValueError, match=report(*[
            f"pending[{row}] (request {b}) awaits the accept of its last verify: its tokens "
            "count as rejected" for b, row in enumerate(ROWS)])):
        check_inputs(after, SLOTS, ROWS, CONFIG)
    before = poison(after, CONFIG, SLOTS, ROWS)
    out, new = implementation(params, before, second, CONFIG)
    # the model's verify after an accept of 0 tokens, from the same cache
    rejected = numpy_model.accept(before, ROWS, [0, 0], CONFIG)
    np.testing.assert_array_equal(rejected.pending[ROWS], 0)
    assert_model_verify(out, new, params, rejected, second)
    # replays nothing: the checkpoints stay, the history is window[0..2]
    for slot in SLOTS:
        assert_same_bits(new.state[slot], before.state[slot], f"state[{slot}]")
        assert_same_bits(new.conv[slot, ..., :3], before.conv[slot, ..., :3], f"conv[{slot}]")
    # and exactly as an explicit accept of 0 (the same code: extra information)
    out_zero, new_zero = implementation(
        params, accept(before, arrays(ROWS), arrays([0, 0]), CONFIG), second, CONFIG)
    assert_same_bits(out, out_zero, "out")
    assert_same_cache(new, new_zero)


def test_accepted_zero_rejects_the_verify(implementation, draw):
    params, cache, (first, second) = setup(draw, 2)
    after = first_verify(implementation, params, cache, first)
    rejected = accept(after, arrays(ROWS), arrays([0, 0]), CONFIG)
    np.testing.assert_array_equal(np.asarray(rejected.pending)[ROWS], 0)
    assert_same_cache(rejected, numpy_model.accept(after, ROWS, [0, 0], CONFIG))
    assert_same_cache(rejected, after, fields=("state", "conv", "corrections", "key_gates"))
    before = poison(rejected, CONFIG, SLOTS, ROWS)
    out, new = implementation(params, before, second, CONFIG)
    assert_model_verify(out, new, params, before, second)
    for slot in SLOTS:  # the rejected tokens never reach the checkpoint
        assert_same_bits(new.state[slot], before.state[slot], f"state[{slot}]")


@pytest.mark.parametrize("accepted, pending", [
    ([T + 5, -3], [T, 0]), ([T + 1, T], [T, T]), ([-1, 1], [0, 1]),
    ([np.iinfo(np.int32).max, np.iinfo(np.int32).min], [T, 0])],
    ids=["above_T-negative", "T+1-T", "-1-1", "int32_extremes"])
def test_accepted_is_clamped(implementation, draw, accepted, pending):
    params, cache, (first, second) = setup(draw, 3)
    after = first_verify(implementation, params, cache, first)
    with pytest.raises(ValueError, match=report(*[
            f"accepted[{b}]={a} is outside [0, T={T}]: clamped"
            for b, a in enumerate(accepted) if not 0 <= a <= T])):
        check_inputs(after, SLOTS, ROWS, CONFIG, accepted=accepted)
    accepted_cache = accept(after, arrays(ROWS), arrays(accepted), CONFIG)
    np.testing.assert_array_equal(np.asarray(accepted_cache.pending)[ROWS],
                                  np.repeat(np.asarray(pending)[:, None], CONFIG.heads, 1))
    assert_same_cache(accepted_cache, numpy_model.accept(after, ROWS, accepted, CONFIG))
    # the next verify replays the clamped count: never a record past T (those are NaN)
    before = poison(accepted_cache, CONFIG, SLOTS, ROWS)
    out, new = implementation(params, before, second, CONFIG)
    assert np.all(np.isfinite(np.asarray(new.state)[SLOTS]))
    assert_model_verify(out, new, params, before, second)


def test_accept_twice_changes_nothing(implementation, draw):
    params, cache, (first, _) = setup(draw, 4)
    after = first_verify(implementation, params, cache, first)
    once = accept(after, arrays(ROWS), arrays([2, 3]), CONFIG)
    with pytest.raises(ValueError, match=report(*[
            f"record_rows[{b}]={row}: no verify awaits an accept there (the accept is "
            "ignored)" for b, row in enumerate(ROWS)])):
        check_inputs(once, SLOTS, ROWS, CONFIG, accepted=[1, 4])
    twice = accept(once, arrays(ROWS), arrays([1, 4]), CONFIG)
    assert_same_cache(twice, once)
    assert_same_cache(twice, numpy_model.accept(once, ROWS, [1, 4], CONFIG))
    np.testing.assert_array_equal(np.asarray(twice.pending)[ROWS], [[2, 2], [3, 3]])


@pytest.mark.parametrize("before", ["random", "flushed", "prefilled", "edges"])
def test_accept_without_a_verify_changes_nothing(draw, before):
    params, cache, (inputs, _) = setup(draw, 5)
    slots, rows = inputs.slots, inputs.record_rows
    if before == "flushed":
        cache = flush(params, cache, slots, rows, CONFIG)
    elif before == "prefilled":
        prompts = PrefillInputs(inputs.x, inputs.f_a, inputs.beta, inputs.gate,
                                arrays([T, 1]), slots, rows)
        _, cache = prefill(params, cache, prompts, CONFIG)
    elif before == "edges":  # counts a row may hold that awaits no accept (>= 0)
        cache = dataclasses.replace(cache, pending=arrays(
            [[0, 0], [RQ, RQ], [2, RQ + 9], [RQ + 1, 0], [3, AWAITING]]))
    # rows 0..3 await nothing (row 4, awaiting in one head in "edges", is not listed)
    rows_all = arrays([0, 1, 2, 3, -1, NUM_RECORDS])
    new = accept(cache, rows_all, arrays([1, 2, 3, 4, 2, 2]), CONFIG)
    assert_same_cache(new, cache)
    assert_same_cache(new, numpy_model.accept(cache, rows_all, [1, 2, 3, 4, 2, 2], CONFIG))


def test_flush_of_an_awaiting_row_rejects_its_verify(implementation, draw):
    # flush folds what was accepted: nothing, while the verify awaits its accept; the
    # row then awaits none, so a late accept is ignored
    params, cache, (first, second) = setup(draw, 6)
    after = first_verify(implementation, params, cache, first)
    flushed = flush(params, after, first.slots, first.record_rows, CONFIG)
    model = numpy_model.flush(params, after, SLOTS, ROWS, CONFIG)
    assert_same_cache(flushed, model, fields=("conv", "corrections", "key_gates", "pending"))
    assert_scaled_close(flushed.state, model.state, STATE_TOL, "state")
    np.testing.assert_array_equal(np.asarray(flushed.pending)[ROWS], 0)
    for slot in SLOTS:
        assert_same_bits(flushed.state[slot], after.state[slot], f"state[{slot}]")
    late = accept(flushed, arrays(ROWS), arrays([3, 3]), CONFIG)
    assert_same_cache(late, flushed)


def test_duplicate_slot(implementation, draw):
    # requests 1 and 2 share slot 3: their results are unspecified; request 0, the
    # slots and record rows outside the batch are as without them
    slots, rows = [2, 3, 3], [1, 2, 4]
    params, cache, (inputs, _) = setup(draw, 7, slots, rows)
    with pytest.raises(ValueError, match=report("slots: 3 is used by several requests [1, 2]")):
        check_inputs(cache, slots, rows, CONFIG)
    assert_others_untouched(implementation, params, cache, inputs, shared_slots=[3],
                            shared_rows=[2, 4])


def test_duplicate_record_row(implementation, draw):
    slots, rows = [2, 3, 5], [1, 4, 4]
    params, cache, (inputs, _) = setup(draw, 8, slots, rows)
    with pytest.raises(ValueError, match=report(
            "record_rows: 4 is used by several requests [1, 2]")):
        check_inputs(cache, slots, rows, CONFIG)
    assert_others_untouched(implementation, params, cache, inputs, shared_slots=[3, 5],
                            shared_rows=[4])


def assert_others_untouched(implementation, params, cache, inputs, shared_slots, shared_rows):
    """Request 0 of the batch as the model computes it alone; every slot and record
    row the sharing requests do not name is the model's too (i.e. as it was, except
    request 0's)."""
    cache = poison(cache, CONFIG)
    out, new = implementation(params, cache, inputs, CONFIG)
    alone = jax.tree.map(lambda a: a[:1], inputs)
    model_out, model = numpy_model.verify(params, cache, alone, CONFIG)
    assert_out_close(out[:1], model_out, OUT_RTOL)
    keep_slots = np.setdiff1d(np.arange(NUM_SLOTS), shared_slots)
    keep_rows = np.setdiff1d(np.arange(NUM_RECORDS), shared_rows)
    assert_scaled_close(np.asarray(new.state)[keep_slots], model.state[keep_slots], STATE_TOL,
                        "state")
    assert_same_bits(np.asarray(new.conv)[keep_slots], model.conv[keep_slots], "conv")
    assert_scaled_close(np.asarray(new.corrections)[keep_rows], model.corrections[keep_rows],
                        CORRECTIONS_TOL, "corrections")
    assert_ulps_close(np.asarray(new.key_gates)[keep_rows], model.key_gates[keep_rows], 1,
                      "key_gates")
    assert_same_bits(np.asarray(new.pending)[keep_rows], model.pending[keep_rows], "pending")


def test_negative_indices(implementation, draw):
    # a negative slot is a padding row, a record row below -1 keeps no records; both
    # reported by check_inputs (the runner means 0 / -1 or has a bug)
    slots, rows = [2, -3, 4], [-2, 1, 3]
    params, cache, (inputs, _) = setup(draw, 9, slots, rows)
    with pytest.raises(ValueError, match=report(
            "slots[1]=-3 is negative: treated as padding (use 0)",
            "record_rows[0]=-2 is below -1: keeps no records (use -1)")):
        check_inputs(cache, slots, rows, CONFIG)
    cache = poison(cache, CONFIG, slots, rows)
    out, new = implementation(params, cache, inputs, CONFIG)
    assert_model_verify(out, new, params, cache, inputs)
    assert_same_bits(out[1], jnp.zeros_like(out[1]), "padding output")
    plain = dataclasses.replace(inputs, slots=arrays([2, 0, 4]), record_rows=arrays([-1, 1, 3]))
    out_plain, new_plain = implementation(params, cache, plain, CONFIG)
    assert_same_bits(out, out_plain, "out")
    assert_same_cache(new, new_plain)


_STEPS = {}


def jitted_layer_step(implementation):
    """implementation(..., layer=layer) jitted with the layer traced, once per module."""
    if implementation not in _STEPS:
        _STEPS[implementation] = jax.jit(
            lambda p, c, i, layer: implementation(p, c, i, CONFIG, layer=layer))
    return _STEPS[implementation]


@pytest.mark.parametrize("layer", [LAYERS, -1, 1000, np.iinfo(np.int32).min],
                         ids=["L", "-1", "1000", "int32_min"])
def test_out_of_range_layer_inside_jit(implementation, draw, layer):
    # a traced layer outside [0, L) makes every row a padding row: zero outputs, every
    # layer of the cache bitwise unchanged (nothing is written to a clamped layer)
    params, cache, (inputs, _) = setup(draw, 10, stacked=True)
    step = jitted_layer_step(implementation)
    out, new = step(params, cache, inputs, jnp.int32(layer))
    assert_same_bits(out, jnp.zeros_like(out), "out")
    assert_same_cache(new, cache)
    model_out, model = numpy_model.verify(params, cache, inputs, CONFIG, layer=layer)
    assert_same_bits(out, model_out.astype(jnp.bfloat16), "model out")
    assert_same_cache(new, model)
    # and an in-range traced layer is the Python int's
    out_1, new_1 = step(params, cache, inputs, jnp.int32(1))
    out_int, new_int = implementation(params, cache, inputs, CONFIG, layer=1)
    assert_same_bits(out_1, out_int, "out")
    assert_same_cache(new_1, new_int)


def test_check_inputs_after_a_verify_and_its_accept(implementation, draw):
    params, cache, (first, _) = setup(draw, 11)
    check_inputs(cache, SLOTS, ROWS, CONFIG)  # random_cache's pending is in [1, T]
    with pytest.raises(ValueError, match=report(*[
            f"record_rows[{b}]={row}: no verify awaits an accept there (the accept is "
            "ignored)" for b, row in enumerate(ROWS)])):
        check_inputs(cache, SLOTS, ROWS, CONFIG, accepted=[1, 1])
    after = first_verify(implementation, params, cache, first)
    check_inputs(after, SLOTS, ROWS, CONFIG, accepted=[0, T])
    # a padding row is ignored, the accepted count with it; a request without records
    # awaits nothing (but its count is still checked)
    check_inputs(after, SLOTS + [0, 5], ROWS + [2, -1], CONFIG, accepted=[0, T, 9, 2])
    with pytest.raises(ValueError, match=report("accepted[3]=9 is outside [0, T=4]: clamped")):
        check_inputs(after, SLOTS + [0, 5], ROWS + [2, -1], CONFIG, accepted=[0, T, 9, 9])
    accepted = accept(after, arrays(ROWS), arrays([0, T]), CONFIG)
    check_inputs(accepted, SLOTS, ROWS, CONFIG)


def test_check_inputs_on_stacked_caches(implementation, draw):
    params, cache, (first, _) = setup(draw, 12, stacked=True)
    same = dataclasses.replace(cache, pending=jnp.broadcast_to(cache.pending[:1],
                                                               cache.pending.shape))
    check_inputs(same, SLOTS, ROWS, CONFIG)
    # layer 1's counts one more than layer 0's (random_cache keeps them equal)
    cache = dataclasses.replace(cache, pending=cache.pending.at[1].add(1))
    layers = np.asarray(cache.pending)[:, :, 0]
    differ = [b for b, row in enumerate(ROWS) if layers[0, row] != layers[1, row]]
    assert differ, "the counts should differ between layers"
    with pytest.raises(ValueError, match=report(*[
            f"pending[{ROWS[b]}] (request {b}) differs between heads or layers: "
            f"{sorted(set(layers[:, ROWS[b]].tolist()))}" for b in differ])):
        check_inputs(cache, SLOTS, ROWS, CONFIG)
    # a verify of every layer leaves each row awaiting in every layer
    for layer in range(LAYERS):
        _, same = implementation(params, same, first, CONFIG, layer=layer)
    check_inputs(same, SLOTS, ROWS, CONFIG, accepted=[2, 3])
    with pytest.raises(ValueError, match=report(*[
            f"pending[{row}] (request {b}) awaits the accept of its last verify: its tokens "
            "count as rejected" for b, row in enumerate(ROWS)])):
        check_inputs(same, SLOTS, ROWS, CONFIG)
    # one layer verified and the other not: the counts differ between layers
    _, half = implementation(params, dataclasses.replace(
        same, pending=jnp.zeros_like(same.pending)), first, CONFIG, layer=0)
    with pytest.raises(ValueError, match=report(*[
            f"pending[{row}] (request {b}) differs between heads or layers: [-1, 0]"
            for b, row in enumerate(ROWS)])):
        check_inputs(half, SLOTS, ROWS, CONFIG, accepted=[1, 1])
    accepted = accept(same, arrays(ROWS), arrays([2, 3]), CONFIG)
    np.testing.assert_array_equal(np.asarray(accepted.pending)[:, ROWS],
                                  [[[2, 2], [3, 3]]] * LAYERS)
    check_inputs(accepted, SLOTS, ROWS, CONFIG)
