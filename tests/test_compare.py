"""The comparison helpers never hide a NaN: each fails when the actual value is NaN (or
inf) where the expected one is finite, and the other way round; NaN matches NaN only
(the poisoned null slot and unread records compare equal to themselves)."""
from types import SimpleNamespace

import ml_dtypes
import numpy as np
import pytest

import compare
import test_parity

BAD = [np.nan, np.inf, -np.inf]


def arrays(dtype=np.float32):
    rng = np.random.default_rng(0)
    expected = rng.standard_normal((2, 3, 128)).astype(dtype)
    expected[0, 0, :5] = np.nan  # NaN on both sides must match
    actual = expected.copy()
    return actual, expected


@pytest.mark.parametrize("bad", BAD, ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("side", ["actual", "expected"])
def test_errors_are_infinite(bad, side):
    actual, expected = arrays()
    assert compare.out_error(actual, expected) == 0
    assert compare.scaled_error(actual, expected) == 0
    assert compare.bf16_ulps(actual, expected).max() == 0
    assert compare.differing_bits(actual, expected) == 0
    (actual if side == "actual" else expected)[1, 2, 7] = bad
    assert compare.difference(actual, expected)[1, 2, 7] == np.inf
    assert compare.out_error(actual, expected) == np.inf
    assert compare.scaled_error(actual, expected) == np.inf
    assert compare.bf16_ulps(actual, expected).max() == np.inf
    assert compare.differing_bits(actual, expected) == 1
    for check in (lambda: compare.assert_out_close(actual, expected, 1.0),
                  lambda: compare.assert_scaled_close(actual, expected, 1.0, "x"),
                  lambda: compare.assert_ulps_close(actual, expected, 100, "x"),
                  lambda: compare.assert_same_bits(actual, expected, "x")):
        with pytest.raises(AssertionError):
            check()


def test_a_whole_nan_row_is_caught():
    # a row whose expected values are all NaN has no scale; an actual finite row there,
    # or a NaN row where the expected one is finite, is still an infinite error
    actual, expected = arrays()
    expected[1, 1] = np.nan
    assert compare.out_error(actual, expected) == np.inf
    actual, expected = arrays()
    actual[1, 1] = np.nan
    assert compare.out_error(actual, expected) == np.inf


def test_parity_errors_catch_a_nan_anywhere():
    rng = np.random.default_rng(1)
    cache = SimpleNamespace(
        state=rng.standard_normal((3, 2, 4, 4)).astype(np.float32),
        conv=rng.standard_normal((3, 3, 2, 4, 7)).astype(ml_dtypes.bfloat16),
        corrections=rng.standard_normal((2, 2, 4, 4)).astype(np.float32),
        key_gates=rng.standard_normal((2, 2, 4, 2, 4)).astype(ml_dtypes.bfloat16),
        pending=np.zeros((2, 2), np.int32))
    out = rng.standard_normal((2, 4, 2, 4)).astype(ml_dtypes.bfloat16)
    tolerances = test_parity.TOLERANCES
    clean = test_parity.errors(out, cache, out, cache)
    assert all(value == 0 for value in clean.values()), clean
    for field, index, quantity in [("out", (1, 2, 0, 3), "out"),
                                   ("state", (2, 1, 0, 3), "state"),
                                   ("corrections", (1, 0, 2, 1), "corrections"),
                                   ("key_gates", (1, 1, 3, 0, 2), "keys"),
                                   ("key_gates", (0, 1, 3, 1, 2), "gates"),
                                   ("conv", (1, 2, 0, 3, 6), "window")]:
        broken = SimpleNamespace(**vars(cache))
        broken_out = out.copy()
        target = broken_out if field == "out" else getattr(cache, field).copy()
        target[index] = np.nan
        if field != "out":
            setattr(broken, field, target)
        measured = test_parity.errors(broken_out, broken, out, cache)
        assert not measured[quantity] <= tolerances["model", quantity], (field, measured)
