"""Fixtures shared by the test modules: the two JAX implementations of a verify, which
take (params, cache, inputs, config, layer=None) and return (out, cache), and the
random data helpers of jax_kda.testing compiled once per shape (eagerly, each of their
many small ops compiles on its own, which dominates the suite's time on a 2-core CPU),
drawn from "rbg" keys (`DRAW.key`): XLA:CPU compiles a threefry draw of a cache in
~14 s, an RngBitGenerator one in ~1 s.

The implementations share the step driver, the pointwise code and the cache's row
handling (jax_kda.steps, jax_kda.layer, jax_kda.cache_rows) and differ in the recurrence
only, so a comparison of one with the other proves little: every parity test holds each
of them against the independent float64 model of tests/numpy_model.py."""
import functools
from types import SimpleNamespace

import jax
import pytest

from jax_kda import fused_verify, testing
from jax_kda.ref import stock_verify

IMPLEMENTATIONS = {
    # the stock per-token recurrence (a lax.scan over tokens), jitted
    "stock": jax.jit(stock_verify, static_argnames="config"),
    # fused_verify's XLA backend: the chunked (WY) form, jitted inside
    "xla": functools.partial(fused_verify, backend="jax"),
}

DRAW = SimpleNamespace(
    key=lambda seed: jax.random.key(seed, impl="rbg"),
    params=jax.jit(testing.random_params,
                   static_argnames=("config", "conv_dtype", "conv_bias", "norm_dtype",
                                    "layers")),
    cache=jax.jit(testing.random_cache, static_argnums=(1, 2, 3),
                  static_argnames="layers"),
    inputs=jax.jit(testing.random_inputs, static_argnums=1),
)


@pytest.fixture(params=list(IMPLEMENTATIONS), ids=list(IMPLEMENTATIONS))
def implementation(request):
    """One implementation of a verify; a test using it runs once per implementation."""
    return IMPLEMENTATIONS[request.param]


@pytest.fixture
def implementations():
    """Both implementations by name, for tests that run each."""
    return IMPLEMENTATIONS


@pytest.fixture
def draw():
    """random_params / random_cache / random_inputs of jax_kda.testing, jitted, and
    key(seed), the PRNG key to draw them from."""
    return DRAW


@pytest.fixture(autouse=True, scope="module")
def programs_freed_after_each_module():
    """Each test module's compiled programs freed once it ends: XLA:CPU maps each loaded
    executable's code into memory, and the whole suite's programs in one process pass the
    kernel's limit on mappings (vm.max_map_count; a segfault in a later compile)."""
    yield
    jax.clear_caches()
