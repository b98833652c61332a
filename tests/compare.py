"""Comparison helpers shared by the test modules. Every one of them fails when the
actual value is NaN (or inf) where the expected one is finite, and where the expected
one is NaN and the actual is not; NaN only matches NaN (tests/test_compare.py checks
this for each helper). Errors are returned as floats that are never NaN, so that a
`value <= tolerance` check cannot pass by accident."""
import numpy as np

FIELDS = ("state", "conv", "corrections", "key_gates", "pending")


def difference(actual, expected):
    """|actual - expected| as float64, 0 where both are NaN (or the same inf), inf where
    only one is NaN or the two differ by an inf."""
    a, e = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    both = (np.isnan(a) & np.isnan(e)) | (np.isinf(a) & (a == e))
    with np.errstate(invalid="ignore"):
        gap = np.abs(a - e)
    return np.where(both, 0.0, np.where(np.isnan(gap), np.inf, gap))


def out_error(actual, expected):
    """The worst |actual - expected| over |expected| + the mean |expected| of its row
    (last axis): the unit of outputs, which a flipped bf16 rounding moves by ulps of
    their row's scale."""
    magnitude = np.abs(np.asarray(expected, np.float64))
    finite = np.isfinite(magnitude)
    count = np.sum(finite, axis=-1, keepdims=True)
    row = np.sum(np.where(finite, magnitude, 0.0), axis=-1, keepdims=True) / np.maximum(count, 1)
    scale = magnitude + row
    scale = np.where(np.isfinite(scale), np.maximum(scale, np.finfo(np.float64).tiny), 1.0)
    gap = difference(actual, expected)
    return float(np.max(gap / scale)) if gap.size else 0.0


def buffer_scale(expected):
    """max |expected| over its finite values (1 where there are none or all are 0)."""
    e = np.abs(np.asarray(expected, np.float64))
    e = e[np.isfinite(e)]
    return float(e.max()) if e.size and e.max() > 0 else 1.0


def scaled_error(actual, expected):
    """The worst |actual - expected| over max |expected| of the buffer: the unit of FP32
    states and corrections, whose rounding error scales with the buffer's magnitude."""
    gap = difference(actual, expected)
    return float(gap.max() / buffer_scale(expected)) if gap.size else 0.0


def bf16_ulp(expected):
    """One bf16 ulp of each expected value (8 significant bits; that of 1e-30 for 0 and
    non-finite values)."""
    e = np.nan_to_num(np.asarray(expected, np.float64), posinf=0.0, neginf=0.0)
    return np.ldexp(1.0, np.floor(np.log2(np.maximum(np.abs(e), 1e-30))).astype(int) - 7)


def bf16_ulps(actual, expected):
    """|actual - expected| in bf16 ulps of expected (8 significant bits)."""
    return difference(actual, expected) / bf16_ulp(expected)


def bits(array):
    """The array's bytes as unsigned integers, so NaNs and signed zeros compare exactly."""
    array = np.asarray(array)
    return array.view(np.dtype(f"u{array.dtype.itemsize}"))


def differing_bits(actual, expected):
    """How many elements differ in their bits (shapes and dtypes must agree)."""
    a, e = np.asarray(actual), np.asarray(expected)
    assert a.shape == e.shape and a.dtype == e.dtype, (a.shape, a.dtype, e.shape, e.dtype)
    return int(np.sum(bits(a) != bits(e)))


def assert_same_bits(actual, expected, what):
    a, e = np.asarray(actual), np.asarray(expected)
    assert a.shape == e.shape and a.dtype == e.dtype, (what, a.shape, a.dtype, e.shape, e.dtype)
    np.testing.assert_array_equal(bits(a), bits(e), err_msg=what)


def assert_same_cache(actual, expected, what="cache", fields=FIELDS):
    """Every field of two caches bitwise equal."""
    for field in fields:
        assert_same_bits(getattr(actual, field), getattr(expected, field), f"{what}.{field}")


def assert_out_close(actual, expected, rtol, what="out"):
    error = out_error(actual, expected)
    assert error <= rtol, f"{what}: error {error} over {rtol}"


def assert_scaled_close(actual, expected, tolerance, what):
    error = scaled_error(actual, expected)
    assert error <= tolerance, f"{what}: error {error} over {tolerance}"


def assert_ulps_close(actual, expected, ulps, what):
    error = float(np.max(bf16_ulps(actual, expected), initial=0.0))
    assert error <= ulps, f"{what}: {error} bf16 ulps over {ulps}"


# Against the float64 model (tests/numpy_model.py): a flipped bf16 rounding of o_t (or
# of a SiLU output) moves an output by a few ulps of 2^-8 of its row's scale; the
# replayed checkpoint is the closed form (or the scan) in FP32, a few roundings of O(1)
# terms per token; a key or v rounded the other way moves u_t by a fraction of a bf16
# ulp of its scale (see test_parity.py).
MODEL_OUT_RTOL = 4 * 2**-8
MODEL_STATE_TOL = 1e-5
MODEL_CORRECTIONS_TOL = 2**-8


def assert_matches_model(out, new, model_out, model, what=""):
    """A verify's results against the model's, within the tolerances above; recorded
    keys and raw gates within one bf16 ulp (an FP32 exp or sum order that flips a
    rounding, see test_parity.py), windows and pending exact."""
    assert np.all(np.isfinite(model_out)), "the model read a poisoned value"
    assert_out_close(out, model_out, MODEL_OUT_RTOL, f"{what}out")
    assert_scaled_close(new.state, model.state, MODEL_STATE_TOL, f"{what}state")
    assert_scaled_close(new.corrections, model.corrections, MODEL_CORRECTIONS_TOL,
                        f"{what}corrections")
    assert_ulps_close(new.key_gates, model.key_gates, 1, f"{what}key_gates")
    for field in ("conv", "pending"):
        assert_same_bits(getattr(new, field), getattr(model, field), f"{what}{field}")
