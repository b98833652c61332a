"""Every user error: a ValueError or TypeError naming the argument with the expected and
the actual value, raised before anything runs."""
import dataclasses
import functools
import re

import jax.numpy as jnp
import numpy as np
import pytest

from jax_kda import (AWAITING, KdaConfig, PrefillInputs, accept, check_inputs, flush,
                     fused_verify, init_cache, prefill)
from jax_kda.ref import stock_verify

CONFIG = KdaConfig(heads=2, tokens=4)
NUM_SLOTS, NUM_RECORDS, LAYERS = 5, 4, 2


@pytest.fixture
def arguments(draw):
    """Valid (params, cache, inputs) for CONFIG, a batch of two."""
    return (draw.params(draw.key(11), CONFIG),
            draw.cache(draw.key(12), CONFIG, NUM_SLOTS, NUM_RECORDS),
            draw.inputs(draw.key(13), CONFIG, jnp.asarray([1, 3], jnp.int32),
                        jnp.asarray([0, 2], jnp.int32)))


@pytest.fixture
def stacked(draw):
    """Valid stacked (params, cache) of LAYERS layers for CONFIG."""
    return (draw.params(draw.key(14), CONFIG, layers=LAYERS),
            draw.cache(draw.key(15), CONFIG, NUM_SLOTS, NUM_RECORDS, layers=LAYERS))


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
    ("cache", "conv", zeros((5, 3, 2, 128, 6), BF16),
     "cache.conv: expected [S=5, 3, H=2, 128, W=7] bfloat16, got [5, 3, 2, 128, 6] bfloat16"),
    ("cache", "corrections", zeros((4, 2, 4, 128), BF16),
     "cache.corrections: expected [R, H=2, RQ=4, 128] float32, got [4, 2, 4, 128] bfloat16"),
    ("cache", "key_gates", zeros((3, 2, 4, 2, 128), BF16),
     "cache.key_gates: expected [R=4, H=2, RQ=4, 2, 128] bfloat16, "
     "got [3, 2, 4, 2, 128] bfloat16"),
    ("cache", "pending", zeros((4, 2), F32),
     "cache.pending: expected [R=4, H=2] int32, got [4, 2] float32"),
    ("cache", "pending", zeros((4,), I32),
     "cache.pending: expected [R=4, H=2] int32, got [4] int32"),
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


