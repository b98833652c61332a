"""Parity of the JAX verifies (the stock scan and fused_verify's XLA backend) with the
independent float64 NumPy model over multi-step speculative episodes: verify, accept a
random number of tokens, verify again.

Each implementation runs its own episode; after every step it is compared with the
model run from the implementation's own cache before the step (so the model checks
that step alone and FP32 differences do not accumulate), and its accept with the
model's accept. The XLA backend is also compared with the stock episode, as extra
information only (the two share every pointwise step and the cache's row handling).
"""
import dataclasses

import numpy as np
import jax
import jax.numpy as jnp
import pytest

import numpy_model
from compare import bf16_ulps, differing_bits, out_error, scaled_error
from gate_ties import tie_f_a, tie_f_b
from jax_kda import KdaConfig, accept
from poison import poison

# Worst error allowed per (compared with, quantity). Units: "out" is |a - e| over
# |e| + the mean |e| of its (token, head) row; "state" and "corrections" are |a - e| over
# max |e| of the buffer; "keys" (recorded post-SiLU keys) and "gates" (recorded raw
# gates) in bf16 ulps of e, and "key_ties" the fraction of recorded keys that differ at
# all; "window", "pending", "accept": number of differing elements (bitwise).
TOLERANCES = {
    # one flipped bf16 rounding of o_t (or, vs the model, of a SiLU output) moves an
    # output by a few ulps of 2^-8 relative.
    ("model", "out"): 4 * 2**-8,
    # the replayed checkpoint vs float64: the closed form (or the scan) in FP32, a few
    # roundings of O(1) terms per token: ~1e-7 measured, 1e-5 allowed.
    ("model", "state"): 1e-5,
    # a key or v that rounds the other way in FP32 (see "keys") moves u_t by a fraction
    # of one bf16 ulp of its scale (measured: 0.16 ulp).
    ("model", "corrections"): 2**-8,
    # XLA's FP32 exp differs from NumPy's, so a SiLU output within an FP32 rounding of a
    # bf16 tie may round the other way: one ulp, rarely.
    ("model", "keys"): 1,
    ("model", "key_ties"): 1e-3,
    # raw gates: products of bf16 values are exact in FP32 and every implementation
    # writes each chain's additions out in gate_mode's order (a dot would sum in the
    # platform's), so every raw gate is the model's. On the designed ties of
    # gate_ties.py (T = 4 and 7 below) the other gate_mode rounds apart in ~1/4 of all
    # recorded gates.
    ("model", "gates"): 0,
    ("model", "gate_ties"): 0,
    # windows are copies of bf16 inputs; pending is set by rule.
    ("model", "window"): 0,
    ("model", "pending"): 0,
    ("model", "accept"): 0,
    # extra information, xla vs stock: FP32 reordering in the chunked form (~1e-5 of
    # the state's scale after 3 steps), shared pointwise code (identical records).
    ("stock", "out"): 4 * 2**-8,
    ("stock", "state"): 1e-5,
    ("stock", "corrections"): 1e-5,
    ("stock", "keys"): 0,
    ("stock", "key_ties"): 0,
    ("stock", "gates"): 0,
    ("stock", "gate_ties"): 0,
    ("stock", "window"): 0,
    ("stock", "pending"): 0,
}

NUM_SLOTS, NUM_RECORDS, HEADS, STEPS = 8, 6, 3, 3


def pairing(rng):
    """Each slot's record row for the episode (a request keeps its slot and record row
    from step to step): five slots with distinct record rows, one with none (-1), one
    whose record row is past the buffer (it keeps none either)."""
    slots = rng.permutation(np.arange(1, NUM_SLOTS))
    rows = list(rng.permutation(NUM_RECORDS)[:NUM_SLOTS - 3]) + [-1, NUM_RECORDS + 1]
    return dict(zip(slots.tolist(), rows))


