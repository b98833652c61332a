"""Parity of `jax_kda.prefill` (chunks of the WY form) with `reference.stock_prefill`
(the per-token scan), and of a decode that starts from a prefill with the stock
recurrence run over the whole sequence token by token."""
import functools

import numpy as np
import jax
import jax.numpy as jnp
import pytest

from jax_kda import KdaCache, KdaConfig, PrefillInputs, accept, flush, fused_verify, prefill
from jax_kda.reference import stock_prefill
from jax_kda.testing import random_accepted, random_cache, random_inputs, random_params

# Worst |actual - expected| allowed, as rtol * |expected| + atol.
TOLERANCES = {
    # an o_t whose bf16 rounding flips moves by one ulp (<= 2^-7 relative) and the
    # output's own rounding may land one ulp further; near zero FP32 order shows.
    "out": dict(rtol=2**-6, atol=1e-5),
    # FP32 state: chunked vs per-token summation order over <= 47 tokens of O(1) terms.
    "state": dict(rtol=1e-5, atol=2e-5),
}

NUM_SLOTS, NUM_RECORDS, HEADS = 10, 8, 2
LENGTHS = (1, 2, 3, 17, 40, 0)  # the 0 is a live request with an empty prompt
stock = jax.jit(stock_prefill, static_argnames="config")
verify = functools.partial(fused_verify, backend="jax")


def f32(a):
    return np.asarray(a, np.float32)


def random_prompts(rng, config, lengths, slots, record_rows, width):
    """PrefillInputs of random tokens, [B, width, ...], NaN past each prompt's length
    (padding that must reach nothing)."""
    B, H = len(slots), config.heads
    lengths = np.asarray(lengths, np.int32)

    def bf16(*shape):
        past = np.arange(width)[None, :] >= lengths[:, None]
        values = rng.standard_normal((B, width) + shape)
        values[past] = np.nan
        return jnp.asarray(values, jnp.bfloat16)

    return PrefillInputs(x=bf16(3, H, 128), f_a=bf16(128), beta=bf16(H), gate=bf16(H, 128),
                         lengths=jnp.asarray(lengths), slots=jnp.asarray(slots, jnp.int32),
                         record_rows=jnp.asarray(record_rows, jnp.int32))


def poisoned(cache):
    """NaN in every state (a prefill must start from zeros, not read a slot)."""
    return KdaCache(jnp.full_like(cache.state, jnp.nan), cache.conv, cache.corrections,
                    cache.key_gates, cache.pending)


def assert_close(name, actual, expected):
    np.testing.assert_allclose(f32(actual), f32(expected), err_msg=name, **TOLERANCES[name])


@pytest.mark.parametrize("gate_mode,conv_dtype,conv_bias", [
    (0, jnp.float32, True), (1, jnp.bfloat16, False)], ids=["mode0-f32", "mode1-bf16-nobias"])
def test_prefill_matches_stock(gate_mode, conv_dtype, conv_bias):
    """Lengths 0..40 in one batch (L = 41, not a multiple of the chunk) with a padding
    row; outputs, checkpoint, window, pending against the stock scan; nothing else moves."""
    config = KdaConfig(heads=HEADS, tokens=4, gate_mode=gate_mode)
    keys = jax.random.split(jax.random.PRNGKey(11 + gate_mode), 2)
    params = random_params(keys[0], config, conv_dtype=conv_dtype, conv_bias=conv_bias)
    cache = poisoned(random_cache(keys[1], config, NUM_SLOTS, NUM_RECORDS))
    rng = np.random.default_rng(gate_mode)
    slots = rng.permutation(np.arange(1, NUM_SLOTS))[:len(LENGTHS) + 1]
    slots[-1] = 0  # a padding row
    rows = rng.permutation(NUM_RECORDS)[:len(LENGTHS) + 1]
    rows[2] = -1  # a request with no record row
    lengths = LENGTHS + (5,)
    inputs = random_prompts(rng, config, lengths, slots, rows, max(LENGTHS) + 1)

    out, new = prefill(params, cache, inputs, config)
    expected_out, expected = stock(params, cache, inputs, config)

    valid = (np.arange(inputs.x.shape[1])[None] < np.asarray(lengths)[:, None])
    valid[-1] = False
    assert np.all(f32(out)[~valid] == 0), "outputs past a prompt or of a padding row"
    assert_close("out", f32(out)[valid], f32(expected_out)[valid])
    live = slots[slots > 0]
    assert_close("state", new.state[live], expected.state[live])
    assert np.all(f32(new.state)[slots[:-1][np.asarray(LENGTHS) == 0]] == 0)
    for name in ("conv", "pending"):
        np.testing.assert_array_equal(f32(getattr(new, name)), f32(getattr(expected, name)))
    x = np.nan_to_num(f32(inputs.x))
    for b, (slot, n) in enumerate(zip(slots[:-1], lengths[:-1])):
        window = np.concatenate([np.zeros((3,) + x.shape[2:]), x[b, :n]])[-3:]
        np.testing.assert_array_equal(f32(new.conv[slot, ..., :3]),
                                      np.moveaxis(window, 0, -1), err_msg=f"window {b}")
    reset = rows[(rows >= 0) & (slots > 0)]
    assert np.all(f32(new.pending)[reset] == 0)
    untouched = np.setdiff1d(np.arange(NUM_SLOTS), live)
    np.testing.assert_array_equal(f32(new.state)[untouched], f32(cache.state)[untouched])
    np.testing.assert_array_equal(f32(new.conv)[untouched], f32(cache.conv)[untouched])
    np.testing.assert_array_equal(f32(new.conv)[..., 3:], f32(cache.conv)[..., 3:])
    keep = np.setdiff1d(np.arange(NUM_RECORDS), reset)
    np.testing.assert_array_equal(f32(new.pending)[keep], f32(cache.pending)[keep])
    np.testing.assert_array_equal(f32(new.corrections), f32(cache.corrections))
    np.testing.assert_array_equal(f32(new.key_gates), f32(cache.key_gates))


