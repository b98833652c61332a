"""Prefill in pieces (`PrefillInputs.resume`): a prompt prefilled piece by piece against
the same prompt at once and against the float64 NumPy model; a piece that resumes a
request after verifies (its kept records folded in) against the model and against a
flush first; a 16k-token prompt's checkpoint against the stock per-token scan."""
import dataclasses
import functools

import numpy as np
import jax
import jax.numpy as jnp
import pytest

import numpy_model
from compare import assert_out_close, assert_same_bits, assert_scaled_close
from jax_kda import KdaConfig, PrefillInputs, flush, prefill
from jax_kda.ref import stock_prefill
from jax_kda import cutedsl_supported
from poison import poison

# Units of compare.py. OUT: a few bf16 ulps of a row's scale (an o_t or SiLU rounding
# that flips). STATE: FP32 roundings in another order (pieces chunk at other boundaries;
# the stock scan runs per token), the same pointwise operands. MODEL_STATE: against the
# float64 model, whose SiLU roundings may fall the other way: one flip moves a k or v
# entry by a bf16 ulp, 2^-8 of it, and the state by at most that of its scale.
OUT, STATE, MODEL_STATE = 4 * 2**-8, 1e-5, 2**-8
NUM_SLOTS, NUM_RECORDS, HEADS = 9, 7, 2
IMPLEMENTATIONS = {"xla": functools.partial(prefill, backend="jax"),
                   "kernel": functools.partial(prefill, backend="cutedsl"),
                   "stock": jax.jit(stock_prefill, static_argnames="config")}
# the chunk kernel's backend where it runs (a Hopper GPU), the XLA scan and the stock scan
NAMES = ["xla", pytest.param("kernel", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not cutedsl_supported(),
                                        reason="needs a CUDA GPU of compute capability >= 9.0")]),
         "stock"]
FIELDS = ("x", "f_a", "beta", "gate")


def random_prompt(rng, config, B, P):
    """Each field of B whole prompts of P tokens (bf16)."""
    H = config.heads
    shapes = {"x": (3, H, 128), "f_a": (128,), "beta": (H,), "gate": (H, 128)}
    return {f: jnp.asarray(rng.standard_normal((B, P) + shapes[f]), jnp.bfloat16)
            for f in FIELDS}


def piece(prompt, starts, lengths, width, slots, rows, resume):
    """PrefillInputs of prompt[b, starts[b] : starts[b] + lengths[b]] per request, width
    tokens wide (NaN past each length: padding that must reach nothing)."""
    fields = {}
    for f in FIELDS:
        whole = np.asarray(prompt[f], np.float32)
        out = np.full((whole.shape[0], width) + whole.shape[2:], np.nan, np.float32)
        for b, (s, n) in enumerate(zip(starts, lengths)):
            out[b, :n] = whole[b, s:s + n]
        fields[f] = jnp.asarray(out, jnp.bfloat16)
    return PrefillInputs(**fields, lengths=jnp.asarray(lengths, jnp.int32),
                         slots=jnp.asarray(slots, jnp.int32),
                         record_rows=jnp.asarray(rows, jnp.int32),
                         resume=jnp.asarray(resume, bool))


@pytest.mark.parametrize("lower_bound", [-5.0, None], ids=["sigmoid-gate", "softplus-gate"])
@pytest.mark.parametrize("name", NAMES)
def test_pieces_equal_the_whole_prompt(name, lower_bound, draw):
    """Prompts of 150, 5, 0 and 97 tokens (and a padding row) in three pieces of up to 64
    tokens, each request's pieces of its own lengths (some empty, one of fewer than the
    three window positions): outputs, checkpoint, window and pending equal the whole
    prompt's, and the model's; at both forget gates (the softplus gate's chunks of 16,
    on Hopper through the scan kernel)."""
    config = KdaConfig(heads=HEADS, tokens=4, lower_bound=lower_bound)
    params = draw.params(draw.key(41), config)
    cache = draw.cache(draw.key(42), config, NUM_SLOTS, NUM_RECORDS)
    rng = np.random.default_rng(41)
    slots, rows = np.array([3, 7, 1, 0, 5]), np.array([2, -1, 6, 1, 4])
    totals = np.array([150, 5, 0, 9, 97])
    cuts = np.array([[64, 2, 0, 9, 40], [22, 1, 0, 0, 2], [64, 2, 0, 0, 55]])
    assert np.all(cuts.sum(0) == totals)
    prompt = random_prompt(rng, config, len(slots), totals.max())
    run = IMPLEMENTATIONS[name]

    whole = piece(prompt, np.zeros(5, int), totals, totals.max(), slots, rows, [False] * 5)
    out_whole, cache_whole = run(params, cache, whole, config)
    expected_out, expected = numpy_model.prefill(params, cache, whole, config)

    pieces_cache, outs, start = cache, [], np.zeros(5, int)
    for i, lengths in enumerate(cuts):
        inputs = piece(prompt, start, lengths, 64, slots, rows, [i > 0] * 5)
        out, pieces_cache = run(params, pieces_cache, inputs, config)
        outs.append((start.copy(), lengths, np.asarray(out, np.float32)))
        start += lengths
    out_pieces = np.zeros(np.shape(out_whole), np.float32)
    for s, lengths, out in outs:
        for b, n in enumerate(lengths):
            out_pieces[b, s[b]:s[b] + n] = out[b, :n]

    live = slots > 0
    valid = (np.arange(totals.max())[None] < totals[:, None]) & live[:, None]
    assert_same_bits(out_pieces[~valid], np.zeros_like(out_pieces[~valid]), "padding outputs")
    assert_out_close(out_pieces[valid], np.asarray(out_whole, np.float32)[valid], OUT)
    assert_out_close(out_pieces[valid], expected_out[valid], OUT)
    _, stock = IMPLEMENTATIONS["stock"](params, cache, whole, config)
    for reference, tolerance in ((cache_whole.state, STATE), (stock.state, STATE),
                                 (expected.state, MODEL_STATE)):
        assert_scaled_close(pieces_cache.state[slots[live]], reference[slots[live]],
                            tolerance, "state")
    for field in ("conv", "pending", "corrections", "key_gates"):
        assert_same_bits(getattr(pieces_cache, field), getattr(expected, field), field)