FP32 = "that stays a finite, normal FP32 number (magnitude in [1.1754944e-38, 3.4028235e+38])"
CONFIG_ERRORS = [
    ("heads0", {"heads": 0}, "heads: expected an int >= 1, got 0"),
    ("heads_float", {"heads": 2.0}, "heads: expected an int >= 1, got 2.0"),
    ("heads_bool", {"heads": True}, "heads: expected an int >= 1, got True"),
    ("tokens1", {"tokens": 1}, "tokens: expected an int in 2..16, got 1"),
    ("tokens17", {"tokens": 17}, "tokens: expected an int in 2..16, got 17"),
    ("tokens_float", {"tokens": 4.0}, "tokens: expected an int in 2..16, got 4.0"),
    ("checkpoint_every0", {"checkpoint_every": 0}, "checkpoint_every: expected an int >= 1, got 0"),
    ("checkpoint_every_float", {"checkpoint_every": 2.0},
     "checkpoint_every: expected an int >= 1, got 2.0"),
    ("checkpoint_every_bool", {"checkpoint_every": True},
     "checkpoint_every: expected an int >= 1, got True"),
    ("record_tokens_below_T", {"record_tokens": 3},
     "record_tokens: expected None or an int >= tokens=4, got 3"),
    ("record_tokens_bool", {"record_tokens": True},
     "record_tokens: expected None or an int >= tokens=4, got True"),
    ("gate_mode2", {"gate_mode": 2}, "gate_mode: expected 0 or 1, got 2"),
    ("gate_mode_float", {"gate_mode": 1.0}, "gate_mode: expected 0 or 1, got 1.0"),
    ("split3", {"split": 3}, "split: expected None or one of (1, 2, 4, 8), got 3"),
    ("split_bool", {"split": True}, "split: expected None or one of (1, 2, 4, 8), got True"),
    ("lower_bound_str", {"lower_bound": "-5"},
     f"lower_bound: expected None or a float < 0 {FP32}, got '-5'"),
    ("lower_bound5", {"lower_bound": 5.0},
     f"lower_bound: expected None or a float < 0 {FP32}, got 5.0"),
    ("lower_bound0", {"lower_bound": 0},
     f"lower_bound: expected None or a float < 0 {FP32}, got 0"),
    ("lower_bound_inf", {"lower_bound": float("inf")},
     f"lower_bound: expected None or a float < 0 {FP32}, got inf"),
    ("lower_bound_-inf", {"lower_bound": float("-inf")},
     f"lower_bound: expected None or a float < 0 {FP32}, got -inf"),
    ("scale_str", {"scale": "0.1"}, f"scale: expected None or a float > 0 {FP32}, got '0.1'"),
    ("scale0", {"scale": 0}, f"scale: expected None or a float > 0 {FP32}, got 0"),
    ("scale-1", {"scale": -1.0}, f"scale: expected None or a float > 0 {FP32}, got -1.0"),
    ("scale_inf", {"scale": float("inf")}, f"scale: expected None or a float > 0 {FP32}, got inf"),
    ("eps_str", {"scale": None, "eps": "1e-5"}, f"eps: expected a float > 0 {FP32}, got '1e-5'"),
    ("eps_nan", {"eps": float("nan")}, f"eps: expected a float > 0 {FP32}, got nan"),
    ("eps_inf", {"eps": float("inf")}, f"eps: expected a float > 0 {FP32}, got inf"),
    ("eps0", {"eps": 0.0}, f"eps: expected a float > 0 {FP32}, got 0.0"),
    ("eps-1", {"eps": -1}, f"eps: expected a float > 0 {FP32}, got -1"),
    # values that FP32, the arithmetic's precision, overflows, flushes or rounds to 0
    ("eps_subnormal", {"eps": 1e-40},
     f"eps: expected a float > 0 {FP32}, got 1e-40 (9.99994610111476e-41 in FP32: subnormal)"),
    ("scale_overflow", {"scale": 1e39},
     f"scale: expected None or a float > 0 {FP32}, got 1e+39 (inf in FP32: out of range)"),
    ("lower_bound_zero_in_fp32", {"lower_bound": -1e-50},
     f"lower_bound: expected None or a float < 0 {FP32}, got -1e-50 (-0.0 in FP32: 0)"),
    ("lower_bound_overflow", {"lower_bound": -1e39},
     f"lower_bound: expected None or a float < 0 {FP32}, got -1e+39 (-inf in FP32: out of range)"),
    ("eps_bool", {"eps": True}, f"eps: expected a float > 0 {FP32}, got True"),
    ("state_dtype_f16", {"state_dtype": jnp.float16},
     "state_dtype: expected jnp.float32 or jnp.bfloat16, got <class 'jax.numpy.float16'>"),
    ("state_dtype_f64", {"state_dtype": float},
     "state_dtype: expected jnp.float32 or jnp.bfloat16, got <class 'float'>"),
    ("state_dtype_int32", {"state_dtype": "int32"},
     "state_dtype: expected jnp.float32 or jnp.bfloat16, got 'int32'"),
    ("state_dtype_name", {"state_dtype": "bf16"},
     "state_dtype: expected jnp.float32 or jnp.bfloat16, got 'bf16'"),
    ("state_dtype_None", {"state_dtype": None},
     "state_dtype: expected jnp.float32 or jnp.bfloat16, got None"),
    ("state_dtype_number", {"state_dtype": 16},
     "state_dtype: expected jnp.float32 or jnp.bfloat16, got 16"),
]


@pytest.mark.parametrize("fields, message", [case[1:] for case in CONFIG_ERRORS],
                         ids=[case[0] for case in CONFIG_ERRORS])
def test_config_errors(fields, message):
    fields = {"heads": 2, "tokens": 4, **fields}
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        KdaConfig(**fields)


def test_state_dtype_of_the_cache_and_the_config_must_agree(arguments):
    """A cache made for one state_dtype, given with a config of the other, names the
    config's field (verify, flush, accept, check_inputs: every entry checks the cache)."""
    params, cache, inputs = arguments
    bf16 = dataclasses.replace(CONFIG, state_dtype=BF16)
    hint = "(init_cache(config, ...) makes a cache of it)"
    rows = zeros((2,), I32)
    for config, state, message in (
            (bf16, cache.state, "cache.state: expected [S, H=2, 128, 128] bfloat16, got "
             f"[5, 2, 128, 128] float32: config.state_dtype is bfloat16 {hint}"),
            (CONFIG, cache.state.astype(BF16), "cache.state: expected [S, H=2, 128, 128] "
             f"float32, got [5, 2, 128, 128] bfloat16: config.state_dtype is float32 {hint}")):
        given = replaced(cache, state=state)
        for call in (lambda: stock_verify(params, given, inputs, config),
                     lambda: flush(params, given, rows, rows, config),
                     lambda: accept(given, rows, rows, config),
                     lambda: check_inputs(given, [1, 2], [0, 1], config)):
            with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
                call()


