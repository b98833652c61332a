"""Bad values in one token (NaN, +-inf, an overflow-sized value) and what they may reach.

A verify (or prefill) is run twice from the same cache, once on clean inputs and once
with one field of one token of request 0 set to a bad value; then, after accepting only
the tokens before it, the next verify runs from both caches on the same clean inputs.
Everything the bad token may not reach must be bitwise the clean run's: request 0's
earlier tokens and their records and window, every other request, the replayed state,
and the whole next step (which must be finite).
"""
import dataclasses

import jax.numpy as jnp
import numpy as np

VALUES = {"nan": np.nan, "inf": np.inf, "-inf": -np.inf, "huge": 3e38}
# (field, index of the bad element after [request, token]): x's q, k and v parts
FIELDS = {"x.q": ("x", (0,)), "x.k": ("x", (1,)), "x.v": ("x", (2,)), "f_a": ("f_a", ()),
          "beta": ("beta", ()), "gate": ("gate", ())}


def spoiled(inputs, field, token, value):
    """inputs with `field` (a key of FIELDS) of request 0, token `token` set to VALUES
    [value] (every head and channel of that field and token)."""
    name, index = FIELDS[field]
    array = getattr(inputs, name)
    return dataclasses.replace(inputs, **{name: array.at[(0, token) + index].set(
        jnp.asarray(VALUES[value], array.dtype))})


def bits(a):
    """The raw bits of an array (NaN payloads included), as unsigned integers."""
    a = np.asarray(a)
    return a.view({2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def assert_same(actual, expected, what):
    assert np.array_equal(bits(actual), bits(expected)), f"{what} changed"


def check_verify(verify, accept, params, cache, inputs, config, field, token, value, copy):
    """The scenario of this module for a verify(params, cache, inputs) -> (out, cache)
    and accept(cache, record_rows, accepted) -> cache, on a cache of one layer; request 0
    must have records and a slot of its own, and config.rq must be config.tokens (each
    step rewrites every record and window position). copy(cache): a fresh copy (for
    verifies that donate it)."""
    bad = spoiled(inputs, field, token, value)
    out, after = verify(params, copy(cache), inputs)
    bad_out, bad_after = verify(params, copy(cache), bad)
    rec, slot = int(inputs.record_rows[0]), int(inputs.slots[0])
    assert_same(bad_out[0, :token], out[0, :token], "an earlier token's output")
    assert_same(bad_out[1:], out[1:], "another request's output")
    assert_same(bad_after.state, after.state, "the replayed state")
    assert_same(bad_after.pending, after.pending, "pending")
    for name in ("corrections", "key_gates"):  # [R, H, RQ, ...]
        clean, spoilt = np.asarray(getattr(after, name)), np.asarray(getattr(bad_after, name))
        assert_same(spoilt[rec, :, :token], clean[rec, :, :token],
                    f"an earlier token's record ({name})")
        assert_same(np.delete(spoilt, rec, 0), np.delete(clean, rec, 0),
                    f"another request's records ({name})")
    window, bad_window = np.asarray(after.conv), np.asarray(bad_after.conv)  # [S, ..., W]
    assert_same(bad_window[slot, ..., :token + 3], window[slot, ..., :token + 3],
                "the window before the bad token")
    assert_same(np.delete(bad_window, slot, 0), np.delete(window, slot, 0),
                "another request's window")
    accepted = jnp.full(inputs.record_rows.shape, token, jnp.int32)
    next_out, next_cache = verify(params, accept(after, inputs.record_rows, accepted), inputs)
    bad_next_out, bad_next_cache = verify(
        params, accept(bad_after, inputs.record_rows, accepted), inputs)
    assert np.all(np.isfinite(np.asarray(bad_next_out, np.float32))), "the next step is not finite"
    assert_same(bad_next_out, next_out, "the next step's output")
    for name, leaf in vars(next_cache).items():  # RQ = T: the next step rewrites every record
        if leaf is not None:
            assert_same(getattr(bad_next_cache, name), leaf, f"the next step's {name}")


def check_prefill(prefill, params, cache, inputs, field, token, value):
    """The scenario for a prefill(params, cache, inputs) -> (out, cache): request 0's
    tokens before `token` and every other request are the clean run's."""
    bad = spoiled(inputs, field, token, value)
    out, after = prefill(params, cache, inputs)
    bad_out, bad_after = prefill(params, cache, bad)
    assert_same(bad_out[0, :token], out[0, :token], "an earlier token's output")
    assert_same(bad_out[1:], out[1:], "another request's output")
    slot = int(inputs.slots[0])
    assert_same(np.delete(np.asarray(bad_after.state), slot, 0),
                np.delete(np.asarray(after.state), slot, 0), "another request's state")
