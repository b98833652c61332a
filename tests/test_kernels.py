"""The CuTe DSL kernel without a GPU (marker `kernels`): the custom call lowered for
CUDA with jax.export (CuTe DSL compiles the kernel for sm_90a during lowering) aliases
the cache buffers in place and gets a binary of its own per configuration and shape;
configurations compile without spills; the split heuristic;
the eager entry point's argument errors.
"""
import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("cutlass", reason="needs nvidia-cutlass-dsl")

from jax import export  # noqa: E402

from jax_kda import KdaConfig, fused_verify  # noqa: E402
from jax_kda.ffi import choose_split, eager_verify, kernel_split, solo_ctas  # noqa: E402
from jax_kda.testing import random_cache, random_inputs, random_params  # noqa: E402

pytestmark = pytest.mark.kernels

TARGET = "CuteDSLRT_NvJaxCutlassCall_v2"
CACHE_WRITES = ("state", "conv", "corrections", "key_gates")


def shapes(tree):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)


def example(config, conv_bias=True, batch=3):
    key = jax.random.key(0)
    params = random_params(key, config, conv_bias=conv_bias)
    cache = random_cache(jax.random.fold_in(key, 1), config, num_slots=5, num_records=4)
    inputs = random_inputs(jax.random.fold_in(key, 2), config, list(range(1, batch + 1)),
                           list(range(batch)))
    return params, cache, inputs


@pytest.mark.parametrize("conv_bias", [True, False], ids=["bias", "no-bias"])
def test_export_aliases_the_cache_in_place(conv_bias):
    """The exported module holds one CuTe DSL custom call whose outputs 1..4 alias the
    cache inputs, and the donated cache arguments alias the jitted function's outputs."""
    config = KdaConfig(heads=2, tokens=4, split=2)
    params, cache, inputs = example(config, conv_bias)
    step = jax.jit(functools.partial(fused_verify, config=config, backend="cutedsl"),
                   donate_argnums=1)
    exported = export.export(step, platforms=["cuda"], disabled_checks=[
        export.DisabledSafetyCheck.custom_call(TARGET)])(
            shapes(params), shapes(cache), shapes(inputs))
    text = exported.mlir_module()
    assert text.count(f"stablehlo.custom_call @{TARGET}") == 1
    aliases = re.findall(r"output_tuple_indices = \[(\d)\], operand_index = (\d+)", text)
    assert sorted(int(o) for o, _ in aliases) == [1, 2, 3, 4]
    main = re.search(r"func\.func public @main\((.*?)\) ->", text, re.S).group(1)
    for name in CACHE_WRITES:
        argument = re.search(rf"%arg\d+: [^%]*?loc\(\"cache\.{name}\"\)", main).group(0)
        assert "tf.aliasing_output" in argument, f"cache.{name} is not aliased"


def test_each_configuration_lowers_to_its_own_binary():
    """cutlass_call's compile key is the kernel object of one static configuration: two
    configurations that differ only in a compiled-in scalar (eps) or in the split get
    binaries of their own in one program, and the same configuration at another batch a
    binary of its own too (the compile is per operand shapes)."""
    base = KdaConfig(heads=2, tokens=4, split=2)
    configs = [base, dataclasses.replace(base, eps=1e-3), dataclasses.replace(base, split=1)]
    params, cache, inputs = example(base)
    _, _, small = example(base, batch=2)

    def program(params, cache, inputs, small):
        outs = []
        for config in configs:
            out, cache = fused_verify(params, cache, inputs, config, backend="cutedsl")
            outs.append(out)
        out, cache = fused_verify(params, cache, small, base, backend="cutedsl")
        return outs + [out], cache

    exported = export.export(jax.jit(program), platforms=["cuda"], disabled_checks=[
        export.DisabledSafetyCheck.custom_call(TARGET)])(
            shapes(params), shapes(cache), shapes(inputs), shapes(small))
    modules = re.findall(rf'custom_call @{TARGET}\(.*?module = "(.*?)"',
                         exported.mlir_module())
    assert len(modules) == 4 and len(set(modules)) == 4


