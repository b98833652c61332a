"""Parity of the three JAX verifies (stock scan, chunked, fused_verify's "jax" backend)
with each other and with the float64 NumPy model over multi-step speculative episodes:
verify, accept a random number of tokens, verify again.

Each implementation runs its own episode; after every step it is compared with the
stock episode, and with the model run from the implementation's own cache before the
step (so the model checks that step alone and FP32 differences do not accumulate).
"""
import numpy as np
import jax
import jax.numpy as jnp
import pytest

import numpy_model
from jax_kda import KdaConfig, accept
from jax_kda.testing import random_accepted
from poison import poison

# Worst error allowed per (compared with, quantity). Units: "out" is |a - e| over
# |e| + the mean |e| of its (token, head) row; "state" and "corrections" are |a - e| over
# max |e| of the buffer; "keys" (recorded keys and raw gates) in bf16 ulps of e, and
# "key_ties" the fraction of recorded values that differ at all; "window", "pending":
# number of differing elements.
TOLERANCES = {
    # one flipped bf16 rounding of o_t (or, vs the model, of a SiLU output or raw gate)
    # moves an output by a few ulps of 2^-8 relative.
    ("stock", "out"): 4 * 2**-8,
    ("model", "out"): 4 * 2**-8,
    # the chunked form reorders FP32 sums: ~1e-5 of the state's scale after 3 steps.
    ("stock", "state"): 1e-5,
    ("stock", "corrections"): 1e-5,
    # the replayed checkpoint vs float64: the same closed form, FP32 rounding only.
    ("model", "state"): 1e-5,
    # a key, v or raw gate that rounds the other way in FP32 (see "keys") moves u_t
    # by a fraction of one bf16 ulp of its scale (measured: 0.16 ulp).
    ("model", "corrections"): 2**-8,
    # shared pointwise code: the JAX paths record bit-identical keys and gates.
    ("stock", "keys"): 0,
    ("stock", "key_ties"): 0,
    # XLA's FP32 dot order and exp differ from the model's FP32 emulation, so a value
    # within an FP32 rounding of a bf16 tie may round the other way: one ulp, rarely.
    ("model", "keys"): 1,
    ("model", "key_ties"): 1e-3,
    # windows are copies of bf16 inputs; pending is only written by accept.
    ("stock", "window"): 0,
    ("model", "window"): 0,
    ("stock", "pending"): 0,
    ("model", "pending"): 0,
}

NUM_SLOTS, NUM_RECORDS, HEADS, STEPS = 8, 6, 3, 3


def batch_indices(rng):
    """A batch of five: three requests with records, a padding row (slot 0) that names
    a record row it must not touch, and a request with no records; shuffled."""
    slots = rng.permutation(np.arange(1, NUM_SLOTS))[:4]
    rows = rng.permutation(NUM_RECORDS)[:4]
    batch = [(slots[0], rows[0]), (slots[1], rows[1]), (0, rows[2]), (slots[2], -1),
             (slots[3], rows[3])]
    batch = [batch[i] for i in rng.permutation(len(batch))]
    return (jnp.asarray([s for s, _ in batch], jnp.int32),
            jnp.asarray([r for _, r in batch], jnp.int32))


def difference(actual, expected):
    """|actual - expected| as float64, 0 where both are NaN, inf where only one is."""
    a, e = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    both, either = np.isnan(a) & np.isnan(e), np.isnan(a) | np.isnan(e)
    return np.where(both, 0.0, np.where(either, np.inf, np.abs(a - e)))


def bf16_ulps(actual, expected):
    """|actual - expected| in bf16 ulps of expected (8 significant bits)."""
    e = np.nan_to_num(np.asarray(expected, np.float64))
    ulp = np.ldexp(1.0, np.floor(np.log2(np.maximum(np.abs(e), 1e-30))).astype(int) - 7)
    return difference(actual, expected) / ulp


