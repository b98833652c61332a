"""`jax_kda.enable_compile_cache` across processes (marker `kernels`: the CuTe DSL kernels
compile for sm_90a, no GPU needed): a second process compiles no kernel and no XLA
program that the first one compiled (the exported program embeds the same binary), a
kernel of another configuration compiles, and without the cache everything compiles;
`compile_kernels`' processes, waited for or compiling behind the lowerings that need
their kernels (a failed one reported there)."""
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


# In a fresh interpreter: `compile_kernels` on a prefill (the scan kernel alone, chunks of
# 16) and a two-layer scan of verifies with backend "auto" (the kernel in the CUDA branch
# of `platform_dependent` inside `lax.scan`), then both exported for CUDA. argv[1]: the
# cache directory ("" for none), argv[2]: processes ("" for None), argv[3]: "wait" or
# not. Prints the kernels compiled ahead (twice: the second call finds them, compiled or
# compiling), those still compiling after the first call and after the lowering, the
# processes started, the kernels this interpreter compiled itself, and the exported
# modules.
AHEAD = r"""
import functools, json, subprocess, sys
import cutlass.cute
import jax, jax.numpy as jnp
import jax_kda
from jax_kda import KdaConfig, PrefillInputs, VerifyInputs
from jax_kda.testing import random_params

compiles, children = [], []
compile, popen = cutlass.cute.compile, subprocess.Popen
cutlass.cute.compile = lambda *a, **k: compiles.append(1) or compile(*a, **k)
subprocess.Popen = lambda *a, **k: children.append(1) or popen(*a, **k)
if sys.argv[1]:
    jax_kda.enable_compile_cache(sys.argv[1])
B, P, H, L = 2, 40, 1, 2
shape = lambda dtype, *s: jax.ShapeDtypeStruct(s, dtype)
config = KdaConfig(heads=H, tokens=2, lower_bound=-30.0)
params = jax.eval_shape(lambda: random_params(jax.random.key(0), config))
cache = jax.eval_shape(lambda: jax_kda.init_cache(config, B + 1, B))
inputs = PrefillInputs(shape(jnp.bfloat16, B, P, 3, H, 128), shape(jnp.bfloat16, B, P, 128),
                       shape(jnp.bfloat16, B, P, H), shape(jnp.bfloat16, B, P, H, 128),
                       *[shape(jnp.int32, B)] * 3)
prefill = jax.jit(functools.partial(jax_kda.prefill, config=config, backend="cutedsl"))
stacked = jax.eval_shape(lambda: random_params(jax.random.key(0), config, layers=L))
layers = jax.eval_shape(lambda: jax_kda.init_cache(config, B + 1, B, layers=L))
verify_inputs = VerifyInputs(shape(jnp.bfloat16, B, 2, 3, H, 128), shape(jnp.bfloat16, B, 2, 128),
                             shape(jnp.bfloat16, B, 2, H), shape(jnp.bfloat16, B, 2, H, 128),
                             shape(jnp.int32, B), shape(jnp.int32, B))

def decode(params, cache, inputs):
    def layer(cache, i):
        out, cache = jax_kda.fused_verify(params, cache, inputs, config, layer=i)
        return cache, out
    return jax.lax.scan(layer, cache, jnp.arange(L, dtype=jnp.int32))

programs = (prefill.trace(params, cache, inputs),
            jax.jit(decode).trace(stacked, layers, verify_inputs))
processes = int(sys.argv[2]) if sys.argv[2] else None
compile_ahead = functools.partial(jax_kda.compile_kernels, *programs, processes=processes,
                                  wait=sys.argv[3] == "wait")
ahead = [compile_ahead()]
pending = len(jax_kda.compile_cache._pending)
ahead.append(compile_ahead())
started = len(children)
lowered = [program.lower(lowering_platforms=("cuda",)).as_text() for program in programs]
print(json.dumps(dict(ahead=ahead, pending=pending, left=len(jax_kda.compile_cache._pending),
                      started=started, kernels=len(compiles),
                      calls=sum(text.count("CuteDSLRT_NvJaxCutlassCall") for text in lowered))))
"""


def ahead(directory, processes, wait="wait"):
    result = subprocess.run([sys.executable, "-c", AHEAD, str(directory), str(processes),
                             wait],
                            capture_output=True, text=True, timeout=600,
                            env=dict(os.environ, JAX_PLATFORMS="cpu"),
                            cwd=tempfile.gettempdir())
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.splitlines()[-1])