def concatenate(parts, lengths, width):
    """Per request b, parts[0][b, :lengths[0][b]] + parts[1][b, :lengths[1][b]] + ... as
    one PrefillInputs field [B, width, ...] (NaN past the end)."""
    parts = [np.asarray(p, np.float32) for p in parts]
    out = np.full((parts[0].shape[0], width) + parts[0].shape[2:], np.nan, np.float32)
    for b in range(out.shape[0]):
        row = np.concatenate([p[b, :n[b]] for p, n in zip(parts, lengths)])
        out[b, :len(row)] = row
    return jnp.asarray(out, jnp.bfloat16)


def test_decode_after_prefill_matches_stock_sequence():
    """prefill, verify, accept, verify, accept, flush: every output and the final
    checkpoint equal the stock scan over prompt + accepted tokens, from zero."""
    config = KdaConfig(heads=HEADS, tokens=4)
    T = config.tokens
    keys = jax.random.split(jax.random.PRNGKey(5), 4)
    params = random_params(keys[0], config)
    cache = poisoned(random_cache(keys[1], config, NUM_SLOTS, NUM_RECORDS))
    slots, rows = np.array([3, 0, 6, 1]), np.array([4, 2, 0, 5])
    prompt_lengths = np.array([1, 7, 3, 18])
    rng = np.random.default_rng(5)
    prompts = random_prompts(rng, config, prompt_lengths, slots, rows, 18)
    width = 18 + 2 * T  # one stock compile serves every comparison

    _, cache = prefill(params, cache, prompts, config)
    fields = ("x", "f_a", "beta", "gate")
    sequence = [getattr(prompts, f) for f in fields]
    kept = prompt_lengths
    for key in keys[2:]:
        inputs = random_inputs(key, config, slots, rows)
        out, cache = verify(params, cache, inputs, config)
        accepted = random_accepted(rng, rows, T)
        cache = accept(cache, inputs.record_rows, accepted)
        full = [concatenate([s, getattr(inputs, f)], [kept, np.full(4, T)], width)
                for s, f in zip(sequence, fields)]
        expected_out, expected = stock(
            params, cache, PrefillInputs(*full, jnp.asarray(kept + T, jnp.int32),
                                         prompts.slots, prompts.record_rows), config)
        out, expected_out = f32(out), f32(expected_out)
        for b in np.flatnonzero(slots > 0):
            assert_close("out", out[b], expected_out[b, kept[b]:kept[b] + T])
        sequence = [concatenate([s, getattr(inputs, f)], [kept, np.asarray(accepted)], width)
                    for s, f in zip(sequence, fields)]
        kept = kept + np.asarray(accepted)

    cache = flush(params, cache, prompts.slots, prompts.record_rows, config)
    _, expected = stock(params, cache, PrefillInputs(*sequence, jnp.asarray(kept, jnp.int32),
                                                     prompts.slots, prompts.record_rows),
                        config)
    live = slots[slots > 0]
    assert_close("state", cache.state[live], expected.state[live])
    np.testing.assert_array_equal(f32(cache.conv[live, ..., :3]),
                                  f32(expected.conv[live, ..., :3]))


@pytest.mark.parametrize("field,value,error,match", [
    ("inputs", None, TypeError, "inputs: expected a PrefillInputs"),
    ("x", jnp.zeros((2, 5, 3, HEADS, 128), jnp.float32), ValueError,
     r"x: expected \[B, L, 3, H=2, 128\] bfloat16, got \[2, 5, 3, 2, 128\] float32"),
    ("f_a", jnp.zeros((2, 4, 128), jnp.bfloat16), ValueError,
     r"f_a: expected \[B=2, L=5, 128\] bfloat16, got \[2, 4, 128\]"),
    ("lengths", jnp.zeros((3,), jnp.int32), ValueError,
     r"lengths: expected \[B=2\] int32, got \[3\] int32"),
    ("slots", jnp.zeros((2,), jnp.float32), ValueError,
     r"slots: expected \[B=2\] int32, got \[2\] float32"),
], ids=["not-inputs", "x-dtype", "f_a-length", "lengths-size", "slots-dtype"])
def test_prefill_rejects_bad_arguments(field, value, error, match):
    config = KdaConfig(heads=HEADS, tokens=4)
    keys = jax.random.split(jax.random.PRNGKey(3), 2)
    params = random_params(keys[0], config)
    cache = random_cache(keys[1], config, NUM_SLOTS, NUM_RECORDS)
    inputs = random_prompts(np.random.default_rng(3), config, [5, 2], [1, 2], [0, 1], 5)
    if field == "inputs":
        inputs = value
    else:
        inputs = PrefillInputs(**{**vars(inputs), field: value})
    with pytest.raises(error, match=match):
        prefill(params, cache, inputs, config)