def errors(out, cache, expected_out, expected):
    """The measured errors of one step, in the units of TOLERANCES."""
    magnitude = np.abs(np.asarray(expected_out, np.float64))
    row = np.mean(magnitude, axis=-1, keepdims=True)
    scaled = lambda a, e: float(difference(a, e).max() / np.nanmax(np.abs(np.asarray(e))))
    ulps = bf16_ulps(cache.key_gates, expected.key_gates)
    return {
        "out": float(np.max(difference(out, expected_out)
                            / np.maximum(magnitude + row, np.finfo(np.float64).tiny))),
        "state": scaled(cache.state, expected.state),
        "corrections": scaled(cache.corrections, expected.corrections),
        "keys": float(ulps.max()),
        "key_ties": float(np.mean(ulps > 0)),
        "window": int(np.sum(np.asarray(cache.conv).view(np.uint16)
                             != np.asarray(expected.conv).view(np.uint16))),
        "pending": int(np.sum(np.asarray(cache.pending) != np.asarray(expected.pending))),
    }


def episode_errors(config, seed, *, conv_bias, conv_dtype=jnp.float32,
                   norm_dtype=jnp.float32, implementations, draw):
    """Runs an episode of STEPS verifies per implementation; returns the worst error per
    (implementation, compared with, quantity)."""
    rng = np.random.default_rng(seed)
    keys = jax.random.split(jax.random.key(seed), 2 + STEPS)
    params = draw.params(keys[0], config, conv_dtype=conv_dtype, conv_bias=conv_bias,
                         norm_dtype=norm_dtype)
    first = poison(draw.cache(keys[1], config, NUM_SLOTS, NUM_RECORDS), config)
    caches = {name: first for name in implementations}
    worst = {}
    for step in range(STEPS):
        slots, record_rows = batch_indices(rng)
        inputs = draw.inputs(keys[2 + step], config, slots, record_rows)
        results = {}
        for name, verify in implementations.items():
            before = poison(caches[name], config)
            out, caches[name] = verify(params, before, inputs, config)
            results[name] = out, caches[name]
            model_out, model_cache = numpy_model.verify(params, before, inputs, config)
            for quantity, value in errors(out, caches[name], model_out, model_cache).items():
                worst[name, "model", quantity] = max(worst.get((name, "model", quantity), 0),
                                                     value)
        for name, (out, cache) in results.items():
            for quantity, value in errors(out, cache, *results["stock"]).items():
                worst[name, "stock", quantity] = max(worst.get((name, "stock", quantity), 0),
                                                     value)
        accepting = jnp.where(slots > 0, record_rows, -1)  # the runner skips padding rows
        accepted = random_accepted(rng, record_rows, config.tokens)
        caches = {name: accept(cache, accepting, accepted) for name, cache in caches.items()}
    return worst


# every T with both gate modes; conv bias on for half of them, so that every T and
# every gate mode runs with and without it (the full product doubles the compile time)
CASES = [
    pytest.param(T, gate_mode, conv_bias, id=f"T{T}-gate_mode{gate_mode}-"
                 + ("bias" if conv_bias else "nobias"))
    for T in range(2, 9) for gate_mode in (0, 1) for conv_bias in [(T + gate_mode) % 2 == 0]
]


@pytest.mark.parametrize("tokens, gate_mode, conv_bias", CASES)
def test_episode_parity(tokens, gate_mode, conv_bias, implementations, draw):
    # odd T: records longer than the step (RQ = T + 3) and bf16 conv and norm weights
    odd = tokens % 2 == 1
    config = KdaConfig(heads=HEADS, tokens=tokens, record_tokens=tokens + 3 if odd else None,
                       gate_mode=gate_mode)
    seed = 100 * tokens + 10 * gate_mode + conv_bias
    dtype = jnp.bfloat16 if odd else jnp.float32
    worst = episode_errors(config, seed, conv_bias=conv_bias, conv_dtype=dtype,
                           norm_dtype=dtype, implementations=implementations, draw=draw)
    too_big = {key: value for key, value in worst.items() if value > TOLERANCES[key[1:]]}
    assert not too_big, f"errors above TOLERANCES: {too_big}"
