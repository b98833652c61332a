"""backend="auto" decided per platform when the program is lowered (marker `kernels`:
the kernels compile for sm_90a on this CPU host): a verify (of a chain or a tree) or a
prefill exported from here for CUDA carries the kernels' custom calls, as
backend="cutedsl" does; lowered for the CPU it neither lowers nor compiles a kernel and
runs backend="jax"'s program; one artifact exported for ["cuda", "cpu"] carries both,
its CPU path bitwise backend="jax"'s. Traced, "auto" holds its XLA branch as one deferred
equation, traced only where a lowering keeps it. Where the kernels cannot take the
configuration, "auto" is the XLA path alone."""
import dataclasses
import functools
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("cutlass", reason="needs nvidia-cutlass-dsl")

from jax import export  # noqa: E402

from compare import assert_same_bits  # noqa: E402
from jax_kda import KdaConfig, PrefillInputs, fused_verify, prefill  # noqa: E402
from jax_kda.backends import cutedsl_supported, kernel_available  # noqa: E402
from jax_kda.deferred import deferred  # noqa: E402
from jax_kda.ffi import lowering  # noqa: E402
from jax_kda.testing import random_parents  # noqa: E402

pytestmark = pytest.mark.kernels

TARGET = "CuteDSLRT_NvJaxCutlassCall_v2"
NUM_SLOTS, NUM_RECORDS = 5, 4
KERNELS = {"verify": 1, "tree verify": 1,
           "prefill": 3}  # prefill: convolution, chunk operands, scan (chunks of 64)


def verify_step(draw, config=KdaConfig(heads=2, tokens=4, split=2)):
    """fused_verify of `config` (backend= open) and its arguments: three requests."""
    args = (draw.params(draw.key(51), config),
            draw.cache(draw.key(52), config, NUM_SLOTS, NUM_RECORDS),
            draw.inputs(draw.key(53), config, jnp.asarray([1, 4, 2], jnp.int32),
                        jnp.asarray([0, 3, 1], jnp.int32)))
    return functools.partial(fused_verify, config=config), args


def tree_step(draw, config=KdaConfig(heads=2, tokens=4, split=2, trees=True)):
    """`verify_step` of a token tree: random parents per request."""
    step, (params, cache, inputs) = verify_step(draw, config)
    parents = random_parents(np.random.default_rng(57), 3, config.tokens)
    return step, (params, cache, dataclasses.replace(inputs, parents=parents))


def prefill_step(draw, config=KdaConfig(heads=2, tokens=4)):
    """prefill of `config` (backend= open) and its arguments: a new prompt of 70 tokens
    (two chunks of 64) and a resumed piece of 33."""
    B, P, H = 2, 70, config.heads
    k = jax.random.split(draw.key(54), 4)
    bf16 = lambda i, shape: jax.random.normal(k[i], (B, P) + shape).astype(jnp.bfloat16)
    inputs = PrefillInputs(x=bf16(0, (3, H, 128)), f_a=bf16(1, (128,)), beta=bf16(2, (H,)),
                           gate=bf16(3, (H, 128)), lengths=jnp.asarray([P, 33], jnp.int32),
                           slots=jnp.asarray([1, 3], jnp.int32),
                           record_rows=jnp.asarray([0, 2], jnp.int32),
                           resume=jnp.asarray([False, True]))
    args = (draw.params(draw.key(55), config),
            draw.cache(draw.key(56), config, NUM_SLOTS, NUM_RECORDS), inputs)
    return functools.partial(prefill, config=config), args


STEPS = {"verify": verify_step, "tree verify": tree_step, "prefill": prefill_step}


def exported(step, platforms, args):
    return export.export(jax.jit(step), platforms=platforms, disabled_checks=[
        export.DisabledSafetyCheck.custom_call(TARGET)])(
            *jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), args))


def kernel_calls(artifact) -> int:
    return artifact.mlir_module().count(f"stablehlo.custom_call @{TARGET}")


def assert_same_results(actual, expected):
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for (path, e), a in zip(jax.tree_util.tree_flatten_with_path(expected)[0],
                            jax.tree.leaves(actual)):
        assert_same_bits(a, e, jax.tree_util.keystr(path))


def refuse_kernels(monkeypatch):
    """From here on every kernel's lowering, and so its compile, fails the test."""
    def refuse(*args, **kwargs):
        raise AssertionError("a kernel was lowered")

    monkeypatch.setattr(lowering, "launch", refuse)


@pytest.mark.parametrize("name", list(STEPS))
def test_auto_lowers_the_kernels_for_cuda_only(name, draw, monkeypatch):
    """Exported for CUDA from this CPU host, backend="auto" carries the kernels' custom
    calls, as many as backend="cutedsl"; exported or jitted for the CPU, none is lowered
    (nor compiled), and the CPU's results are backend="jax"'s, bitwise."""
    step, args = STEPS[name](draw)
    cuda = kernel_calls(exported(functools.partial(step, backend="auto"), ["cuda"], args))
    assert cuda == KERNELS[name]
    assert kernel_calls(exported(functools.partial(step, backend="cutedsl"), ["cuda"],
                                 args)) == cuda
    refuse_kernels(monkeypatch)
    assert kernel_calls(exported(functools.partial(step, backend="auto"), ["cpu"], args)) == 0
    auto = jax.jit(functools.partial(step, backend="auto"))(*args)
    assert_same_results(auto, jax.jit(functools.partial(step, backend="jax"))(*args))