def test_config_takes_numpy_numbers_and_stores_python_ones():
    config = KdaConfig(heads=np.int64(2), tokens=np.int32(4), checkpoint_every=np.int8(3),
                       record_tokens=np.uint8(6), lower_bound=np.int64(-5),
                       scale=np.float32(0.5), eps=np.float64(1e-5), gate_mode=np.int16(1),
                       split=np.int64(2))
    plain = KdaConfig(heads=2, tokens=4, checkpoint_every=3, record_tokens=6, lower_bound=-5.0,
                      scale=0.5, eps=1e-5, gate_mode=1, split=2)
    for field in ("heads", "tokens", "checkpoint_every", "record_tokens", "gate_mode", "split"):
        assert type(getattr(config, field)) is int, field
    for field in ("lower_bound", "scale", "eps"):
        assert type(getattr(config, field)) is float, field
    assert config == plain and hash(config) == hash(plain)  # one jit cache entry
    assert config.rq == 6 and config.window == 9


@pytest.mark.parametrize("fields, rq", [
    ({}, 4), ({"checkpoint_every": 3}, 12), ({"checkpoint_every": 3, "record_tokens": 5}, 5)],
    ids=["default", "L3", "L3-RQ5"])
def test_record_tokens_default_to_checkpoint_every_steps(fields, rq):
    config = KdaConfig(heads=2, tokens=4, **fields)
    assert config.rq == rq and config.window == rq + 3


@pytest.mark.parametrize("num_slots, num_records, layers, message", [
    (1, 2, None, "num_slots: expected an int >= 2 (slot 0 is null), got 1"),
    (4.0, 2, None, "num_slots: expected an int >= 2 (slot 0 is null), got 4.0"),
    (4, 0, None, "num_records: expected an int >= 1, got 0"),
    (4, True, None, "num_records: expected an int >= 1, got True"),
    (4, 2, 0, "layers: expected an int >= 1, got 0"),
    (4, 2, 2.0, "layers: expected an int >= 1, got 2.0"),
    (4, 2, True, "layers: expected an int >= 1, got True"),
], ids=["one_slot", "float_slots", "no_records", "bool_records", "layers0", "layers_float",
        "layers_bool"])
def test_init_cache_errors(num_slots, num_records, layers, message):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        init_cache(CONFIG, num_slots, num_records, layers=layers)


def test_init_cache_shapes():
    cache = init_cache(CONFIG, NUM_SLOTS, NUM_RECORDS, layers=LAYERS)
    H, K, RQ, W = CONFIG.heads, 128, CONFIG.rq, CONFIG.window
    assert cache.state.shape == (LAYERS, NUM_SLOTS, H, K, K)
    assert cache.conv.shape == (LAYERS, NUM_SLOTS, 3, H, K, W)
    assert cache.corrections.shape == (LAYERS, NUM_RECORDS, H, RQ, K)
    assert cache.key_gates.shape == (LAYERS, NUM_RECORDS, H, RQ, 2, K)
    assert cache.pending.shape == (LAYERS, NUM_RECORDS, H)
    assert init_cache(CONFIG, NUM_SLOTS, NUM_RECORDS).pending.shape == (NUM_RECORDS, H)


@pytest.mark.parametrize("layer, error, message", [
    (2, ValueError, "layer: expected an int in [0, L=2), got 2"),
    (-1, ValueError, "layer: expected an int in [0, L=2), got -1"),
    (np.int64(5), ValueError, "layer: expected an int in [0, L=2), got np.int64(5)"),
    (True, TypeError, "layer: expected an array [] int32, got True"),
    (jnp.float32(1), ValueError, "layer: expected [] int32, got [] float32"),
    (jnp.asarray([1], jnp.int32), ValueError, "layer: expected [] int32, got [1] int32"),
], ids=["2", "-1", "np5", "bool", "float32", "vector"])
@pytest.mark.parametrize("verify", [functools.partial(fused_verify, backend="jax"),
                                    stock_verify], ids=["xla", "stock_unjitted"])
