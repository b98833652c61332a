"""`jax_kda.enable_compile_cache` across processes (marker `kernels`: the CuTe DSL kernels
compile for sm_90a, no GPU needed): a second process compiles no kernel and no XLA
program that the first one compiled (the exported program embeds the same binary), a
kernel of another configuration compiles, and without the cache everything compiles."""
import json
import os
import subprocess
import sys
import tempfile

import pytest

pytest.importorskip("cutlass", reason="needs nvidia-cutlass-dsl")

pytestmark = pytest.mark.kernels

# In a fresh interpreter: argv[1] the cache directory ("" for none), argv[2:] the
# lower_bounds of the prefills to export for CUDA (-30: chunks of 16, -15: of 32, each
# the scan kernel alone). Prints the kernels compiled (`cute.compile` calls), the
# programs JAX compiled looking into its cache, how many it found there (hits) and how
# many it wrote (misses; a tiny jitted `accept` among the programs: small and quick
# ones are cached too), and the exported modules.
PROCESS = r"""
import collections, functools, json, sys
import cutlass.cute
import jax, jax.numpy as jnp
from jax import export
import jax_kda
from jax_kda import KdaConfig, PrefillInputs
from jax_kda.testing import random_params

events = collections.Counter()
jax.monitoring.register_event_listener(lambda event, **_: events.update([event]))
compiles = []
compile = cutlass.cute.compile
cutlass.cute.compile = lambda *a, **k: compiles.append(1) or compile(*a, **k)
if sys.argv[1]:
    jax_kda.enable_compile_cache(sys.argv[1])
B, P, H = 2, 40, 1
shape = lambda dtype, *s: jax.ShapeDtypeStruct(s, dtype)
inputs = PrefillInputs(shape(jnp.bfloat16, B, P, 3, H, 128), shape(jnp.bfloat16, B, P, 128),
                       shape(jnp.bfloat16, B, P, H), shape(jnp.bfloat16, B, P, H, 128),
                       *[shape(jnp.int32, B)] * 3)
modules = []
for lower_bound in map(float, sys.argv[2:]):
    config = KdaConfig(heads=H, tokens=2, lower_bound=lower_bound)
    params = jax.eval_shape(lambda: random_params(jax.random.key(0), config))
    cache = jax.eval_shape(lambda: jax_kda.init_cache(config, B + 1, B))
    step = jax.jit(functools.partial(jax_kda.prefill, config=config, backend="cutedsl"))
    modules.append(export.export(step, platforms=["cuda"], disabled_checks=[
        export.DisabledSafetyCheck.custom_call("CuteDSLRT_NvJaxCutlassCall_v2")])(
            params, cache, inputs).mlir_module())
config = KdaConfig(heads=H, tokens=2)
accept = jax.jit(functools.partial(jax_kda.accept, config=config))
jax.block_until_ready(accept(jax_kda.init_cache(config, B + 1, B), jnp.arange(B, dtype=jnp.int32),
                             jnp.ones(B, jnp.int32)))
print(json.dumps(dict(kernels=len(compiles), modules=modules,
                      requests=events["/jax/compilation_cache/compile_requests_use_cache"],
                      hits=events["/jax/compilation_cache/cache_hits"],
                      misses=events["/jax/compilation_cache/cache_misses"])))
"""


def run(directory, *lower_bounds):
    # run outside the source tree: `python -c` imports from its working directory first,
    # and the source tree's jax_kda has no ffi (the install maps ffi/ to jax_kda.ffi)
    result = subprocess.run([sys.executable, "-c", PROCESS, str(directory), *lower_bounds],
                            capture_output=True, text=True, timeout=600,
                            env=dict(os.environ, JAX_PLATFORMS="cpu"),
                            cwd=tempfile.gettempdir())
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.splitlines()[-1])


def test_a_second_process_compiles_nothing_again(tmp_path):
    first = run(tmp_path, "-30")
    assert first["kernels"] == 1 and first["hits"] == 0
    assert first["misses"] == first["requests"] >= 1, "a program was compiled, not cached"
    assert len(list((tmp_path / "kernels").iterdir())) == 1
    assert any((tmp_path / "xla").iterdir())
    second = run(tmp_path, "-30", "-15")
    assert second["modules"][0] == first["modules"][0]  # the same binary, read back
    assert second["kernels"] == 1, "only the new configuration's kernel compiles"
    assert second["misses"] == 0 and second["hits"] == second["requests"] >= 1
    assert len(list((tmp_path / "kernels").iterdir())) == 2


def test_without_the_cache_everything_compiles(tmp_path):
    first, second = run("", "-30"), run("", "-30")
    assert first["kernels"] == second["kernels"] == 1
    assert first["hits"] == second["hits"] == second["misses"] == 0