@pytest.mark.parametrize("name", list(STEPS))
def test_one_artifact_for_cuda_and_cpu(name, draw):
    """Exported for ["cuda", "cpu"], serialized and deserialized, one artifact carries the
    kernels for CUDA and, called on the CPU, gives backend="jax"'s results, bitwise."""
    step, args = STEPS[name](draw)
    artifact = export.deserialize(
        exported(functools.partial(step, backend="auto"), ["cuda", "cpu"], args).serialize())
    assert artifact.platforms == ("cuda", "cpu")
    assert kernel_calls(artifact) == KERNELS[name]
    assert_same_results(artifact.call(*args),
                        jax.jit(functools.partial(step, backend="jax"))(*args))


def equations(jaxpr) -> list:
    """The primitives' names of `jaxpr`'s equations and of those inside them."""
    names = []
    for eqn in jaxpr.eqns:
        names.append(eqn.primitive.name)
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            names += equations(sub)
    return names


@pytest.mark.parametrize("name", list(STEPS))
def test_auto_traces_the_xla_branch_only_where_lowered(name, draw):
    """Traced, backend="auto" holds the kernels' branch and its XLA branch as one
    deferred equation: no more equations than backend="cutedsl" but the platform's
    choice, where the XLA path alone traces hundreds."""
    step, args = STEPS[name](draw)
    traced = {backend: equations(jax.make_jaxpr(functools.partial(step, backend=backend))(
        *args).jaxpr) for backend in ("auto", "cutedsl", "jax")}
    assert traced["auto"].count("kda_deferred") == 1
    assert len(traced["auto"]) <= len(traced["cutedsl"]) + 3  # platform_index, cond, deferred
    assert len(traced["jax"]) > 2 * len(traced["cutedsl"])


def test_deferred_traces_its_function_when_lowered_or_run():
    """`deferred(fun, like, *args)` is fun(*args) typed as `like`: tracing it calls no
    fun, lowering (or running it eagerly) calls fun once, results as fun's; results of
    another structure, shape or dtype than `like`'s raise a TypeError."""
    calls = []

    def fun(pair, scale):
        calls.append(1)
        return {"sum": pair[0] + pair[1] * scale}

    args = ((jnp.arange(3.0), jnp.ones(3)), jnp.float32(2.0))
    like = {"sum": jnp.zeros(3)}
    step = jax.jit(lambda *a: deferred(fun, like, *a))
    traced = step.trace(*args)
    assert not calls
    lowered = traced.lower()
    assert len(calls) == 1
    assert_same_results(lowered.compile()(*args), fun(*args))
    assert_same_results(deferred(fun, like, *args), fun(*args))
    for wrong in ([jnp.zeros(3)], {"sum": jnp.zeros(4)}, {"sum": jnp.zeros(3, jnp.int32)}):
        with pytest.raises(TypeError, match="expected"):
            jax.jit(lambda *a: deferred(fun, wrong, *a)).lower(*args)


@pytest.mark.parametrize("name,config", [
    ("verify", KdaConfig(heads=2, tokens=2, record_tokens=96, split=1)),
    ("verify", KdaConfig(heads=2, tokens=13, trees=True)),
    ("prefill", KdaConfig(heads=2, tokens=4, lower_bound=-50.0))],
    ids=["verify-records-past-shared-memory", "verify-tree-of-13", "prefill-chunks-of-8"])
def test_auto_is_xla_where_the_kernel_does_not_fit(name, config, draw, monkeypatch):
    """A configuration the kernel cannot take (the verify's CTA past the shared memory, a
    build that spills, the prefill's chunks not a multiple of 16): "auto" exports the XLA
    path for CUDA."""
    step, args = STEPS[name](draw, config)
    refuse_kernels(monkeypatch)
    assert kernel_calls(exported(functools.partial(step, backend="auto"), ["cuda"], args)) == 0


@pytest.mark.parametrize("device,available,supported", [
    (SimpleNamespace(platform="cpu"), True, False),
    (SimpleNamespace(platform="tpu"), True, False),
    (SimpleNamespace(platform="gpu", compute_capability="8.6"), False, False),
    (SimpleNamespace(platform="gpu", compute_capability="9.0"), True, True)],
    ids=["cpu", "tpu", "ampere", "hopper"])
def test_kernel_available_on_every_host_but_an_older_gpu(device, available, supported):
    """With nvidia-cutlass-dsl installed, "auto" may carry the kernels for CUDA from any
    host but one whose default device is a CUDA GPU older than Hopper; they run only on
    a Hopper GPU."""
    assert kernel_available(device) == available
    assert cutedsl_supported(device) == supported


def test_export_needs_the_custom_call_check_disabled(draw):
    """Without DisabledSafetyCheck.custom_call(TARGET), jax.export refuses the kernel's
    call by its target's name (README, "Exporting a step")."""
    step, args = verify_step(draw)
    shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), args)
    with pytest.raises(ValueError, match=f"(?s)^Cannot serialize code with custom calls "
                                         f".*custom_call @{TARGET}"):
        export.export(jax.jit(functools.partial(step, backend="auto")), platforms=["cuda"])(
            *shapes)
