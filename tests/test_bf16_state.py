"""A bf16 checkpoint (`KdaConfig(state_dtype=jnp.bfloat16)`, docs/spec.md "State dtype") on
the JAX paths, the stock scan and the XLA backend, against the float64 NumPy model:

- episodes of prefill, verify, accept (random counts), verify (which writes the replayed
  state back), flush and a resumed prefill, for chains, a tree and the lazy checkpoint;
  each step is compared with the model run from the implementation's own cache before
  it, so that a step is checked alone and FP32 differences do not accumulate;
- the state is rounded once per write: the model's variants that round it twice (also
  where the replayed state is used) or never (a float64 state) fail the agreement that
  the contract's model passes, at every step where they differ from it;
- the model's own rounding is round-to-nearest-even; the FP32 default is unchanged; the
  cache, stacked layers and the backend plan follow the config.
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import numpy_model
from compare import (MODEL_CORRECTIONS_TOL, MODEL_OUT_RTOL, MODEL_STATE_TOL,
                     assert_same_bits, assert_same_cache, bf16_ulp, bf16_ulps, buffer_scale,
                     difference, differing_bits, out_error, scaled_error)
from conftest import DRAW
from jax_kda import (KdaConfig, PrefillInputs, accept, cache_shapes, flush, fused_verify,
                     init_cache, prefill)
from jax_kda.backends import ALL_XLA, VerifyPlan, prefill_plan, verify_plan
from jax_kda.ref import stock_prefill, stock_verify
from jax_kda.testing import random_accepted, random_parents
from poison import poison
from prompts import random_prompts

BF16 = jnp.bfloat16
HEADS, NUM_SLOTS, NUM_RECORDS = 2, 6, 5
SLOTS, ROWS = [4, 0, 2, 5, 1], [3, 1, 0, -1, 4]  # a padding row, a request without records
CONFIGS = {
    "chain": KdaConfig(heads=HEADS, tokens=4, state_dtype=BF16),
    "tree": KdaConfig(heads=HEADS, tokens=5, trees=True, gate_mode=1, state_dtype=BF16),
    "lazy": KdaConfig(heads=HEADS, tokens=3, checkpoint_every=2, state_dtype=BF16),
}
PATHS = {  # (verify, prefill) of each implementation
    "stock": (jax.jit(stock_verify, static_argnames="config"),
              jax.jit(stock_prefill, static_argnames="config")),
    "xla": (functools.partial(fused_verify, backend="jax"),
            functools.partial(prefill, backend="jax")),
}

# Worst value allowed per quantity, vs the model that rounds at the same points.
# "state": how far a state entry lies beyond one bf16 ulp of the model's, over the
# buffer's max |e|. Both round once, each within half an ulp of its unrounded value, and
# the FP32 value lies within FP32 error of the float64 one: for a state written by a
# replay (verify, flush), whose inputs are the same bf16 records on both sides, ~1e-7
# of the scale (as for FP32 states, compare.py; an entry that cancels to ~1e-8 of it
# may so land two of its own ulps away); "prompt_state", a prefill's: a SiLU output that
# rounds the other way in FP32 moves it by up to a bf16 ulp of the scale (as for FP32
# states, test_lazy_checkpoint.py). "state_differ", "prompt_state_differ": the fraction
# of the batch's state entries that differ at all: only where a rounding midpoint lies
# between the FP32 and the float64 value (measured <= 7e-5 of a replay's entries, and
# <= 6e-4 of a prefill's, whose SiLU roundings can fall apart too), where a state that
# is not rounded differs in every entry, one rounded twice in 3-8% of a resumed
# prompt's, and truncation in about half. "out_differ": the fraction of outputs that
# differ at all: an o_t or SiLU value within FP32 error of a bf16 midpoint (measured
# <= 5.5e-3, a resumed piece's), where a verify or prompt that continues from the
# rounded replay moves 8-20% of them. "out" and "corrections" as against FP32 states
# (compare.py); recorded keys within a bf16 ulp, the rest exact.
TOLERANCES = {"state": MODEL_STATE_TOL, "state_differ": 1e-3, "prompt_state": 2**-8,
              "prompt_state_differ": 1e-2, "out_differ": 2e-2, "out": MODEL_OUT_RTOL,
              "corrections": MODEL_CORRECTIONS_TOL, "keys": 1, "window": 0, "pending": 0,
              "nodes": 0}


def f64(a):
    return np.asarray(a, np.float64)


def agreement(kind, out, new, model_out, model, slots):
    """The measures of TOLERANCES for one step of `kind` ("verify", "flush", "prefill")
    against the model's results from the same cache (never NaN: a NaN on one side only
    counts as inf or as a difference)."""
    live = np.unique(slots[slots > 0])
    actual, expected = f64(new.state)[live], f64(model.state)[live]
    gap = difference(actual, expected)
    state = "prompt_state" if kind == "prefill" else "state"
    found = {state: float(np.maximum(gap - bf16_ulp(expected), 0.0).max(initial=0.0)
                          / buffer_scale(expected)),
             f"{state}_differ": float(np.mean(gap > 0)),
             "window": differing_bits(new.conv, model.conv),
             "pending": differing_bits(new.pending, model.pending),
             "corrections": scaled_error(new.corrections, model.corrections),
             "keys": float(bf16_ulps(new.key_gates, model.key_gates).max())}
    if model.nodes is not None:
        found["nodes"] = differing_bits(new.nodes, model.nodes)
    if kind != "flush":
        assert np.all(np.isfinite(model_out)), "the model read a poisoned value"
        found["out"] = out_error(out, model_out)
        found["out_differ"] = float(np.mean(difference(out, model_out) > 0))
    return found


def beyond(found):
    """The measures over their TOLERANCES."""
    return {name: value for name, value in found.items() if not value <= TOLERANCES[name]}


def a_path(rng, parents):
    """[T]: node 0 down to a random node of `parents` ([T], as the contract reads them),
    padded with 0."""
    node = int(rng.integers(0, len(parents)))
    path = [node]
    while parents[node] >= 0:
        node = int(parents[node])
        path.append(node)
    return path[::-1] + [0] * (len(parents) - len(path))


def steps_of(kind):
    """The episode of a config, in order: (step, its prompts' width or None)."""
    if kind == "chain":
        return [("prefill", 8), ("verify", None), ("accept", None), ("verify", None),
                ("accept", None), ("flush", None), ("verify", None), ("accept", None),
                ("resume", 4), ("verify", None), ("accept", None), ("verify", None)]
    if kind == "tree":
        return [("verify", None), ("accept", None), ("verify", None), ("accept", None),
                ("resume", 3), ("verify", None), ("accept", None), ("flush", None)]
    return [("verify", None), ("accept", None), ("verify", None), ("accept", None),
            ("verify", None), ("accept", None), ("verify", None), ("accept", None),
            ("flush", None)]


def apart(one, other):
    """Whether two of the model's (out, cache) differ in value anywhere (state, out or
    records)."""
    pairs = [(one[1].state, other[1].state), (one[1].corrections, other[1].corrections)]
    if one[0] is not None:
        pairs.append((one[0], other[0]))
    return any(np.any(difference(a, b) > 0) for a, b in pairs)


@functools.cache
def episode(name, kind):
    """Runs `kind`'s episode on implementation `name`; returns, per step that writes
    (verify, flush, prefill), (step, {rounding: agreement with the model of that
    rounding, from the same cache}, {rounding: whether that model's results differ from
    the contract's}), the model's accepts checked on the way."""
    config = CONFIGS[kind]
    verify, prompt = PATHS[name]
    seed = 7 + list(CONFIGS).index(kind)
    rng = np.random.default_rng(seed)
    keys = jax.random.split(DRAW.key(seed), 16)
    params = DRAW.params(keys[0], config)
    cache = DRAW.cache(keys[1], config, NUM_SLOTS, NUM_RECORDS)
    slots, rows = jnp.asarray(SLOTS, jnp.int32), jnp.asarray(ROWS, jnp.int32)
    accepting = jnp.where(slots > 0, rows, -1)  # the runner skips padding rows
    parents = path = None
    results = []
    for index, (step, width) in enumerate(steps_of(kind)):
        if step == "accept":
            accepted = random_accepted(rng, SLOTS, config.tokens)
            if config.trees:
                read = [numpy_model.tree_parents(p, config.tokens) for p in np.asarray(parents)]
                path = jnp.asarray([a_path(rng, p) for p in read], jnp.int32)
            expected = numpy_model.accept(cache, accepting, accepted, config, path=path)
            cache = accept(cache, accepting, accepted, config, path=path)
            assert_same_cache(cache, expected, f"{kind} step {index} accept",
                              fields=("pending",) + (("nodes",) if config.trees else ()))
            continue
        key, before = keys[2 + index], poison(cache, config, slots, rows)
        if step == "verify":
            inputs = DRAW.inputs(key, config, slots, rows)
            if config.trees:
                parents = random_parents(rng, len(SLOTS), config.tokens)
                inputs = dataclasses.replace(inputs, parents=parents)
            out, cache = verify(params, before, inputs, config)
            run = functools.partial(numpy_model.verify, params, before, inputs, config)
        elif step == "flush":
            out, cache = None, flush(params, before, slots, rows, config)
            run = lambda rounding: (None, numpy_model.flush(params, before, slots, rows,
                                                            config, rounding=rounding))
        else:  # a new prompt (prefill) or a later piece of one (resume) per request
            lengths = rng.integers(1, width + 1, len(SLOTS))
            inputs = random_prompts(rng, config, lengths, slots, rows, width)
            if step == "resume":
                inputs = dataclasses.replace(inputs, resume=jnp.ones(len(SLOTS), bool))
            out, cache = prompt(params, before, inputs, config)
            run = functools.partial(numpy_model.prefill, params, before, inputs, config)
        assert cache.state.dtype == BF16
        models = {rounding: run(rounding=rounding) for rounding in numpy_model.ROUNDINGS}
        results.append((f"{index}-{step}", {
            rounding: agreement({"resume": "prefill"}.get(step, step), out, cache, *model,
                                np.asarray(SLOTS)) for rounding, model in models.items()},
            {rounding: apart(model, models["once"]) for rounding, model in models.items()}))
    return results


CASES = [pytest.param(name, kind, id=f"{name}-{kind}") for name in PATHS for kind in CONFIGS]


@pytest.mark.parametrize("name, kind", CASES)
def test_episode_matches_the_model_rounding_once(name, kind):
    too_big = {step: beyond(found["once"]) for step, found, _ in episode(name, kind)}
    assert not any(too_big.values()), f"over TOLERANCES: {too_big}"


# the steps where a variant's results must differ from the contract's: twice where a
# step continues from a replayed state (every verify that replays, the resumed prefill;
# a flush writes the replayed state only, so rounding it again changes nothing), never
# wherever a state is written (every step here but a verify that only keeps)
DIFFERS = {"twice": ("verify", "resume"), "never": ("verify", "flush", "prefill", "resume")}


@pytest.mark.parametrize("name, kind", CASES)
def test_rounding_twice_or_never_is_caught(name, kind):
    """The agreement that the implementation passes against the model of the contract
    fails against the models that round the state twice or never, at every step where
    their results differ from the contract's, and they do at steps of each kind that
    DIFFERS names."""
    results = episode(name, kind)
    for rounding, kinds in DIFFERS.items():
        differing = [step for step, _, apart_ in results if apart_[rounding]]
        passed = [step for step, found, _ in results
                  if step in differing and not beyond(found[rounding])]
        assert not passed, f"rounding {rounding!r} agrees at {passed}"
        present = {step.split("-")[1] for step, _, _ in results} & set(kinds)
        assert {step.split("-")[1] for step in differing} >= present, (rounding, differing)


def test_model_rounding_is_round_to_nearest_even():
    """numpy_model.round_bf16_bits gives ml_dtypes' bf16 cast (round to nearest even) on
    every float32 value it is tried on: random bit patterns (subnormals and inf among
    them), every exact tie, the largest values; NaN stays NaN; and from float64 it
    rounds once, where a float32 step first would round a value just past a tie onto
    it."""
    rng = np.random.default_rng(3)
    patterns = rng.integers(0, 2**32, 2**20, dtype=np.uint64).astype(np.uint32)
    ties = (np.arange(2**16, dtype=np.uint32) << 16) | 0x8000  # every bf16 midpoint
    edges = np.float32([0.0, -0.0, np.inf, -np.inf, 3.3895314e38, 3.4028235e38, 1e-45,
                        -1.1754944e-38, 9.2e-41])
    x = np.concatenate([patterns.view(np.float32), ties.view(np.float32), edges])
    x = x[~np.isnan(x)]  # NaN payloads are the cast's own
    expected = x.astype(ml_dtypes.bfloat16).astype(np.float64)
    assert_same_bits(numpy_model.round_bf16_bits(x.astype(np.float64)), expected,
                     "round_bf16_bits")
    assert np.isnan(numpy_model.round_bf16_bits(np.float64(np.nan)))
    past_a_tie = 1.0 + 2.0**-8 + 2.0**-40  # float32 rounds it to the tie 1 + 2^-8
    assert numpy_model.round_bf16_bits(past_a_tie) == 1.0 + 2.0**-7
    assert float(np.float32(past_a_tie).astype(ml_dtypes.bfloat16)) == 1.0


def test_the_default_state_is_float32_unchanged(draw):
    """A config built without state_dtype is the float32 one, however spelled (one jit
    cache entry, so the very same programs), its cache is float32 as before, and no
    program of it holds a bf16 state; the bf16 config's do."""
    plain = KdaConfig(heads=HEADS, tokens=4)
    for spelling in (jnp.float32, np.float32, "float32", np.dtype("float32")):
        spelled = KdaConfig(heads=HEADS, tokens=4, state_dtype=spelling)
        assert spelled == plain and hash(spelled) == hash(plain)
    bf16 = dataclasses.replace(plain, state_dtype="bfloat16")
    assert bf16 == CONFIGS["chain"] and hash(bf16) == hash(CONFIGS["chain"])
    assert init_cache(plain, NUM_SLOTS, NUM_RECORDS).state.dtype == jnp.float32
    state_bf16 = f"tensor<{NUM_SLOTS}x{HEADS}x128x128xbf16>"  # the cache's state
    for config, holds in ((plain, False), (bf16, True)):
        params = draw.params(draw.key(1), config)
        cache = draw.cache(draw.key(2), config, NUM_SLOTS, NUM_RECORDS)
        inputs = draw.inputs(draw.key(3), config, jnp.asarray([1, 2], jnp.int32),
                             jnp.asarray([0, 1], jnp.int32))
        prompts = PrefillInputs(inputs.x, inputs.f_a, inputs.beta, inputs.gate,
                                jnp.asarray([4, 2], jnp.int32), inputs.slots,
                                inputs.record_rows, jnp.asarray([True, False]))
        texts = [jax.jit(PATHS["xla"][0], static_argnames="config").lower(
                     params, cache, inputs, config).as_text(),
                 jax.jit(PATHS["xla"][1], static_argnames="config").lower(
                     params, cache, prompts, config).as_text(),
                 jax.jit(flush, static_argnames="config").lower(
                     params, cache, inputs.slots, inputs.record_rows, config).as_text()]
        assert [state_bf16 in text for text in texts] == [holds] * 3, config


@pytest.mark.parametrize("layers", [None, 3], ids=["one-layer", "stacked"])
def test_cache_follows_the_config(layers):
    """The state in the config's dtype; records, window, pending as with FP32."""
    shapes = {dtype: cache_shapes(KdaConfig(heads=HEADS, tokens=4, state_dtype=dtype),
                                  NUM_SLOTS, NUM_RECORDS, layers)
              for dtype in (jnp.float32, BF16)}
    lead = () if layers is None else (layers,)
    assert shapes[BF16].state == jax.ShapeDtypeStruct(lead + (NUM_SLOTS, HEADS, 128, 128),
                                                      BF16)
    assert shapes[jnp.float32].state.dtype == jnp.float32
    for field in ("conv", "corrections", "key_gates", "pending"):
        assert getattr(shapes[BF16], field) == getattr(shapes[jnp.float32], field), field
    cache = init_cache(CONFIGS["chain"], NUM_SLOTS, NUM_RECORDS, layers=layers)
    assert jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), cache) == shapes[BF16]


