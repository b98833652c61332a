"""Fixtures shared by the test modules: the three JAX implementations of a verify, which
all take (params, cache, inputs, config) and return (out, cache), and the random data
helpers of jax_kda.testing compiled once per shape (eagerly, each of their many small
ops compiles on its own, which dominates the suite's time on a 2-core CPU)."""
import functools
from types import SimpleNamespace

import jax
import pytest

from jax_kda import fused_verify, testing
from jax_kda.reference import chunked_verify, stock_verify

IMPLEMENTATIONS = {
    "stock": jax.jit(stock_verify, static_argnames="config"),
    "chunked": chunked_verify,
    "fused_jax": functools.partial(fused_verify, backend="jax"),
}

DRAW = SimpleNamespace(
    params=jax.jit(testing.random_params,
                   static_argnames=("config", "conv_dtype", "conv_bias", "norm_dtype")),
    cache=jax.jit(testing.random_cache, static_argnums=(1, 2, 3)),
    inputs=jax.jit(testing.random_inputs, static_argnums=1),
)


@pytest.fixture(params=list(IMPLEMENTATIONS), ids=list(IMPLEMENTATIONS))
def implementation(request):
    """One implementation of a verify; a test using it runs once per implementation."""
    return IMPLEMENTATIONS[request.param]


@pytest.fixture
def implementations():
    """All three implementations by name, for tests that compare them."""
    return IMPLEMENTATIONS


@pytest.fixture
def draw():
    """random_params / random_cache / random_inputs of jax_kda.testing, jitted."""
    return DRAW
