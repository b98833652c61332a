"""Parity of `jax_kda.prefill` (chunks of the WY form) and of `ref.stock_prefill` (the
per-token scan) with the float64 NumPy model's prefill, and of a decode that starts
from a prefill with the model's prefill over the whole sequence token by token."""
import dataclasses
import functools

import numpy as np
import jax
import jax.numpy as jnp
import pytest

import numpy_model
from compare import assert_out_close, assert_same_bits, assert_scaled_close
from jax_kda import KdaConfig, PrefillInputs, accept, flush, fused_verify, prefill
from jax_kda.prompt_chunks import scan_chunks
from jax_kda.triangular import unit_lower_inverse
from jax_kda.ref import stock_prefill
from prompts import random_prompts

# Worst error allowed against the float64 model (units of compare.py: outputs relative
# to |e| + their row's mean |e|, states relative to the buffer's max |e|).
TOLERANCES = {
    # an o_t (or SiLU output) whose bf16 rounding flips moves an output by a few ulps
    # of 2^-8 of its row's scale.
    "out": 4 * 2**-8,
    # FP32 state over <= 47 tokens of O(1) terms, in chunked or per-token order.
    "state": 1e-5,
}

NUM_SLOTS, NUM_RECORDS, HEADS = 10, 8, 2
LENGTHS = (1, 2, 3, 17, 40, 0)  # the 0 is a live request with an empty prompt
IMPLEMENTATIONS = {"xla": prefill, "stock": jax.jit(stock_prefill, static_argnames="config")}
verify = functools.partial(fused_verify, backend="jax")


def f32(a):
    return np.asarray(a, np.float32)


def assert_close(name, actual, expected):
    if name == "out":
        assert_out_close(actual, expected, TOLERANCES["out"])
    else:
        assert_scaled_close(actual, expected, TOLERANCES[name], name)


def poisoned(cache):
    """NaN in every state and in the window's first three positions (a prefill starts
    from a zero state and zero history, it reads no slot)."""
    return dataclasses.replace(cache, state=jnp.full_like(cache.state, jnp.nan),
                               conv=cache.conv.at[..., :3].set(jnp.nan))


@pytest.mark.parametrize("name", list(IMPLEMENTATIONS))
@pytest.mark.parametrize("gate_mode,conv_dtype,conv_bias,lower_bound,dt_shift", [
    (0, jnp.float32, True, -5.0, 0.0), (1, jnp.bfloat16, False, -5.0, 0.0),
    (0, jnp.float32, True, None, 0.0), (1, jnp.float32, False, None, 40.0)],
    ids=["mode0-f32", "mode1-bf16-nobias", "softplus-gate", "softplus-gate-steep"])
def test_prefill_matches_model(gate_mode, conv_dtype, conv_bias, lower_bound, dt_shift, name,
                               draw):
    """Lengths 0..40 in one batch (P = 41, not a multiple of the chunk) with a padding
    row; outputs, checkpoint, window, pending against the model; nothing else moves.
    The softplus gate (lower_bound None) has no bound: shifted by dt_shift 40 its
    decays lie below e^-40, most under FP32's smallest (about e^-103)."""
    config = KdaConfig(heads=HEADS, tokens=4, gate_mode=gate_mode, lower_bound=lower_bound)
    params = draw.params(draw.key(11 + gate_mode), config, conv_dtype=conv_dtype,
                         conv_bias=conv_bias)
    params = dataclasses.replace(params, dt_bias=params.dt_bias + dt_shift)
    cache = poisoned(draw.cache(draw.key(21 + gate_mode), config, NUM_SLOTS, NUM_RECORDS))
    rng = np.random.default_rng(gate_mode)
    slots = rng.permutation(np.arange(1, NUM_SLOTS))[:len(LENGTHS) + 1]
    slots[-1] = 0  # a padding row
    rows = rng.permutation(NUM_RECORDS)[:len(LENGTHS) + 1]
    rows[2] = -1  # a request with no record row
    lengths = LENGTHS + (5,)
    inputs = random_prompts(rng, config, lengths, slots, rows, max(LENGTHS) + 1)

    out, new = IMPLEMENTATIONS[name](params, cache, inputs, config)
    expected_out, expected = numpy_model.prefill(params, cache, inputs, config)

    valid = (np.arange(inputs.x.shape[1])[None] < np.asarray(lengths)[:, None])
    valid[-1] = False
    assert_same_bits(f32(out)[~valid], np.zeros_like(f32(out)[~valid]),
                     "outputs past a prompt or of a padding row")
    assert np.all(np.isfinite(expected_out))
    assert_close("out", f32(out)[valid], expected_out[valid])
    live = slots[slots > 0]
    assert_close("state", new.state[live], expected.state[live])
    assert np.all(f32(new.state)[slots[:-1][np.asarray(LENGTHS) == 0]] == 0)
    for field in ("conv", "pending", "corrections", "key_gates"):
        assert_same_bits(getattr(new, field), getattr(expected, field), field)
    x = np.nan_to_num(f32(inputs.x))
    for b, (slot, n) in enumerate(zip(slots[:-1], lengths[:-1])):
        window = np.concatenate([np.zeros((3,) + x.shape[2:]), x[b, :n]])[-3:]
        np.testing.assert_array_equal(f32(new.conv[slot, ..., :3]),
                                      np.moveaxis(window, 0, -1), err_msg=f"window {b}")
    reset = rows[(rows >= 0) & (slots > 0)]
    assert np.all(f32(new.pending)[reset] == 0)
    untouched = np.setdiff1d(np.arange(NUM_SLOTS), live)
    assert_same_bits(f32(new.state)[untouched], f32(cache.state)[untouched], "state")
    assert_same_bits(f32(new.conv)[untouched], f32(cache.conv)[untouched], "conv")
    assert_same_bits(f32(new.conv)[..., 3:], f32(cache.conv)[..., 3:], "conv past 3")
    keep = np.setdiff1d(np.arange(NUM_RECORDS), reset)
    assert_same_bits(np.asarray(new.pending)[keep], np.asarray(cache.pending)[keep], "pending")
    assert_same_bits(new.corrections, cache.corrections, "corrections")
    assert_same_bits(new.key_gates, cache.key_gates, "key_gates")


