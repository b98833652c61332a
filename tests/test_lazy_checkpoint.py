"""The lazy checkpoint (docs/spec.md, "Lazy checkpoint"): with checkpoint_every C > 1 a
verify keeps the accepted tokens in the records and writes its T records after them,
and writes the replayed state only when they would not fit. Episodes of both JAX
verifies against the float64 NumPy model and each other for C in {1, 2, 4}, the same
episode at C = 1 and C = 2, and the edges: records that fill exactly (per head),
accepted 0, a forgotten and a repeated accept, a flush in mid-episode, stacked layers,
a prefill piece resuming after kept verifies, and the kernel backend's refusal."""
import dataclasses
import re

import jax.numpy as jnp
import numpy as np
import pytest

import numpy_model
from compare import (MODEL_OUT_RTOL, MODEL_STATE_TOL, assert_matches_model,
                     assert_out_close, assert_same_bits, assert_same_cache,
                     assert_scaled_close)
from jax_kda import KdaConfig, PrefillInputs, accept, check_inputs, flush, fused_verify, prefill
from poison import poison

HEADS, NUM_SLOTS, NUM_RECORDS, LAYERS = 2, 5, 4, 2
SLOTS, ROWS = [2, 4, 3], [1, 3, -1]  # the last request keeps no records
# xla against stock over an episode (extra information: they share every pointwise step
# and the cache's rows): FP32 reordering of the recurrence, ~1e-7 of the state's scale
# a step; a flipped o_t rounding moves an output by a few bf16 ulps of its row's scale.
PAIR_OUT_RTOL, PAIR_STATE_TOL = 4 * 2**-8, 1e-5


def arrays(values):
    return jnp.asarray(values, jnp.int32)


def setup(draw, config, seed, layers=None):
    """Params and a cache as a running decode leaves it (pending in [1, T], the same in
    every head and layer) for `config`."""
    params = draw.params(draw.key(seed), config, layers=layers)
    cache = draw.cache(draw.key(seed + 1), config, NUM_SLOTS, NUM_RECORDS, layers=layers)
    return params, cache


def step_inputs(draw, config, seed, slots=SLOTS, rows=ROWS):
    return draw.inputs(draw.key(seed), config, arrays(slots), arrays(rows))


def with_pending(cache, pending):
    return dataclasses.replace(cache, pending=arrays(pending))


def verified(verify, params, cache, inputs, config, what=""):
    """A verify from `cache` poisoned where the batch must not read, checked against the
    model's verify from the same cache: (before, out, after)."""
    before = poison(cache, config, inputs.slots, inputs.record_rows)
    out, after = verify(params, before, inputs, config)
    assert_matches_model(out, after, *numpy_model.verify(params, before, inputs, config), what)
    return before, out, after


def run_episode(config, seed, implementations, draw, steps):
    """Steps of verify and accept (random counts 0..T) per implementation, each step
    checked against the model run from the implementation's own cache before it, and
    xla against stock. Returns (params, the final caches by name, counts of the
    (request, head, step)s that kept n > 0 tokens and that wrote S_n, n > 0, on the
    stock run)."""
    rng = np.random.default_rng(seed)
    params, first = setup(draw, config, seed)
    caches = {name: first for name in implementations}
    kept = written = 0
    with_records = [row for row in ROWS if row >= 0]
    for step in range(steps):
        inputs = step_inputs(draw, config, seed + 2 + step)
        accepted = arrays(rng.integers(0, config.tokens + 1, size=len(SLOTS)))
        results = {}
        for name, verify in implementations.items():
            before, out, after = verified(verify, params, caches[name], inputs, config,
                                          f"{name} step {step}: ")
            results[name] = before, out, after
            caches[name] = accept(after, inputs.record_rows, accepted, config)
            assert_same_cache(caches[name],
                              numpy_model.accept(after, ROWS, accepted, config))
        before, out, after = results["stock"]
        n = numpy_model.kept_records(np.asarray(before.pending)[with_records], config.rq)
        settled = np.asarray(after.pending)[with_records]
        kept += int(np.sum((n > 0) & (settled < -1)))
        written += int(np.sum((n > 0) & (settled == -1)))
        if config.checkpoint_every == 1:
            np.testing.assert_array_equal(settled, -1)  # keeps nothing: today's verify
        else:  # keeps exactly where the next T records fit
            keep = n + config.tokens <= config.rq
            np.testing.assert_array_equal(settled, np.where(keep, -n - 1, -1))
        _, xla_out, xla_after = results["xla"]
        assert_out_close(xla_out, out, PAIR_OUT_RTOL, f"xla vs stock step {step}: out")
        assert_scaled_close(xla_after.state, after.state, PAIR_STATE_TOL,
                            f"xla vs stock step {step}: state")
        for field in ("conv", "pending"):
            assert_same_bits(getattr(xla_after, field), getattr(after, field),
                             f"xla vs stock step {step}: {field}")
    return params, caches, kept, written