@pytest.mark.parametrize("processes", ["", 1])
def test_kernels_compiled_ahead_in_processes_are_not_compiled_again(tmp_path, processes):
    first = ahead(tmp_path, processes)
    # the scan kernel and the verify's, one process each unless processes=1
    assert first["ahead"] == [2, 0] and first["started"] == (1 if processes == 1 else 2)
    assert first["pending"] == first["left"] == 0
    assert first["kernels"] == 0, "the lowering compiled a kernel compiled ahead"
    assert first["calls"] >= 2
    assert len(list((tmp_path / "kernels").iterdir())) == 2
    second = ahead(tmp_path, processes)
    assert second["ahead"] == [0, 0] and second["started"] == 0 and second["kernels"] == 0


def test_kernels_compiling_behind_are_waited_for_by_the_lowering(tmp_path):
    """wait=False: the call returns while both kernels compile; a second call starts
    neither again; the lowering waits for them and compiles none itself."""
    result = ahead(tmp_path, "", "behind")
    assert result["ahead"] == [2, 0] and result["started"] == 2
    assert result["pending"] == 2 and result["left"] == 0
    assert result["kernels"] == 0, "the lowering compiled a kernel compiling behind"
    assert result["calls"] >= 2 and len(list((tmp_path / "kernels").iterdir())) == 2


def test_kernels_compiled_ahead_without_the_cache():
    result = ahead("", "")
    assert result["ahead"] == [2, 0] and result["kernels"] == 0 and result["calls"] >= 2


@pytest.mark.parametrize("processes", [0, -1, 1.5])
def test_compile_kernels_refuses_a_bad_process_count(processes):
    import jax_kda
    with pytest.raises(ValueError, match="processes"):
        jax_kda.compile_kernels(processes=processes)


def verify_operands(config, B: int):
    """(params, cache, inputs) of a verify of B requests, as shapes."""
    import jax
    import jax.numpy as jnp

    import jax_kda
    from jax_kda import VerifyInputs
    from jax_kda.testing import random_params

    T, H = config.tokens, config.heads
    shape = lambda dtype, *s: jax.ShapeDtypeStruct(s, dtype)
    return (jax.eval_shape(lambda: random_params(jax.random.key(0), config)),
            jax.eval_shape(lambda: jax_kda.init_cache(config, B + 1, B)),
            VerifyInputs(shape(jnp.bfloat16, B, T, 3, H, 128), shape(jnp.bfloat16, B, T, 128),
                         shape(jnp.bfloat16, B, T, H), shape(jnp.bfloat16, B, T, H, 128),
                         shape(jnp.int32, B), shape(jnp.int32, B)))


def test_kernels_called_finds_each_kernel_inside_shard_map_and_none_in_xla():
    """`kernels_called` walks the jaxprs inside a program's equations (here shard_map's
    and jit's): the verify's kernel of the config it runs, once however often called;
    a program on the XLA backend launches none."""
    import functools

    import jax
    from jax.sharding import PartitionSpec as P

    import jax_kda
    from jax_kda import KdaConfig
    from jax_kda.ffi import lowering

    config = KdaConfig(heads=2, tokens=2)
    params, cache, inputs = verify_operands(config, 3)
    mesh = jax.make_mesh((1,), ("heads",))

    def program(backend):
        def twice(params, cache, inputs):
            verify = functools.partial(jax_kda.fused_verify, config=config, backend=backend)
            out, cache = verify(params, cache, inputs)
            return verify(params, cache, inputs)
        return jax.jit(jax.shard_map(twice, mesh=mesh, in_specs=P(), out_specs=P())).trace(
            params, cache, inputs)

    (kernel,) = lowering.kernels_called(program("cutedsl").jaxpr)
    assert type(kernel).__name__ == "FusedVerify" and kernel.heads == 2 and kernel.tokens == 2
    assert lowering.kernels_called(program("jax").jaxpr) == set()


def test_a_failed_compile_behind_raises_at_the_lowering_that_needs_it(monkeypatch):
    """wait=False: a process whose compile fails is reported by the lowering that needs
    its kernel (a RuntimeError with the process's error output), which then has nothing
    left pending."""
    import functools

    import jax

    import jax_kda
    from jax_kda import KdaConfig, compile_cache

    monkeypatch.setattr(compile_cache, "_built", {})  # nothing this process built
    monkeypatch.setattr(compile_cache, "_kernels", None)  # and no cache on disk
    monkeypatch.setattr(compile_cache, "_CHILD",
                        "import sys; sys.stderr.write('no compiler here'); sys.exit(3)")
    config = KdaConfig(heads=1, tokens=3)
    program = jax.jit(functools.partial(jax_kda.fused_verify, config=config,
                                        backend="cutedsl")).trace(*verify_operands(config, 2))
    assert jax_kda.compile_kernels(program, wait=False) == 1
    with pytest.raises(RuntimeError, match="(?s)exit 3.*no compiler here"):
        program.lower(lowering_platforms=("cuda",))
    assert not compile_cache._pending