@pytest.mark.parametrize("name", NAMES)
def test_resume_folds_the_kept_records(name, draw):
    """A piece resuming requests whose record rows keep 1..T accepted tokens (and one
    awaiting its accept, which keeps none): the kept records folded into the checkpoint,
    the history at window[n .. n+2], as the model does; a flush first gives the same.
    Everything a resume must not read is NaN."""
    config = KdaConfig(heads=HEADS, tokens=4)
    params = draw.params(draw.key(51), config)
    cache = draw.cache(draw.key(52), config, NUM_SLOTS, NUM_RECORDS)
    cache = dataclasses.replace(cache, pending=cache.pending.at[3].set(-1))
    slots, rows = np.array([2, 6, 4, 8]), np.array([5, 3, -1, 0])
    cache = poison(cache, config, slots, rows)
    rng = np.random.default_rng(51)
    lengths = np.array([30, 1, 7, 0])
    inputs = piece(random_prompt(rng, config, 4, 30), np.zeros(4, int), lengths, 30, slots,
                   rows, [True, True, True, True])
    run = IMPLEMENTATIONS[name]

    out, new = run(params, cache, inputs, config)
    expected_out, expected = numpy_model.prefill(params, cache, inputs, config)
    valid = np.arange(30)[None] < lengths[:, None]
    assert np.all(np.isfinite(expected_out[valid]))
    assert_out_close(np.asarray(out, np.float32)[valid], expected_out[valid], OUT)
    _, stock = IMPLEMENTATIONS["stock"](params, cache, inputs, config)
    assert_scaled_close(new.state[slots], stock.state[slots], STATE, "state")
    assert_scaled_close(new.state[slots], expected.state[slots], MODEL_STATE, "state")
    for field in ("conv", "pending"):
        assert_same_bits(getattr(new, field), getattr(expected, field), field)

    flushed = flush(params, cache, inputs.slots, inputs.record_rows, config)
    out_flushed, new_flushed = run(params, flushed, inputs, config)
    assert_out_close(np.asarray(out_flushed, np.float32)[valid],
                     np.asarray(out, np.float32)[valid], OUT)
    assert_scaled_close(new_flushed.state[slots], new.state[slots], STATE, "state")
    assert_same_bits(new_flushed.conv[slots], new.conv[slots], "conv")


@pytest.mark.parametrize("name", NAMES[:2])
def test_long_prompt_checkpoint_matches_the_stock_scan(name, draw):
    """16384 tokens at once: the chunked checkpoint within 1e-4 of the stock scan's
    (relative to its largest entry: FP32 roundings in another order over 16k tokens of
    a contracting recurrence), the outputs within the bf16 tolerance."""
    config = KdaConfig(heads=1, tokens=4)
    P = 16384
    params = draw.params(draw.key(61), config)
    cache = draw.cache(draw.key(62), config, 3, 2)
    inputs = piece(random_prompt(np.random.default_rng(61), config, 1, P), [0], [P], P,
                   [1], [0], [False])
    out, new = IMPLEMENTATIONS[name](params, cache, inputs, config)
    out_stock, stock = IMPLEMENTATIONS["stock"](params, cache, inputs, config)
    assert_scaled_close(new.state[1], stock.state[1], 1e-4, "state")
    assert_out_close(np.asarray(out, np.float32), np.asarray(out_stock, np.float32), OUT)