def assert_flushed(params, cache, config, what):
    """flush(cache) against the model's flush of the same cache; returns it."""
    flushed = flush(params, cache, arrays(SLOTS), arrays(ROWS), config)
    model = numpy_model.flush(params, cache, SLOTS, ROWS, config)
    assert_scaled_close(flushed.state, model.state, MODEL_STATE_TOL, f"{what}flushed state")
    for field in ("conv", "corrections", "key_gates", "pending"):
        assert_same_bits(getattr(flushed, field), getattr(model, field), f"{what}flushed {field}")
    return flushed


def report(*lines):
    return "^" + re.escape("check_inputs found:\n  " + "\n  ".join(lines)) + "$"


@pytest.mark.parametrize("every", [1, 2, 4], ids=lambda v: f"every{v}")
@pytest.mark.parametrize("tokens", [2, 4, 8], ids=lambda v: f"T{v}")
def test_episode(implementations, draw, tokens, every):
    """2C + 2 steps, enough to fill the records of C steps at random accepts."""
    config = KdaConfig(heads=HEADS, tokens=tokens, checkpoint_every=every)
    params, caches, kept, written = run_episode(config, 10 * tokens + every,
                                                implementations, draw, 2 * every + 2)
    if every > 1:
        assert kept and written, f"the episode kept {kept} and wrote {written} times"
    flushed = {name: assert_flushed(params, cache, config, f"{name} ")
               for name, cache in caches.items()}
    assert_scaled_close(flushed["xla"].state, flushed["stock"].state, PAIR_STATE_TOL,
                        "xla vs stock flushed state")


def test_lazy_gives_the_outputs_of_every_step(draw):
    """The same episode at C = 1 and C = 2 with the same RQ: other writes of the cache,
    the same outputs every step (to FP32 rounding of the states they replay from) and the
    same state after a flush."""
    every = {C: KdaConfig(heads=HEADS, tokens=3, checkpoint_every=C, record_tokens=9)
             for C in (1, 2)}
    rng = np.random.default_rng(5)
    params, first = setup(draw, every[1], 50)
    caches = {C: first for C in every}
    for step in range(5):
        inputs = step_inputs(draw, every[1], 52 + step)
        accepted = arrays(rng.integers(0, 4, size=len(SLOTS)))
        outs = {}
        for C, config in every.items():
            outs[C], after = fused_verify(params, caches[C], inputs, config, backend="jax")
            caches[C] = accept(after, inputs.record_rows, accepted, config)
        assert_out_close(outs[2], outs[1], MODEL_OUT_RTOL, f"step {step}: out")
    assert not np.array_equal(np.asarray(caches[1].pending), np.asarray(caches[2].pending))
    flushed = {C: flush(params, caches[C], arrays(SLOTS), arrays(ROWS), config)
               for C, config in every.items()}
    assert_scaled_close(flushed[2].state, flushed[1].state, MODEL_STATE_TOL, "flushed state")
    assert_same_bits(flushed[2].conv[..., :3], flushed[1].conv[..., :3], "history")


FILL = KdaConfig(heads=HEADS, tokens=4, checkpoint_every=2)  # RQ = 8, W = 11


def test_records_that_fill_exactly(implementation, draw):
    """n + T == RQ keeps, n + T == RQ + 1 writes, per head: request 0's head 0 keeps 4
    and head 1 writes 5, request 1 the other way round; request 2 (no records) neither.
    Each head's records and window land at its own offset, the rest as it was."""
    T, RQ = FILL.tokens, FILL.rq
    params, cache = setup(draw, FILL, 20)
    cache = with_pending(cache, [[2, 2], [RQ - T, RQ - T + 1], [0, 0], [RQ - T + 1, RQ - T]])
    inputs = step_inputs(draw, FILL, 22)
    before, _, after = verified(implementation, params, cache, inputs, FILL)
    x = np.moveaxis(np.asarray(inputs.x), 1, -1)  # [B, 3, H, K, T]
    for b, (slot, row) in enumerate(zip(SLOTS[:2], ROWS[:2])):
        for h in range(HEADS):
            n = int(before.pending[row, h])
            keep = n + T <= RQ
            base = n if keep else 0
            what = f"request {b} head {h}"
            assert int(after.pending[row, h]) == -(base + 1), what
            state = (after.state[slot, h], before.state[slot, h])
            assert np.array_equal(*map(np.asarray, state)) == keep, f"{what}: state"
            # records: the new T at base..base+T-1, every other position as it was
            records = np.asarray(after.corrections[row, h])
            assert np.all(np.isfinite(records[base:base + T])), what
            others = np.setdiff1d(np.arange(RQ), np.arange(base, base + T))
            assert_same_bits(records[others], np.asarray(before.corrections[row, h])[others],
                             f"{what}: other records")
            # window: [history, x] at base..base+T+2, the history read at n
            window, old = np.asarray(after.conv[slot, :, h]), np.asarray(before.conv[slot, :, h])
            assert_same_bits(window[..., base:base + 3], old[..., n:n + 3], f"{what}: history")
            assert_same_bits(window[..., base + 3:base + T + 3], x[b, :, h], f"{what}: tokens")
            untouched = np.setdiff1d(np.arange(FILL.window), np.arange(base, base + T + 3))
            assert_same_bits(window[..., untouched], old[..., untouched], f"{what}: untouched")
    assert_same_bits(after.state[SLOTS[2]], before.state[SLOTS[2]], "no records: state")