def test_bad_layer(verify, arguments, stacked, layer, error, message):
    # (under jax.jit a Python int layer is traced: out of range, it is padding, see
    # test_protocol.py; the range is checked where it is still a Python int)
    _, _, inputs = arguments
    params, cache = stacked
    with pytest.raises(error, match=f"^{re.escape(message)}$"):
        verify(params, cache, inputs, CONFIG, layer=layer)


def test_stacking_mismatch(implementation, arguments, stacked):
    params, cache, inputs = arguments
    stacked_params, stacked_cache = stacked
    with pytest.raises(ValueError, match=re.escape(
            "cache.state: expected [L, S, H=2, 128, 128] float32, got [5, 2, 128, 128] float32")):
        implementation(params, cache, inputs, CONFIG, layer=0)
    with pytest.raises(ValueError, match=re.escape(
            "cache.state: expected [S, H=2, 128, 128] float32, got [2, 5, 2, 128, 128] float32")):
        implementation(stacked_params, stacked_cache, inputs, CONFIG)
    with pytest.raises(ValueError, match=re.escape(
            "params.conv_weight: expected [L=2, 3, 4, H=2, 128] float32 or bfloat16, "
            "got [3, 4, 2, 128] float32")):
        implementation(params, stacked_cache, inputs, CONFIG, layer=1)
    with pytest.raises(ValueError, match=re.escape(
            "cache.conv: expected [L=2, S=5, 3, H=2, 128, W=7] bfloat16, "
            "got [5, 3, 2, 128, 7] bfloat16")):
        implementation(stacked_params, dataclasses.replace(stacked_cache, conv=cache.conv),
                       inputs, CONFIG, layer=1)


def check_inputs_message(*lines):
    return "^" + re.escape("check_inputs found:\n  " + "\n  ".join(lines)) + "$"


def test_check_inputs_reports_every_problem():
    cache = init_cache(CONFIG, NUM_SLOTS, NUM_RECORDS)
    cache = replaced(cache, pending=jnp.asarray([[9, 9], [-1, -1], [2, 2], [0, 1]], jnp.int32))
    slots = [1, 7, 1, 2, 3, 0, -4, 4]
    record_rows = [0, 2, 3, 3, 1, 0, 5, -3]
    expected = [
        "slots[1]=7 is >= 5: treated as padding",
        "slots[6]=-4 is negative: treated as padding (use 0)",
        "record_rows[7]=-3 is below -1: keeps no records (use -1)",
        "slots: 1 is used by several requests [0, 2]",
        "record_rows: 3 is used by several requests [2, 3]",
        "pending[0]=9 (request 0) is outside [0, RQ=4]: clamped",
        "pending[3] (request 2) differs between heads or layers: [0, 1]",
        "pending[3] (request 3) differs between heads or layers: [0, 1]",
        "pending[1] (request 4) awaits the accept of its last verify: its tokens count as "
        "rejected",
    ]
    with pytest.raises(ValueError, match=check_inputs_message(*expected)):
        check_inputs(cache, slots, record_rows, CONFIG)


def test_check_inputs_lazy_pending():
    # RQ = 8: a verify keeps at most RQ - T = 4 records, so pending >= -(RQ - T + 1) = -5
    config = KdaConfig(heads=2, tokens=4, checkpoint_every=2)
    cache = init_cache(config, NUM_SLOTS, NUM_RECORDS)
    cache = replaced(cache, pending=jnp.asarray([[-5, -5], [-6, -6], [9, 9], [-2, -2]],
                                                jnp.int32))
    slots, record_rows = [1, 2, 3, 4], [0, 1, 2, 3]
    below = "pending[1]=-6 (request 1) is below -(RQ - T + 1)=-5: no verify leaves it"
    awaits = ("pending[{}] (request {}) awaits the accept of its last verify: its tokens "
              "count as rejected")
    with pytest.raises(ValueError, match=check_inputs_message(
            awaits.format(0, 0), below, "pending[2]=9 (request 2) is outside [0, RQ=8]: clamped",
            awaits.format(3, 3))):
        check_inputs(cache, slots, record_rows, config)
    with pytest.raises(ValueError, match=check_inputs_message(
            below, "record_rows[2]=2: no verify awaits an accept there (the accept is ignored)")):
        check_inputs(cache, slots, record_rows, config, accepted=[4, 4, 4, 0])