def concatenate(parts, lengths, width):
    """Per request b, parts[0][b, :lengths[0][b]] + parts[1][b, :lengths[1][b]] + ... as
    one PrefillInputs field [B, width, ...] (NaN past the end)."""
    parts = [np.asarray(p, np.float32) for p in parts]
    out = np.full((parts[0].shape[0], width) + parts[0].shape[2:], np.nan, np.float32)
    for b in range(out.shape[0]):
        row = np.concatenate([p[b, :n[b]] for p, n in zip(parts, lengths)])
        out[b, :len(row)] = row
    return jnp.asarray(out, jnp.bfloat16)


def test_decode_after_prefill_matches_model_sequence(draw):
    """prefill, verify, accept, verify, accept, flush: every output and the final
    checkpoint equal the model's prefill over prompt + accepted tokens, from zero."""
    config = KdaConfig(heads=HEADS, tokens=4)
    T = config.tokens
    keys = [draw.key(5 + i) for i in range(4)]
    params = draw.params(keys[0], config)
    cache = poisoned(draw.cache(keys[1], config, NUM_SLOTS, NUM_RECORDS))
    slots, rows = np.array([3, 0, 6, 1]), np.array([4, 2, 0, 5])
    prompt_lengths = np.array([1, 7, 3, 18])
    rng = np.random.default_rng(5)
    prompts = random_prompts(rng, config, prompt_lengths, slots, rows, 18)
    width = 18 + 2 * T  # the whole sequence fits

    _, cache = prefill(params, cache, prompts, config)
    fields = ("x", "f_a", "beta", "gate")
    sequence = [getattr(prompts, f) for f in fields]
    kept = prompt_lengths
    for key in keys[2:]:
        inputs = draw.inputs(key, config, jnp.asarray(slots, jnp.int32),
                             jnp.asarray(rows, jnp.int32))
        out, cache = verify(params, cache, inputs, config)
        accepted = jnp.asarray(rng.integers(1, T + 1, size=len(rows)), jnp.int32)
        cache = accept(cache, inputs.record_rows, accepted, config)
        full = [concatenate([s, getattr(inputs, f)], [kept, np.full(4, T)], width)
                for s, f in zip(sequence, fields)]
        expected_out, expected = numpy_model.prefill(
            params, cache, PrefillInputs(*full, jnp.asarray(kept + T, jnp.int32),
                                         prompts.slots, prompts.record_rows), config)
        out = f32(out)
        for b in np.flatnonzero(slots > 0):
            assert_close("out", out[b], expected_out[b, kept[b]:kept[b] + T])
        sequence = [concatenate([s, getattr(inputs, f)], [kept, np.asarray(accepted)], width)
                    for s, f in zip(sequence, fields)]
        kept = kept + np.asarray(accepted)

    cache = flush(params, cache, prompts.slots, prompts.record_rows, config)
    _, expected = numpy_model.prefill(
        params, cache, PrefillInputs(*sequence, jnp.asarray(kept, jnp.int32), prompts.slots,
                                     prompts.record_rows), config)
    live = slots[slots > 0]
    assert_close("state", cache.state[live], expected.state[live])
    assert_same_bits(cache.conv[live, ..., :3], expected.conv[live, ..., :3], "window")
    assert_same_bits(np.asarray(cache.pending)[rows[slots > 0]],
                     np.zeros((len(live), HEADS), np.int32), "pending after flush")