def batch_indices(rng, pairs):
    """A batch of six: three requests with records, a padding row (slot 0) that names
    a record row it must not touch, the request with no records and the one whose
    record row is past the buffer; shuffled."""
    with_records = [slot for slot, row in pairs.items() if 0 <= row < NUM_RECORDS]
    others = [slot for slot, row in pairs.items() if not 0 <= row < NUM_RECORDS]
    live = list(rng.permutation(with_records)[:3]) + others
    idle = sorted(set(range(NUM_RECORDS)) - {pairs[slot] for slot in live})
    batch = [(slot, pairs[slot]) for slot in live] + [(0, rng.choice(idle))]
    batch = [batch[i] for i in rng.permutation(len(batch))]
    return (jnp.asarray([s for s, _ in batch], jnp.int32),
            jnp.asarray([r for _, r in batch], jnp.int32))


def errors(out, cache, expected_out, expected):
    """The measured errors of one step, in the units of TOLERANCES (never NaN)."""
    key_gates = np.asarray(cache.key_gates)
    expected_key_gates = np.asarray(expected.key_gates)
    keys = bf16_ulps(key_gates[..., 0, :], expected_key_gates[..., 0, :])
    gates = bf16_ulps(key_gates[..., 1, :], expected_key_gates[..., 1, :])
    return {
        "out": out_error(out, expected_out),
        "state": scaled_error(cache.state, expected.state),
        "corrections": scaled_error(cache.corrections, expected.corrections),
        "keys": float(keys.max()),
        "key_ties": float(np.mean(keys > 0)),
        "gates": float(gates.max()),
        "gate_ties": float(np.mean(gates > 0)),
        "window": differing_bits(cache.conv, expected.conv),
        "pending": differing_bits(cache.pending, expected.pending),
    }


def first_pending(rng, config):
    """Pending counts per (record row, head) as a decode can leave them and beyond:
    different between heads, AWAITING (-1), -2 (awaiting after one kept record), 0..RQ,
    and out of range (clamped)."""
    values = rng.integers(-2, config.rq + 3, size=(NUM_RECORDS, HEADS))
    values[rng.random(values.shape) < 0.2] = -1
    return jnp.asarray(values, jnp.int32)


def episode_errors(config, seed, *, conv_bias, conv_dtype, norm_dtype, ties, implementations,
                   draw, dt_shift=0.0):
    """Runs an episode of STEPS verifies per implementation; returns the worst error per
    (implementation, compared with, quantity). dt_shift moves every dt_bias (steeper
    decays)."""
    rng = np.random.default_rng(seed)
    keys = jax.random.split(draw.key(seed), 2 + STEPS)
    params = draw.params(keys[0], config, conv_dtype=conv_dtype, conv_bias=conv_bias,
                         norm_dtype=norm_dtype)
    params = dataclasses.replace(params, dt_bias=params.dt_bias + dt_shift)
    if ties:
        params = dataclasses.replace(params, f_b=tie_f_b(rng, HEADS))
    first = draw.cache(keys[1], config, NUM_SLOTS, NUM_RECORDS)
    first = dataclasses.replace(first, pending=first_pending(rng, config))
    caches = {name: first for name in implementations}
    pairs = pairing(rng)
    worst = {}

    def note(key, value):
        worst[key] = max(worst.get(key, 0.0), value)

    for step in range(STEPS):
        slots, record_rows = batch_indices(rng, pairs)
        inputs = draw.inputs(keys[2 + step], config, slots, record_rows)
        if ties:
            inputs = dataclasses.replace(inputs, f_a=tie_f_a(rng, inputs.f_a.shape[:2]))
        accepting = jnp.where(slots > 0, record_rows, -1)  # the runner skips padding rows
        accepted = jnp.asarray(rng.integers(0, config.tokens + 1, size=slots.shape[0]),
                               jnp.int32)
        results = {}
        for name, verify in implementations.items():
            before = poison(caches[name], config, slots, record_rows)
            out, after = verify(params, before, inputs, config)
            results[name] = out, after
            model_out, model_cache = numpy_model.verify(params, before, inputs, config)
            assert np.all(np.isfinite(model_out)), "the model read a poisoned value"
            for quantity, value in errors(out, after, model_out, model_cache).items():
                note((name, "model", quantity), value)
            caches[name] = accept(after, accepting, accepted, config)
            expected = numpy_model.accept(after, accepting, accepted, config)
            note((name, "model", "accept"), differing_bits(caches[name].pending,
                                                           expected.pending))
        for name, (out, cache) in results.items():
            if name != "stock":
                for quantity, value in errors(out, cache, *results["stock"]).items():
                    note((name, "stock", quantity), value)
    return worst