def test_accepts_after_a_kept_verify(implementation, draw):
    """A verify that kept m = 3 awaits as -(m + 1): accept adds to m (clamped to T, 0
    rejects), a repeated accept changes nothing, a forgotten one is an accept of 0; the
    next verify replays m + a and writes S_n once the records are full."""
    T, RQ = FILL.tokens, FILL.rq
    params, cache = setup(draw, FILL, 30)
    cache = with_pending(cache, [[3, 3], [3, 3], [0, 0], [1, 1]])
    first, second = step_inputs(draw, FILL, 32), step_inputs(draw, FILL, 33)
    _, _, after = verified(implementation, params, cache, first, FILL)
    np.testing.assert_array_equal(np.asarray(after.pending)[[1, 3]], [[-4, -4], [-2, -2]])
    awaiting = [f"pending[{row}] (request {b}) awaits the accept of its last verify: its "
                "tokens count as rejected" for b, row in enumerate(ROWS[:2])]
    with pytest.raises(ValueError, match=report(*awaiting)):
        check_inputs(after, SLOTS, ROWS, FILL)
    check_inputs(after, SLOTS, ROWS, FILL, accepted=[0, T, 2])

    rows = arrays(ROWS)
    for accepted, pending in (([0, 0, 0], [3, 1]), ([2, T + 5, 0], [5, 1 + T]),
                              ([-1, 1, 0], [3, 2])):
        counted = accept(after, rows, arrays(accepted), FILL)
        assert_same_cache(counted, numpy_model.accept(after, ROWS, accepted, FILL))
        np.testing.assert_array_equal(np.asarray(counted.pending)[[1, 3]],
                                      np.repeat(np.asarray(pending)[:, None], HEADS, 1))
        # a repeated accept changes nothing
        with pytest.raises(ValueError, match=report(*[
                f"record_rows[{b}]={row}: no verify awaits an accept there (the accept is "
                "ignored)" for b, row in enumerate(ROWS[:2])])):
            check_inputs(counted, SLOTS, ROWS, FILL, accepted=[1, 1, 1])
        assert_same_cache(accept(counted, rows, arrays([1, 1, 1]), FILL), counted)
        # the next verify replays m + a kept tokens: 5 + T > RQ writes S_5
        before, out, new = verified(implementation, params, counted, second, FILL)
        n = pending[0]
        assert int(new.pending[1, 0]) == (-1 if n + T > RQ else -(n + 1))
        changed = not np.array_equal(np.asarray(new.state[SLOTS[0]]),
                                     np.asarray(before.state[SLOTS[0]]))
        assert changed == (n + T > RQ)
        if accepted[0] == 0:  # a forgotten accept: bitwise an accept of 0
            forgotten_out, forgotten = implementation(
                params, poison(after, FILL, second.slots, second.record_rows), second, FILL)
            assert_same_bits(forgotten_out, out, "forgotten accept: out")
            assert_same_cache(forgotten, new, "forgotten accept")