def test_compiles_without_spills():
    """Two corners of the configuration space compile for sm_90a with no local memory
    (`python -m jax_kda.kernels` compiles them all)."""
    from jax_kda.kernels.__main__ import main

    assert main(["--arch", "sm_90a", "--heads", "2", "--only", "2,0,1", "--only", "8,1,8"]) == 0


def test_timeline_build_compiles():
    """The diagnostic build of tests/gpu_timeline.py (phase stamps into one more operand)
    compiles for sm_90a."""
    from jax_kda.kernels import compile_verify

    assert compile_verify(KdaConfig(heads=2, tokens=4), 2, True, "float32", "float32",
                          timeline=True) is not None


@pytest.mark.parametrize("items,sms,expected", [
    (2048, 132, 1), (96, 132, 1), (67, 132, 1), (66, 132, 2), (64, 132, 2), (33, 132, 2),
    (32, 132, 2), (17, 132, 2), (16, 132, 4), (4, 132, 8), (1, 132, 8), (64, 78, 1)])
def test_choose_split(items, sms, expected):
    """Split 2 while its grid fits the SMs one CTA each (B <= 2 at H = 32 on 132 SMs),
    more where a quarter of the SMs would otherwise be idle, else 1."""
    assert choose_split(items, sms) == expected


@pytest.mark.parametrize("heads,batch,split,expected", [
    (32, 4, 1, True), (32, 5, 1, False), (32, 2, 2, True), (32, 3, 2, False),
    (32, 1, 4, False), (2, 1, 8, False), (32, 64, 1, False), (1, 132, 1, True)])
def test_solo_ctas(heads, batch, split, expected):
    """An SM per CTA where the grid fits the 132 SMs at split 1 or 2, never at splits
    of 4 and more."""
    assert solo_ctas(KdaConfig(heads=heads, tokens=4), batch, split, sms=132) == expected


def test_solo_build_takes_an_sm():
    """The solo build asks for more than half an SM's shared memory (no second CTA
    fits), the default build for its own need only (two fit)."""
    from jax_kda.kernels import verify_kernel
    from jax_kda.kernels.fused import SOLO_SHARED

    kernel = verify_kernel(KdaConfig(heads=32, tokens=4), 1, True)
    assert 2 * (kernel.shared_bytes() + 1024) <= 228 * 1024 < 2 * (SOLO_SHARED + 1024)


def test_kernel_split_fits_the_shared_memory():
    """Long records outgrow one CTA's shared memory at split 1 (248 KiB for RQ = 64):
    split None moves up to the next split that fits, an explicit split 1 is refused
    with the need named; at RQ = T the heuristic's split stands."""
    long = KdaConfig(heads=2, tokens=2, record_tokens=64)
    assert choose_split(64 * 2, 132) == 1
    assert kernel_split(long, 64, sms=132) == 2
    with pytest.raises(ValueError, match=r"split=1 needs 248 KiB of shared memory"):
        kernel_split(dataclasses.replace(long, split=1), 64)
    assert kernel_split(KdaConfig(heads=32, tokens=8), 64, sms=132) == 1


def test_eager_rejects_a_wrong_shape_before_any_launch():
    config = KdaConfig(heads=2, tokens=4)
    params, cache, inputs = jax.tree.map(np.asarray, example(config))
    out = np.zeros((3, 4, 2, 128), jnp.bfloat16)
    bad = cache.__class__(cache.state[:, :1], cache.conv, cache.corrections,
                          cache.key_gates, cache.pending)
    with pytest.raises(ValueError, match=r"state: expected \[5, 2, 128, 128\] float32, "
                                         r"got \[5, 1, 128, 128\] float32"):
        eager_verify(params, bad, inputs, out, config)
    with pytest.raises(ValueError, match=r"out: expected \[3, 4, 2, 128\] bfloat16"):
        eager_verify(params, cache, inputs, out.astype(np.float32), config)
    with pytest.raises(TypeError, match="stream: expected None, an int handle"):
        eager_verify(params, cache, inputs, out, config, stream="default")
