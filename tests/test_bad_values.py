"""Bad values (NaN, +-inf, 3e38) in one token of one request, on the JAX paths (the stock
scan and the XLA backend): they never reach the request's earlier tokens, their records
or window, another request, or the next step after accepting only the earlier tokens
(bad_values.py has the scenario; tests/test_gpu.py runs it on the kernel). Extreme but
valid configs: the prefill stays finite where decays underflow (lower_bound -100) and
where q is huge (scale 1e30), as the stock scan does."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import bad_values
import numpy_model
from compare import assert_out_close, assert_scaled_close
from conftest import DRAW
from jax_kda import KdaConfig, accept, init_cache, prefill
from jax_kda.ref import stock_prefill
from prompts import random_prompts

CONFIG = KdaConfig(heads=2, tokens=4)
NUM_SLOTS, NUM_RECORDS = 5, 4
# every field and value in the last draft; NaN also in the first draft
CASES = ([(field, value, CONFIG.tokens - 1) for field in bad_values.FIELDS
          for value in bad_values.VALUES] + [(field, "nan", 1) for field in bad_values.FIELDS])
PREFILLS = {"xla": functools.partial(prefill, backend="jax"),
            "stock": jax.jit(stock_prefill, static_argnames="config")}


@pytest.fixture(scope="module")
def step():
    """Weights, a running cache and a batch of three requests (request 0 first)."""
    draw = DRAW
    keys = jax.random.split(draw.key(5), 3)
    params = draw.params(keys[0], CONFIG)
    cache = draw.cache(keys[1], CONFIG, NUM_SLOTS, NUM_RECORDS)
    inputs = draw.inputs(keys[2], CONFIG, jnp.asarray([3, 1, 4], jnp.int32),
                         jnp.asarray([2, 0, 3], jnp.int32))
    return params, cache, inputs


@pytest.mark.parametrize("field, value, token", CASES,
                         ids=[f"{f}-{v}-token{t}" for f, v, t in CASES])
def test_a_bad_draft_reaches_nothing_before_it(implementation, step, field, value, token):
    params, cache, inputs = step
    bad_values.check_verify(
        lambda p, c, i: implementation(p, c, i, CONFIG),
        lambda c, rows, accepted: accept(c, rows, accepted, CONFIG),
        params, cache, inputs, CONFIG, field, token, value, copy=lambda c: c)


PROMPT_CASES = [(field, value, 37) for field in bad_values.FIELDS
                for value in ("nan", "huge")] + [(field, "inf", 5) for field in ("x.k", "f_a")]


@pytest.mark.parametrize("name", list(PREFILLS))
@pytest.mark.parametrize("field, value, token", PROMPT_CASES,
                         ids=[f"{f}-{v}-token{t}" for f, v, t in PROMPT_CASES])
def test_a_bad_prompt_token_reaches_nothing_before_it(name, field, value, token, draw):
    # token 37 of 70: the second chunk of 64 would not help; 37 sits mid-chunk, past
    # the first blocks of the pair products and of the triangular products
    config = KdaConfig(heads=2, tokens=4)
    params = draw.params(draw.key(6), config)
    cache = init_cache(config, NUM_SLOTS, NUM_RECORDS)
    inputs = random_prompts(np.random.default_rng(6), config, [70, 50], [2, 3], [0, 1], 70)
    run = functools.partial(PREFILLS[name], config=config)
    bad_values.check_prefill(lambda p, c, i: run(p, c, i), params, cache, inputs, field,
                             token, value)


@pytest.mark.parametrize("fields", [{"lower_bound": -100.0}, {"lower_bound": -88.0},
                                    {"scale": 1e30}], ids=["lb-100", "lb-88", "scale1e30"])
def test_prefill_at_extreme_configs(fields, draw):
    """Decays that underflow to 0 (exp(-100) is below FP32's normal range) and queries of
    1e30: the XLA prefill's outputs are the stock scan's (at scale 1e30 both are 0: the
    gated norm's mean square overflows FP32) and its state the float64 model's; no 0/0
    or inf * 0 inside."""
    config = KdaConfig(heads=2, tokens=4, **fields)
    params = draw.params(draw.key(7), config)
    cache = init_cache(config, NUM_SLOTS, NUM_RECORDS)
    inputs = random_prompts(np.random.default_rng(7), config, [70, 9], [2, 3], [0, 1], 70)
    out, after = PREFILLS["xla"](params, cache, inputs, config=config)
    stock_out, stock_after = PREFILLS["stock"](params, cache, inputs, config=config)
    _, model_cache = numpy_model.prefill(params, cache, inputs, config)
    assert np.all(np.isfinite(np.asarray(out, np.float32)))
    assert_out_close(out, stock_out, 4 * 2**-8)
    for state in (after.state, stock_after.state):
        assert_scaled_close(state, model_cache.state, 1e-5, "state")