def test_flush_mid_episode(implementation, draw):
    """A flush between two steps of a C = 2 episode (T = 2, RQ = 4) changes the cache's
    layout (the kept tokens move into the checkpoint) but not the outputs of the steps
    after it, nor the state after a final flush."""
    config = KdaConfig(heads=HEADS, tokens=2, checkpoint_every=2)
    params, first = setup(draw, config, 40)
    first = with_pending(first, [[0, 0], [1, 1], [0, 0], [2, 2]])
    caches = {"plain": first, "flushed": first}
    accepted = arrays([1, 2, 0])
    for step in range(5):
        if step == 2:
            caches["flushed"] = assert_flushed(params, caches["flushed"], config, "mid ")
            np.testing.assert_array_equal(np.asarray(caches["flushed"].pending)[[1, 3]], 0)
            assert np.any(np.asarray(caches["plain"].pending)[[1, 3]] > 0)
        inputs = step_inputs(draw, config, 42 + step)
        outs = {}
        for name, cache in caches.items():
            _, outs[name], after = verified(implementation, params, cache, inputs, config,
                                            f"{name} step {step}: ")
            caches[name] = accept(after, inputs.record_rows, accepted, config)
        assert_out_close(outs["flushed"], outs["plain"], MODEL_OUT_RTOL, f"step {step}: out")
    final = {name: assert_flushed(params, cache, config, f"{name} ")
             for name, cache in caches.items()}
    assert_scaled_close(final["flushed"].state, final["plain"].state, MODEL_STATE_TOL,
                        "final state")
    assert_same_bits(final["flushed"].conv[..., :3], final["plain"].conv[..., :3], "history")
    assert_same_bits(final["flushed"].pending, final["plain"].pending, "pending")


def test_stacked_layers(implementation, draw):
    """Each layer of a stacked cache verified in turn (layer=i) over three steps, each
    against the model's layer call; accept and flush of the stacked cache whole."""
    config = KdaConfig(heads=HEADS, tokens=2, checkpoint_every=2)
    params, cache = setup(draw, config, 60, layers=LAYERS)
    accepted, kept = arrays([2, 1, 2]), []
    for step in range(3):
        for layer in range(LAYERS):  # before any layer's verify writes records of its own
            cache = poison(cache, config, SLOTS, ROWS, layer=layer)
        for layer in range(LAYERS):
            inputs = step_inputs(draw, config, 62 + LAYERS * step + layer)
            before = cache
            out, cache = implementation(params, before, inputs, config, layer=layer)
            assert_matches_model(out, cache, *numpy_model.verify(params, before, inputs, config,
                                                                 layer=layer),
                                 f"step {step} layer {layer}: ")
        kept.append(numpy_model.kept_records(np.asarray(cache.pending)[:, [1, 3]], config.rq))
        assert np.all(kept[-1] == kept[-1][:1]), "the layers keep alike"
        accepted_cache = accept(cache, arrays(ROWS), accepted, config)
        assert_same_cache(accepted_cache, numpy_model.accept(cache, ROWS, accepted, config))
        cache = accepted_cache
    assert np.any(np.stack(kept) > 0) and np.any(np.stack(kept) == 0), "kept and wrote"
    flushed = flush(params, cache, arrays(SLOTS), arrays(ROWS), config)
    model = numpy_model.flush(params, cache, SLOTS, ROWS, config)
    assert_scaled_close(flushed.state, model.state, MODEL_STATE_TOL, "flushed state")
    for field in ("conv", "pending"):
        assert_same_bits(getattr(flushed, field), getattr(model, field), field)


def test_prefill_resumes_after_kept_verifies(draw):
    """A prompt piece that resumes a request whose verifies kept 4 and 2 tokens (C = 3,
    T = 2, RQ = 6) folds them in and reads its history at the kept count, as the model
    does; pending becomes 0."""
    config = KdaConfig(heads=HEADS, tokens=2, checkpoint_every=3)
    params, cache = setup(draw, config, 80)
    cache = with_pending(cache, [[0, 0], [2, 2], [0, 0], [1, 1]])
    _, cache = fused_verify(params, cache, step_inputs(draw, config, 82), config, backend="jax")
    cache = accept(cache, arrays(ROWS), arrays([2, 1, 2]), config)
    np.testing.assert_array_equal(np.asarray(cache.pending)[[1, 3]], [[4, 4], [2, 2]])
    piece = step_inputs(draw, KdaConfig(heads=HEADS, tokens=3), 83)
    prompts = PrefillInputs(piece.x, piece.f_a, piece.beta, piece.gate, arrays([3, 1, 2]),
                            arrays(SLOTS), arrays(ROWS), jnp.ones((len(SLOTS),), bool))
    cache = poison(cache, config, SLOTS, ROWS)
    out, new = prefill(params, cache, prompts, config)
    model_out, model = numpy_model.prefill(params, cache, prompts, config)
    assert np.all(np.isfinite(model_out)), "the model read a poisoned value"
    assert_out_close(out, model_out, MODEL_OUT_RTOL)
    # a SiLU rounding of the piece that falls the other way moves the state by up to a
    # bf16 ulp (2^-8) of its scale (as in test_prefill_pieces.py)
    assert_scaled_close(new.state, model.state, 2**-8, "state")
    for field in ("conv", "pending"):
        assert_same_bits(getattr(new, field), getattr(model, field), field)
