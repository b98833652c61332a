"""Every user error: a ValueError or TypeError naming the argument with the expected and
the actual value, raised before anything runs."""
import dataclasses
import re

import jax
import jax.numpy as jnp
import pytest

from jax_kda import KdaConfig, accept, check_inputs, flush, fused_verify, init_cache

CONFIG = KdaConfig(heads=2, tokens=4)
NUM_SLOTS, NUM_RECORDS = 5, 4


@pytest.fixture
def arguments(draw):
    """Valid (params, cache, inputs) for CONFIG, a batch of two."""
    keys = jax.random.split(jax.random.key(11), 3)
    return (draw.params(keys[0], CONFIG),
            draw.cache(keys[1], CONFIG, NUM_SLOTS, NUM_RECORDS),
            draw.inputs(keys[2], CONFIG, jnp.asarray([1, 3], jnp.int32),
                        jnp.asarray([0, 2], jnp.int32)))


def replaced(tree, **fields):
    return dataclasses.replace(tree, **fields)


def zeros(shape, dtype):
    return jnp.zeros(shape, dtype)


BF16, F32, F16, I32 = jnp.bfloat16, jnp.float32, jnp.float16, jnp.int32

# (which argument, field, bad value, expected message)
BAD_ARGUMENTS = [
    ("inputs", "x", zeros((2, 3, 3, 2, 128), BF16),
     "x: expected [B, T=4, 3, H=2, 128] bfloat16, got [2, 3, 3, 2, 128] bfloat16"),
    ("inputs", "x", zeros((2, 4, 3, 2, 128), F32),
     "x: expected [B, T=4, 3, H=2, 128] bfloat16, got [2, 4, 3, 2, 128] float32"),
    ("inputs", "f_a", zeros((3, 4, 128), BF16),
     "f_a: expected [B=2, T=4, 128] bfloat16, got [3, 4, 128] bfloat16"),
    ("inputs", "beta", zeros((2, 4, 3), BF16),
     "beta: expected [B=2, T=4, H=2] bfloat16, got [2, 4, 3] bfloat16"),
    ("inputs", "gate", zeros((2, 4, 2, 128), F16),
     "gate: expected [B=2, T=4, H=2, 128] bfloat16, got [2, 4, 2, 128] float16"),
    ("inputs", "slots", zeros((2,), F32), "slots: expected [B=2] int32, got [2] float32"),
    ("inputs", "record_rows", zeros((1,), I32),
     "record_rows: expected [B=2] int32, got [1] int32"),
    ("params", "conv_weight", zeros((3, 4, 2, 128), F16),
     "params.conv_weight: expected [3, 4, H=2, 128] float32 or bfloat16, "
     "got [3, 4, 2, 128] float16"),
    ("params", "conv_bias", zeros((3, 2, 128), BF16),
     "params.conv_bias: expected [3, H=2, 128] float32, got [3, 2, 128] bfloat16"),
    ("params", "a_log", zeros((3,), F32), "params.a_log: expected [H=2] float32, got [3] float32"),
    ("params", "dt_bias", zeros((2, 64), F32),
     "params.dt_bias: expected [H=2, 128] float32, got [2, 64] float32"),
    ("params", "f_b", zeros((2, 128, 128), F32),
     "params.f_b: expected [H=2, 128, 128] bfloat16, got [2, 128, 128] float32"),
    ("params", "norm_weight", zeros((2, 128), F32),
     "params.norm_weight: expected [128] float32 or bfloat16, got [2, 128] float32"),
    ("cache", "state", zeros((5, 3, 128, 128), F32),
     "cache.state: expected [S, H=2, 128, 128] float32, got [5, 3, 128, 128] float32"),
    ("cache", "conv", zeros((5, 3, 2, 128, 5), BF16),
     "cache.conv: expected [S=5, 3, H=2, 128, RQ+2=6] bfloat16, got [5, 3, 2, 128, 5] bfloat16"),
    ("cache", "corrections", zeros((4, 2, 4, 128), BF16),
     "cache.corrections: expected [R, H=2, RQ=4, 128] float32, got [4, 2, 4, 128] bfloat16"),
    ("cache", "key_gates", zeros((3, 2, 4, 2, 128), BF16),
     "cache.key_gates: expected [R=4, H=2, RQ=4, 2, 128] bfloat16, "
     "got [3, 2, 4, 2, 128] bfloat16"),
    ("cache", "pending", zeros((4,), F32), "cache.pending: expected [R=4] int32, got [4] float32"),
]


@pytest.mark.parametrize(
    "argument, field, value, message", BAD_ARGUMENTS,
    ids=[f"{a}.{f}-{m.split(', got ')[1].replace(' ', '')}" for a, f, _, m in BAD_ARGUMENTS])
def test_bad_array(implementation, arguments, argument, field, value, message):
    params, cache, inputs = arguments
    trees = {"params": params, "cache": cache, "inputs": inputs}
    trees[argument] = replaced(trees[argument], **{field: value})
    with pytest.raises(ValueError, match=f"^{re.escape(message)}"):
        implementation(trees["params"], trees["cache"], trees["inputs"], CONFIG)


def test_missing_array(implementation, arguments):
    params, cache, inputs = arguments
    with pytest.raises(TypeError, match=re.escape(
            "params.a_log: expected an array [H=2] float32, got None")):
        implementation(replaced(params, a_log=None), cache, inputs, CONFIG)


@pytest.mark.parametrize("position, name, value", [
    (0, "params", {"a_log": None}), (1, "cache", (1, 2)), (2, "inputs", None),
    (3, "config", "heads=2")], ids=["params", "cache", "inputs", "config"])