def test_lengths_are_clamped(draw):
    # a negative length is an empty prompt, one past P the whole prompt (NaN past P:
    # none exists, random_prompts pads only up to the given width)
    config = KdaConfig(heads=HEADS, tokens=4)
    params = draw.params(draw.key(31), config)
    cache = poisoned(draw.cache(draw.key(32), config, NUM_SLOTS, NUM_RECORDS))
    rng = np.random.default_rng(31)
    inputs = random_prompts(rng, config, [0, 5], [2, 4], [1, 3], 5)
    out, new = prefill(params, cache, inputs, config)
    wild = dataclasses.replace(inputs, lengths=jnp.asarray([-2, 12], jnp.int32))
    out_wild, new_wild = prefill(params, cache, wild, config)
    assert_same_bits(out_wild, out, "out")
    for field in ("state", "conv", "corrections", "key_gates", "pending"):
        assert_same_bits(getattr(new_wild, field), getattr(new, field), field)
    expected_out, expected = numpy_model.prefill(params, cache, wild, config)
    assert_close("out", out_wild, expected_out)
    assert_close("state", np.asarray(new_wild.state)[[2, 4]], expected.state[[2, 4]])


@pytest.mark.parametrize("field,value,error,match", [
    ("inputs", None, TypeError, "^inputs: expected a PrefillInputs, got NoneType$"),
    ("x", jnp.zeros((2, 5, 3, HEADS, 128), jnp.float32), ValueError,
     r"^x: expected \[B, P, 3, H=2, 128\] bfloat16, got \[2, 5, 3, 2, 128\] float32$"),
    ("f_a", jnp.zeros((2, 4, 128), jnp.bfloat16), ValueError,
     r"^f_a: expected \[B=2, P=5, 128\] bfloat16, got \[2, 4, 128\] bfloat16$"),
    ("beta", jnp.zeros((2, 5, 3), jnp.bfloat16), ValueError,
     r"^beta: expected \[B=2, P=5, H=2\] bfloat16, got \[2, 5, 3\] bfloat16$"),
    ("gate", jnp.zeros((2, 5, 2, 128), jnp.float32), ValueError,
     r"^gate: expected \[B=2, P=5, H=2, 128\] bfloat16, got \[2, 5, 2, 128\] float32$"),
    ("lengths", jnp.zeros((3,), jnp.int32), ValueError,
     r"^lengths: expected \[B=2\] int32, got \[3\] int32$"),
    ("slots", jnp.zeros((2,), jnp.float32), ValueError,
     r"^slots: expected \[B=2\] int32, got \[2\] float32$"),
    ("record_rows", jnp.zeros((2, 1), jnp.int32), ValueError,
     r"^record_rows: expected \[B=2\] int32, got \[2, 1\] int32$"),
    ("resume", jnp.zeros((2,), jnp.int32), ValueError,
     r"^resume: expected \[B=2\] bool, got \[2\] int32$"),
], ids=["not-inputs", "x-dtype", "f_a-length", "beta-heads", "gate-dtype", "lengths-size",
        "slots-dtype", "record_rows-rank", "resume-dtype"])
def test_prefill_rejects_bad_arguments(field, value, error, match, draw):
    config = KdaConfig(heads=HEADS, tokens=4)
    params = draw.params(draw.key(3), config)
    cache = draw.cache(draw.key(4), config, NUM_SLOTS, NUM_RECORDS)
    inputs = random_prompts(np.random.default_rng(3), config, [5, 2], [1, 2], [0, 1], 5)
    if field == "inputs":
        inputs = value
    else:
        inputs = PrefillInputs(**{**vars(inputs), field: value})
    with pytest.raises(error, match=match):
        prefill(params, cache, inputs, config)