def test_stacked_layers_are_the_per_layer_calls(draw):
    """A verify of layer i of a stacked bf16 cache, and a flush of it whole, give bit
    for bit the per-layer calls on layer i's slices, the state staying bf16."""
    config, L = CONFIGS["chain"], 2
    params = draw.params(draw.key(4), config, layers=L)
    cache = draw.cache(draw.key(5), config, NUM_SLOTS, NUM_RECORDS, layers=L)
    slots, rows = jnp.asarray([3, 1], jnp.int32), jnp.asarray([2, 0], jnp.int32)
    inputs = draw.inputs(draw.key(6), config, slots, rows)
    layer_of = lambda tree, i: jax.tree.map(lambda a: a[i], tree)
    verify = PATHS["xla"][0]
    flushed = flush(params, cache, slots, rows, config)
    for i in range(L):
        out, new = verify(params, cache, inputs, config, layer=i)
        one_out, one = verify(layer_of(params, i), layer_of(cache, i), inputs, config)
        assert new.state.dtype == BF16
        assert_same_bits(out, one_out, f"out, layer {i}")
        assert_same_cache(layer_of(new, i), one, f"layer {i}")
        alone = flush(layer_of(params, i), layer_of(cache, i), slots, rows, config)
        assert_same_cache(layer_of(flushed, i), alone, f"flush, layer {i}")


def test_auto_plans_a_bf16_state_as_an_fp32_one():
    """backend "auto" plans a bf16 state's verify and prefill as an FP32 one's: the
    kernels on CUDA where they are installed, XLA elsewhere (the plan only: no GPU)."""
    bf16 = CONFIGS["chain"]
    fp32 = dataclasses.replace(bf16, state_dtype=jnp.float32)
    assert verify_plan(bf16, 4, "auto") == verify_plan(fp32, 4, "auto")
    assert prefill_plan(bf16, "auto") == prefill_plan(fp32, "auto")
    pytest.importorskip("cutlass", reason="the kernels' plans need nvidia-cutlass-dsl")
    assert verify_plan(bf16, 4, "auto").cuda is not None
    assert prefill_plan(bf16, "auto").cuda != ALL_XLA
