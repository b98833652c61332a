"""Argument checks: shapes, dtypes and config at trace time; index and pending values
on the host (`check_inputs`)."""
from __future__ import annotations

import numpy as np
import jax.numpy as jnp

from jax_kda.config import CONV_TAPS, K, KdaConfig
from jax_kda.pytrees import KdaCache, KdaParams, VerifyInputs

BF16, F32, I32 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32), jnp.dtype(jnp.int32)


def _describe(dims, dtypes):
    text = ", ".join(
        label if value is None else (str(value) if label is None else f"{label}={value}")
        for label, value in dims
    )
    return f"[{text}] {' or '.join(d.name for d in dtypes)}"


def expect(name, array, dims, dtypes):
    """Checks `array` against `dims` ((label, size) pairs; size None binds the label to
    whatever the array has) and `dtypes`; returns the bound sizes by label."""
    if not hasattr(array, "shape") or not hasattr(array, "dtype"):
        raise TypeError(f"{name}: expected an array {_describe(dims, dtypes)}, got {array!r}")
    shape = tuple(array.shape)
    ok = len(shape) == len(dims) and all(
        value is None or size == value for (_, value), size in zip(dims, shape)
    )
    if not ok or jnp.dtype(array.dtype) not in dtypes:
        raise ValueError(
            f"{name}: expected {_describe(dims, dtypes)}, "
            f"got [{', '.join(map(str, shape))}] {jnp.dtype(array.dtype).name}"
        )
    return {label: size for (label, value), size in zip(dims, shape) if value is None}


def _typed(name, value, cls):
    if not isinstance(value, cls):
        raise TypeError(f"{name}: expected a {cls.__name__}, got {type(value).__name__}")


def check_params(params: KdaParams, config: KdaConfig) -> None:
    """Trace-time check of the layer weights against `config`."""
    _typed("params", params, KdaParams)
    _typed("config", config, KdaConfig)
    H = config.heads
    conv_dtype = jnp.dtype(getattr(params.conv_weight, "dtype", F32))
    expect("params.conv_weight", params.conv_weight,
           [(None, 3), (None, CONV_TAPS), ("H", H), (None, K)], (F32, BF16))
    if params.conv_bias is not None:
        expect("params.conv_bias", params.conv_bias, [(None, 3), ("H", H), (None, K)],
               (conv_dtype,))
    expect("params.a_log", params.a_log, [("H", H)], (F32,))
    expect("params.dt_bias", params.dt_bias, [("H", H), (None, K)], (F32,))
    expect("params.f_b", params.f_b, [("H", H), (None, K), (None, K)], (BF16,))
    expect("params.norm_weight", params.norm_weight, [(None, K)], (F32, BF16))


def check_cache(cache: KdaCache, config: KdaConfig) -> tuple[int, int]:
    """Trace-time check of the cache; returns (S, R)."""
    _typed("cache", cache, KdaCache)
    H, RQ = config.heads, config.rq
    S = expect("cache.state", cache.state, [("S", None), ("H", H), (None, K), (None, K)],
               (F32,))["S"]
    expect("cache.conv", cache.conv,
           [("S", S), (None, 3), ("H", H), (None, K), ("RQ+2", RQ + CONV_TAPS - 2)], (BF16,))
    R = expect("cache.corrections", cache.corrections,
               [("R", None), ("H", H), ("RQ", RQ), (None, K)], (F32,))["R"]
    expect("cache.key_gates", cache.key_gates,
           [("R", R), ("H", H), ("RQ", RQ), (None, 2), (None, K)], (BF16,))
    expect("cache.pending", cache.pending, [("R", R)], (I32,))
    if S < 1 or R < 1:
        raise ValueError(f"cache: expected S >= 1 slots and R >= 1 record rows, got {S=}, {R=}")
    return S, R


def check_verify(params: KdaParams, cache: KdaCache, inputs: VerifyInputs,
                 config: KdaConfig) -> int:
    """Trace-time check of every argument of a verify; returns the batch size B."""
    check_params(params, config)
    check_cache(cache, config)
    _typed("inputs", inputs, VerifyInputs)
    H, T = config.heads, config.tokens
    B = expect("x", inputs.x, [("B", None), ("T", T), (None, 3), ("H", H), (None, K)],
               (BF16,))["B"]
    expect("f_a", inputs.f_a, [("B", B), ("T", T), (None, K)], (BF16,))
    expect("beta", inputs.beta, [("B", B), ("T", T), ("H", H)], (BF16,))
    expect("gate", inputs.gate, [("B", B), ("T", T), ("H", H), (None, K)], (BF16,))
    expect("slots", inputs.slots, [("B", B)], (I32,))
    expect("record_rows", inputs.record_rows, [("B", B)], (I32,))
    return B


def check_inputs(cache: KdaCache, slots, record_rows, config: KdaConfig) -> None:
    """Host-side check of the index values of one batch (concrete arrays, not tracers).

    Raises ValueError listing every problem: slots or record rows past their buffers
    (which the verify treats as padding / as keeping no records), a slot or record row
    used twice in the batch, and pending counts outside [0, RQ] (which the verify
    clamps). Padding rows (slot <= 0) are ignored.
    """
    S, R, RQ = cache.state.shape[0], cache.pending.shape[0], config.rq
    slots, rows = np.asarray(slots), np.asarray(record_rows)
    pending = np.asarray(cache.pending)
    live = slots > 0
    problems = []
    for b in np.flatnonzero(live & (slots >= S)):
        problems.append(f"slots[{b}]={slots[b]} is >= num_slots={S}: treated as padding")
    for b in np.flatnonzero(live & (rows >= R)):
        problems.append(f"record_rows[{b}]={rows[b]} is >= num_records={R}: keeps no records")
    for name, values, mask in (("slots", slots, live & (slots < S)),
                               ("record_rows", rows, live & (rows >= 0) & (rows < R))):
        used, counts = np.unique(values[mask], return_counts=True)
        for value in used[counts > 1]:
            where = np.flatnonzero(mask & (values == value)).tolist()
            problems.append(f"{name}: {value} is used by several requests {where}")
    for b in np.flatnonzero(live & (rows >= 0) & (rows < R)):
        n = pending[rows[b]]
        if not 0 <= n <= RQ:
            problems.append(f"pending[{rows[b]}]={n} (request {b}) is outside [0, RQ={RQ}]: "
                            "clamped")
    if problems:
        raise ValueError("check_inputs found:\n  " + "\n  ".join(problems))