def test_wrong_pytree(implementation, arguments, position, name, value):
    args = [*arguments, CONFIG]
    args[position] = value
    with pytest.raises(TypeError, match=f"^{name}: expected a "
                                        f"(KdaParams|KdaCache|VerifyInputs|KdaConfig), got "):
        implementation(*args)


def test_unknown_backend(arguments):
    with pytest.raises(ValueError, match=re.escape(
            "backend: expected one of ('auto', 'jax', 'cutedsl'), got 'triton'")):
        fused_verify(*arguments, CONFIG, backend="triton")


@pytest.mark.parametrize("fields, error, message", [
    ({"heads": 0}, ValueError, "heads: expected an int >= 1, got 0"),
    ({"heads": 2.0}, ValueError, "heads: expected an int >= 1, got 2.0"),
    ({"tokens": 1}, ValueError, "tokens: expected an int in 2..8, got 1"),
    ({"tokens": 9}, ValueError, "tokens: expected an int in 2..8, got 9"),
    ({"tokens": 4, "record_tokens": 3}, ValueError,
     "record_tokens: expected None or an int >= tokens=4, got 3"),
    ({"gate_mode": 2}, ValueError, "gate_mode: expected 0 or 1, got 2"),
    ({"split": 3}, ValueError, "split: expected None or one of (1, 2, 4, 8), got 3"),
    ({"lower_bound": "-5"}, TypeError, "lower_bound: expected a float, got '-5'"),
    ({"scale": None, "eps": "1e-5"}, TypeError, "eps: expected a float, got '1e-5'"),
    ({"scale": "0.1"}, TypeError, "scale: expected a float, got '0.1'"),
    ({"eps": 0.0}, ValueError, "eps: expected > 0, got 0.0"),
], ids=["heads0", "heads_float", "tokens1", "tokens9", "record_tokens_below_T",
        "gate_mode2", "split3", "lower_bound_str", "eps_str", "scale_str", "eps0"])
def test_config_errors(fields, error, message):
    fields = {"heads": 2, "tokens": 4, **fields}
    with pytest.raises(error, match=f"^{re.escape(message)}$"):
        KdaConfig(**fields)


@pytest.mark.parametrize("num_slots, num_records, message", [
    (1, 2, "num_slots: expected an int >= 2 (slot 0 is null), got 1"),
    (4.0, 2, "num_slots: expected an int >= 2 (slot 0 is null), got 4.0"),
    (4, 0, "num_records: expected an int >= 1, got 0"),
], ids=["one_slot", "float_slots", "no_records"])
def test_init_cache_errors(num_slots, num_records, message):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        init_cache(CONFIG, num_slots, num_records)


def test_check_inputs_reports_every_problem():
    cache = init_cache(CONFIG, NUM_SLOTS, NUM_RECORDS)
    cache = replaced(cache, pending=jnp.asarray([9, -1, 2, 0], jnp.int32))
    slots = [1, 7, 1, 2, 3, 0, -4]
    record_rows = [0, 2, 3, 3, 1, 0, 5]
    expected = [
        "slots[1]=7 is >= num_slots=5: treated as padding",
        "slots: 1 is used by several requests [0, 2]",
        "record_rows: 3 is used by several requests [2, 3]",
        "pending[0]=9 (request 0) is outside [0, RQ=4]: clamped",
        "pending[1]=-1 (request 4) is outside [0, RQ=4]: clamped",
    ]
    with pytest.raises(ValueError, match=re.escape("check_inputs found:\n  "
                                                   + "\n  ".join(expected)) + "$"):
        check_inputs(cache, slots, record_rows, CONFIG)


def test_check_inputs_out_of_range_record_row():
    cache = init_cache(CONFIG, NUM_SLOTS, NUM_RECORDS)
    with pytest.raises(ValueError, match=re.escape(
            "check_inputs found:\n  record_rows[1]=4 is >= num_records=4: keeps no records")):
        check_inputs(cache, [1, 2, 0], [0, 4, 9], CONFIG)


def test_check_inputs_accepts_a_valid_batch():
    cache = replaced(init_cache(CONFIG, NUM_SLOTS, NUM_RECORDS),
                     pending=jnp.asarray([0, 4, 1, 3], jnp.int32))
    check_inputs(cache, [1, 4, 0, 0, -2], [3, -1, 3, 7, 0], CONFIG)


@pytest.mark.parametrize("record_rows, accepted, message", [
    (zeros((2,), F32), zeros((2,), I32), "record_rows: expected [B] int32, got [2] float32"),
    (zeros((2,), I32), zeros((3,), I32), "accepted: expected [B=2] int32, got [3] int32"),
], ids=["record_rows_float", "accepted_length"])
def test_accept_errors(record_rows, accepted, message):
    cache = init_cache(CONFIG, NUM_SLOTS, NUM_RECORDS)
    with pytest.raises(ValueError, match=f"^{re.escape(message)}"):
        accept(cache, record_rows, accepted)


def test_flush_errors(arguments):
    params, cache, _ = arguments
    with pytest.raises(ValueError, match=re.escape(
            "record_rows: expected [B=2] int32, got [3] int32")):
        flush(params, cache, zeros((2,), I32), zeros((3,), I32), CONFIG)
    with pytest.raises(ValueError, match=re.escape(
            "cache.state: expected [S, H=2, 128, 128] float32, got [5, 2, 128, 64] float32")):
        flush(params, replaced(cache, state=zeros((5, 2, 128, 64), F32)),
              zeros((2,), I32), zeros((2,), I32), CONFIG)