def test_check_inputs_out_of_range_record_row():
    cache = init_cache(CONFIG, NUM_SLOTS, NUM_RECORDS)
    with pytest.raises(ValueError, match=check_inputs_message(
            "record_rows[1]=4 is >= 4: keeps no records")):
        check_inputs(cache, [1, 2, 0], [0, 4, 9], CONFIG)


def test_check_inputs_accepts_a_valid_batch():
    cache = replaced(init_cache(CONFIG, NUM_SLOTS, NUM_RECORDS),
                     pending=jnp.asarray([[0, 0], [4, 4], [1, 1], [3, 3]], jnp.int32))
    # padding rows (slot 0, whatever their record row) and a live row without records
    check_inputs(cache, [1, 4, 0, 0, 0, 2], [3, -1, 3, 7, -5, 1], CONFIG)
    awaiting = replaced(cache, pending=jnp.full((NUM_RECORDS, 2), AWAITING, jnp.int32))
    check_inputs(awaiting, [1, 4, 0], [3, -1, 3], CONFIG, accepted=[0, 4, -2])


@pytest.mark.parametrize("record_rows, accepted, message", [
    (zeros((2,), F32), zeros((2,), I32), "record_rows: expected [B] int32, got [2] float32"),
    (zeros((2,), I32), zeros((3,), I32), "accepted: expected [B=2] int32, got [3] int32"),
], ids=["record_rows_float", "accepted_length"])
def test_accept_errors(record_rows, accepted, message):
    cache = init_cache(CONFIG, NUM_SLOTS, NUM_RECORDS)
    with pytest.raises(ValueError, match=f"^{re.escape(message)}"):
        accept(cache, record_rows, accepted, CONFIG)


def test_accept_wants_a_config_and_a_cache_of_it():
    cache = init_cache(CONFIG, NUM_SLOTS, NUM_RECORDS)
    rows = zeros((2,), I32)
    with pytest.raises(TypeError, match="^config: expected a KdaConfig, got str$"):
        accept(cache, rows, rows, "heads=2")
    with pytest.raises(TypeError, match="^cache: expected a KdaCache, got tuple$"):
        accept((cache.pending,), rows, rows, CONFIG)
    with pytest.raises(ValueError, match=re.escape(
            "cache.state: expected [S, H=3, 128, 128] float32, got [5, 2, 128, 128] float32")):
        accept(cache, rows, rows, KdaConfig(heads=3, tokens=4))


def test_flush_errors(arguments, stacked):
    params, cache, _ = arguments
    stacked_params, stacked_cache = stacked
    with pytest.raises(ValueError, match=re.escape(
            "params.conv_weight: expected [L=2, 3, 4, H=2, 128] float32 or bfloat16, "
            "got [3, 4, 2, 128] float32")):
        flush(params, stacked_cache, zeros((2,), I32), zeros((2,), I32), CONFIG)
    with pytest.raises(ValueError, match=re.escape(
            "params.conv_weight: expected [3, 4, H=2, 128] float32 or bfloat16, "
            "got [2, 3, 4, 2, 128] float32")):
        flush(stacked_params, cache, zeros((2,), I32), zeros((2,), I32), CONFIG)
    with pytest.raises(ValueError, match=re.escape(
            "record_rows: expected [B=2] int32, got [3] int32")):
        flush(params, cache, zeros((2,), I32), zeros((3,), I32), CONFIG)
    with pytest.raises(ValueError, match=re.escape(
            "cache.state: expected [S, H=2, 128, 128] float32, got [5, 2, 128, 64] float32")):
        flush(params, replaced(cache, state=zeros((5, 2, 128, 64), F32)),
              zeros((2,), I32), zeros((2,), I32), CONFIG)


def test_wrong_config_type_everywhere(arguments):
    # every entry names the config (not an AttributeError from inside a check)
    params, cache, _ = arguments
    rows = zeros((2,), I32)
    message = "^config: expected a KdaConfig, got dict$"
    for call in (lambda: flush(params, cache, rows, rows, {"heads": 2}),
                 lambda: accept(cache, rows, rows, {"heads": 2}),
                 lambda: check_inputs(cache, [1, 2], [0, 1], {"heads": 2})):
        with pytest.raises(TypeError, match=message):
            call()