@pytest.mark.parametrize("size", [1, 2, 16, 32, 64])
@pytest.mark.parametrize("kind", ["random", "near-ones"])
def test_unit_lower_inverse_matches_float64(size, kind):
    """The chunks' inverse (I + N)^-1 against float64's, for random N and for N near the
    all-ones lower triangle (keys repeated with beta near 1, where powers of N grow like
    binomials while the inverse stays bidiagonal-sized): within FP32 substitution error,
    1e-5 of the inverse's largest entry."""
    rng = np.random.default_rng(size)
    scale = 0.2 * rng.standard_normal((3, size, size)) if kind == "random" else 0.97
    N = np.tril(np.ones((3, size, size)) * scale, -1)
    got = np.asarray(unit_lower_inverse(jnp.asarray(N, jnp.float32)), np.float64)
    exact = np.linalg.inv(np.eye(size) + N)
    assert np.all(np.isfinite(got))
    assert np.max(np.abs(got - exact)) <= 1e-5 * np.max(np.abs(exact))


def test_scan_skips_the_chunks_past_each_prompt():
    """`scan_chunks` with lengths: NaN in every chunk past a request's tokens (4 chunks
    of 16: 64 tokens, 17, 16 and none) reaches no state, and each request's state and
    live outputs are the scan's of its live chunks alone (within 1e-6 of the largest
    entry: a dot of another batch may sum in another order); without lengths the NaN
    reaches them."""
    rng = np.random.default_rng(3)
    B, H, N, C, K = 4, 2, 4, 16, 128
    lengths = np.array([64, 17, 16, 0])
    live = -(-lengths // C)
    normal = lambda *shape: rng.standard_normal(shape).astype(np.float32)
    operands = [normal(B, H, N, C, K) for _ in range(4)] + [
        rng.uniform(0.5, 1.0, (B, H, N, K)).astype(np.float32), normal(B, H, N, C, C)]
    for b, n in enumerate(live):
        for a in operands:
            a[b, :, n:] = np.nan
    state = normal(B, H, K, K)
    got_state, got_o = jax.jit(scan_chunks)(state, *operands, jnp.asarray(lengths))
    for b, n in enumerate(live):
        alone_state, alone_o = jax.jit(scan_chunks)(state[b:b + 1],
                                                    *[a[b:b + 1, :, :n] for a in operands])
        assert_scaled_close(got_state[b], alone_state[0], 1e-6, f"state {b}")
        assert_scaled_close(got_o[b, :, :n], alone_o[0], 1e-6, f"o {b}")
    assert np.all(np.isfinite(got_state))
    assert not np.all(np.isfinite(jax.jit(scan_chunks)(state, *operands)[0]))


@pytest.mark.parametrize("width,slots", [(0, [2, 4]), (6, [])], ids=["no-tokens", "no-rows"])
def test_empty_prompts_and_batches(width, slots, draw):
    """Prompts of no tokens (each row a new prompt of length 0: the state and window
    zeroed, pending 0) and a batch of no rows (nothing changes), as the model has them."""
    config = KdaConfig(heads=HEADS, tokens=4)
    params = draw.params(draw.key(33), config)
    cache = poisoned(draw.cache(draw.key(34), config, NUM_SLOTS, NUM_RECORDS))
    inputs = random_prompts(np.random.default_rng(33), config, [0] * len(slots), slots,
                            list(range(len(slots))), width)
    out, new = prefill(params, cache, inputs, config)
    expected_out, expected = numpy_model.prefill(params, cache, inputs, config)
    assert out.shape == (len(slots), width, HEADS, 128)
    assert_close("out", out, expected_out)
    for field in ("state", "conv", "corrections", "key_gates", "pending"):
        assert_same_bits(getattr(new, field), getattr(expected, field), field)


@pytest.mark.parametrize("backend,lower_bound,match", [
    ("xla", -5.0, r"^backend: expected one of \('auto', 'jax', 'cutedsl'\), got 'xla'$"),
    ("cutedsl", -50.0, r"chunks of 8 tokens \(lower_bound -50.0\) are not a multiple of 16"),
    ("cutedsl", -5.0, r"runs on CUDA GPUs .* lowered for \('cpu',\)"),
], ids=["unknown", "chunk-of-8", "not-cuda"])
def test_prefill_rejects_a_backend_it_cannot_run(backend, lower_bound, match, draw):
    """A backend that does not exist, the chunk kernel at chunks it does not take (steep
    decays), and the chunk kernel lowered for the CPU: each a clear ValueError."""
    config = KdaConfig(heads=HEADS, tokens=4, lower_bound=lower_bound)
    params = draw.params(draw.key(3), config)
    cache = draw.cache(draw.key(4), config, NUM_SLOTS, NUM_RECORDS)
    inputs = random_prompts(np.random.default_rng(3), config, [5, 2], [1, 2], [0, 1], 5)
    cpu = jax.devices("cpu")[0]
    with pytest.raises(ValueError, match=match), jax.default_device(cpu):
        prefill(*jax.device_put((params, cache, inputs), cpu), config, backend=backend)