# every T with both gate modes; conv bias on for half of them, so that every T and
# every gate mode runs with and without it (the full product doubles the compile
# time); raw gates on designed gate_mode ties (gate_ties.py) for T = 4 and 7, where a
# verify that ignores gate_mode records different gates than the model
CASES = [
    pytest.param(T, gate_mode, conv_bias, T in (4, 7), id=f"T{T}-gate_mode{gate_mode}-"
                 + ("bias" if conv_bias else "nobias") + ("-ties" if T in (4, 7) else ""))
    for T in range(2, 9) for gate_mode in (0, 1) for conv_bias in [(T + gate_mode) % 2 == 0]
]


@pytest.mark.parametrize("tokens, gate_mode, conv_bias, ties", CASES)
def test_episode_parity(tokens, gate_mode, conv_bias, ties, implementations, draw):
    # odd T: records longer than the step (RQ = T + 3) and bf16 conv and norm weights
    odd = tokens % 2 == 1
    config = KdaConfig(heads=HEADS, tokens=tokens, record_tokens=tokens + 3 if odd else None,
                       gate_mode=gate_mode)
    seed = 100 * tokens + 10 * gate_mode + conv_bias
    dtype = jnp.bfloat16 if odd else jnp.float32
    worst = episode_errors(config, seed, conv_bias=conv_bias, conv_dtype=dtype,
                           norm_dtype=dtype, ties=ties, implementations=implementations,
                           draw=draw)
    assert set(worst) == {(name, "model", quantity) for name in implementations
                          for quantity in ("out", "state", "corrections", "keys", "key_ties",
                                           "gates", "gate_ties", "window", "pending",
                                           "accept")} | {
        (name, "stock", quantity) for name in implementations if name != "stock"
        for quantity in ("out", "state", "corrections", "keys", "key_ties", "gates",
                         "gate_ties", "window", "pending")}
    too_big = {key: value for key, value in worst.items()
               if not value <= TOLERANCES[key[1:]]}
    assert not too_big, f"errors above TOLERANCES: {too_big}"


@pytest.mark.parametrize("tokens, dt_shift", [(3, 0.0), (8, 40.0)],
                         ids=["T3-softplus-gate", "T8-softplus-gate-steep"])
def test_episode_parity_softplus_gate(tokens, dt_shift, implementations, draw):
    """The softplus gate (lower_bound None, Kimi-Linear's), replays and verifies against
    the model; shifted by dt_shift 40 its decays lie below e^-40, most under FP32's
    smallest (about e^-103): the products along the step and the replay underflow to 0
    where the float64 model's are tiny, never inf * 0."""
    config = KdaConfig(heads=HEADS, tokens=tokens, lower_bound=None)
    worst = episode_errors(config, 900 + tokens, conv_bias=True, conv_dtype=jnp.float32,
                           norm_dtype=jnp.float32, ties=False, implementations=implementations,
                           draw=draw, dt_shift=dt_shift)
    too_big = {key: value for key, value in worst.items()
               if not value <= TOLERANCES[key[1:]]}
    assert not too_big, f"errors above TOLERANCES: {too_big}"
