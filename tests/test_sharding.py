"""Heads sharded over devices (docs/design.md, "Sharding"): the layout's specs, the
per-shard config, and a session of every entry point (prefill, verify, accept, verify,
accept, flush) on head-sharded arrays, under `jax.shard_map` and under plain `jax.jit`
(Shardy, explicit sharding, XLA's GSPMD), each bit for bit what every shard's heads give
unsharded, with no collective and no copy of the cache; the kernel's step and the
prefill with its chunk kernel under `jax.shard_map` exported for CUDA (one custom call
on each device's heads), and the step under jit carrying the library's sharding rule.

XLA fixes a process's CPU devices when JAX starts, and the rest of the suite runs on one:
in a process without DEVICES CPU devices, `test_with_four_cpu_devices` runs this module
in a child process on four (JAX_PLATFORMS=cpu,
XLA_FLAGS=--xla_force_host_platform_device_count=4), and the tests that need them skip
here. Their meshes span two of the four: jaxlib's batched LAPACK kernels (the XLA
verify's triangular solves) wait inside XLA:CPU's thread pool, which on a machine of fewer cores
has a thread per device, so programs waiting on every device at once can stall it.
"""
import dataclasses
import functools
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from compare import assert_same_bits
from hlo import aliased, whole_copies
from jax_kda import (KdaCache, KdaConfig, PrefillInputs, accept, flush, fused_verify,
                     head_specs, local_config, output_spec, prefill)
from jax_kda.sharding import leaf_specs

DEVICES = 4
HERE = jax.default_backend() == "cpu" and jax.device_count() >= DEVICES
CHILD = "JAX_KDA_SHARDING_CHILD"  # set for the child, which must not start another
on_devices = pytest.mark.skipif(not HERE, reason="runs in test_with_four_cpu_devices' child")

CONFIG = KdaConfig(heads=4, tokens=3)
SHARDS, AXIS = 2, "tp"
NUM_SLOTS, NUM_RECORDS, LAYERS, PROMPT = 5, 4, 3, 6
SLOTS, ROWS = [3, 1], [2, 0]
COLLECTIVE = re.compile(r"all-gather|all-reduce|all-to-all|collective-permute|"
                        r"reduce-scatter|collective-broadcast")


@pytest.mark.skipif(HERE, reason="this process has the devices")
def test_with_four_cpu_devices(request):
    """This module's device tests, in a child process with four CPU devices."""
    assert CHILD not in os.environ, f"the child has {jax.devices()}"
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={DEVICES}"
    marks = request.config.getoption("markexpr")
    child = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__]
        + (["-m", marks] if marks else []),
        env=dict(os.environ, XLA_FLAGS=flags.strip(), JAX_PLATFORMS="cpu", **{CHILD: "1"}),
        capture_output=True, text=True, timeout=600, cwd=os.path.dirname(__file__))
    assert child.returncode == 0, child.stdout[-8000:] + child.stderr[-4000:]
    print(child.stdout.strip().splitlines()[-1])


def test_head_specs_put_the_heads_on_the_axis(draw):
    """With H = 9 (no other size is 9), every head-indexed array's spec names the axis
    at its dim of size H, stacked or not; f_a, norm_weight, the indices and arrays
    outside the library's dataclasses are whole; out [B, N, H, K] takes output_spec."""
    config = KdaConfig(heads=9, tokens=2)
    for layers in (None, 7):
        trees = jax.eval_shape(lambda: arguments(draw, layers, config))[:-1] + (
            jax.ShapeDtypeStruct((), jnp.int32),)
        specs = head_specs(trees, AXIS)
        assert specs[-1] == P()
        for leaf, spec in zip(jax.tree.leaves(trees), jax.tree.leaves(specs)):
            assert (tuple(spec) + (None,) * leaf.ndim)[:leaf.ndim] == tuple(
                AXIS if size == 9 else None for size in leaf.shape), (leaf.shape, spec)
    assert output_spec(AXIS) == P(None, None, AXIS)


def test_local_config():
    config = KdaConfig(heads=32, tokens=4, eps=1e-3, checkpoint_every=2)
    assert local_config(config, 4) == dataclasses.replace(config, heads=8)
    assert local_config(config, 1) == config
    for shards in (3, 0, 64, True, 2.0):
        with pytest.raises(ValueError, match=rf"shards: expected an int >= 1 dividing "
                                             rf"config.heads=32, got {shards!r}"):
            local_config(config, shards)


def prompts_of(inputs, width):
    """A prefill of the two rows of `inputs` (drawn with tokens=width): `width` tokens
    resuming the first request, a new prompt of width - 2 for the second."""
    return PrefillInputs(inputs.x, inputs.f_a, inputs.beta, inputs.gate,
                         jnp.asarray([width, width - 2], jnp.int32), inputs.slots,
                         inputs.record_rows, jnp.asarray([True, False]))


def session(params, cache, prompts, inputs, accepted, layer, *, config):
    """Every entry point once on the same requests: prefill, verify, accept, verify
    (which replays the accepted tokens), accept, flush. Returns ([prefill's out, the
    verifies' outs], cache)."""
    stacked = {} if layer is None else {"layer": layer}
    out, cache = prefill(params, cache, prompts, config, **stacked)
    outs = [out]
    for _ in range(2):
        out, cache = fused_verify(params, cache, inputs, config, backend="jax", **stacked)
        outs.append(out)
        cache = accept(cache, inputs.record_rows, accepted, config)
    return outs, flush(params, cache, inputs.slots, inputs.record_rows, config)


def arguments(draw, layers, config=CONFIG):
    """(params, cache, prompts, inputs, accepted, layer) of a session; layer None for
    one layer, else a traced layer 1 of `layers`."""
    slots, rows = jnp.asarray(SLOTS, jnp.int32), jnp.asarray(ROWS, jnp.int32)
    wide = dataclasses.replace(config, tokens=PROMPT)
    return (draw.params(draw.key(3), config, layers=layers),
            draw.cache(draw.key(4), config, NUM_SLOTS, NUM_RECORDS, layers=layers),
            prompts_of(draw.inputs(draw.key(5), wide, slots, rows), PROMPT),
            draw.inputs(draw.key(6), config, slots, rows),
            jnp.asarray([2, 1], jnp.int32), None if layers is None else jnp.int32(1))


def specs_of(tree):
    """Head specs of a session's arguments or results (its bare [B, N, H, K] arrays are
    outputs)."""
    return leaf_specs(tree, AXIS, lambda a: output_spec(AXIS) if a.ndim == 4 else P())


def shard(tree, i, specs):
    """Shard i of SHARDS of every array of `tree` split by `specs`."""
    def take(a, spec):
        if AXIS not in spec:
            return a
        axis, size = spec.index(AXIS), a.shape[spec.index(AXIS)] // SHARDS
        return jax.lax.slice_in_dim(a, i * size, (i + 1) * size, axis=axis)
    return jax.tree.map(take, tree, specs)


def assert_same_as_each_shard(results, args, what, config=CONFIG):
    """The sharded session's results, bit for bit the unsharded session's on each
    shard's heads with the per-shard config."""
    reference = jax.jit(session, static_argnames="config")
    local = local_config(config, SHARDS)
    for i in range(SHARDS):
        expected = reference(*shard(args, i, specs_of(args)), config=local)
        actual = shard(jax.tree.map(np.asarray, results), i, specs_of(results))
        for (path, a), e in zip(jax.tree_util.tree_leaves_with_path(actual),
                                jax.tree.leaves(expected)):
            assert_same_bits(a, e, f"{what}, shard {i}: {jax.tree_util.keystr(path)}")


def mesh(axis_type=AxisType.Auto):
    return jax.make_mesh((SHARDS,), (AXIS,), axis_types=(axis_type,))


@on_devices
@pytest.mark.parametrize("layers", [None, LAYERS], ids=["one-layer", "stacked"])
def test_shard_map_equals_each_shard_unsharded(draw, layers):
    """The session under jax.shard_map with the per-shard config (layout from
    head_specs and output_spec): no collective, and each shard's heads as unsharded."""
    args = arguments(draw, layers)
    run = jax.shard_map(functools.partial(session, config=local_config(CONFIG, SHARDS)),
                        mesh=mesh(), in_specs=specs_of(args),
                        out_specs=specs_of(jax.eval_shape(
                            functools.partial(session, config=CONFIG), *args)))
    compiled = jax.jit(run).lower(*args).compile()
    assert not COLLECTIVE.search(compiled.as_text())
    assert_same_as_each_shard(compiled(*args), args, "shard_map")


# How the heads' split reaches plain jit: a mesh axis of AxisType.Auto (Shardy, the
# library's sharding rule), of AxisType.Explicit (in the types: a shard_map inside the
# library), and Auto with XLA's GSPMD propagation instead of Shardy.
MODES = {"shardy": (AxisType.Auto, True), "explicit": (AxisType.Explicit, True),
         "gspmd": (AxisType.Auto, False)}


@on_devices
@pytest.mark.parametrize("mode, layers, state_dtype", [
    ("shardy", None, jnp.float32), ("shardy", LAYERS, jnp.float32),
    ("explicit", LAYERS, jnp.float32), ("gspmd", None, jnp.float32),
    ("shardy", LAYERS, jnp.bfloat16)], ids=lambda v: getattr(v, "__name__", None))
def test_jit_of_sharded_arrays_equals_each_shard_unsharded(draw, mode, layers, state_dtype):
    """The session jitted on arrays whose heads are split over the mesh, the cache
    donated: the params whole on every device (sliced in place), the cache and inputs
    split. Each shard's heads as unsharded, the results split alike, and the compiled
    program has no collective, runs on each device's heads, aliases the donated cache
    and copies no cache buffer more than the unsharded program of one shard does; a
    bf16 state (KdaConfig.state_dtype) alike."""
    config = dataclasses.replace(CONFIG, state_dtype=state_dtype)
    axis_type, shardy = MODES[mode]
    if not shardy:
        if "jax_use_shardy_partitioner" not in jax.config.values:
            pytest.skip("this JAX partitions with Shardy only")
        jax.config.update("jax_use_shardy_partitioner", False)
    try:
        args = arguments(draw, layers, config)
        specs = (jax.tree.map(lambda _: P(), args[0]),) + specs_of(args[1:])
        split = mesh(axis_type)
        placed = jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(split, s)),
                              args, specs)
        step = jax.jit(functools.partial(session, config=config), donate_argnums=1)
        text = step.lower(*placed).compile().as_text()
        outs, cache = step(*placed)
    finally:
        if not shardy:
            jax.config.update("jax_use_shardy_partitioner", True)
    assert not COLLECTIVE.search(text), COLLECTIVE.search(text).group(0)
    results = (outs, cache)
    for result, spec in zip(jax.tree.leaves(results), jax.tree.leaves(specs_of(results))):
        assert result.sharding.is_equivalent_to(NamedSharding(split, spec), result.ndim)
    assert cache.state.dtype == state_dtype
    assert_same_as_each_shard((outs, cache), args, mode, config)

    local = shard(args, 0, specs_of(args))
    unsharded = jax.jit(functools.partial(session, config=local_config(config, SHARDS)),
                        donate_argnums=1).lower(*local).compile().as_text()
    present = [f.name for f in dataclasses.fields(KdaCache)
               if getattr(local[1], f.name) is not None]
    for index, name in enumerate(present):
        buffer = getattr(local[1], name)
        assert aliased(text, buffer, len(outs) + index), f"cache.{name} not aliased"
        assert whole_copies(text, buffer) == whole_copies(unsharded, buffer), name


def exported_for_cuda(step, *args):
    from jax import export

    target = "CuteDSLRT_NvJaxCutlassCall_v2"
    return export.export(step, platforms=["cuda"], disabled_checks=[
        export.DisabledSafetyCheck.custom_call(target)])(*args).mlir_module(), target


def kernel_arguments(draw, config):
    """Shapes of stacked params and cache and of one step's inputs."""
    return jax.eval_shape(lambda: (
        draw.params(draw.key(0), config, layers=LAYERS),
        draw.cache(draw.key(1), config, NUM_SLOTS, NUM_RECORDS, layers=LAYERS),
        draw.inputs(draw.key(2), config, jnp.asarray(SLOTS, jnp.int32),
                    jnp.asarray(ROWS, jnp.int32))))


def typed(tree, mesh_, specs):
    """`tree`'s shapes, each with its NamedSharding on `mesh_`."""
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(
        a.shape, a.dtype, sharding=NamedSharding(mesh_, s)), tree, specs)


@on_devices
@pytest.mark.kernels
def test_kernel_step_under_shard_map_exports_one_call_per_device(draw):
    """The kernel's decoder step (a verify per layer of a stacked cache, in a lax.scan
    with the cache in its carry, then one accept) under jax.shard_map over four
    devices, exported for CUDA: one custom call on each device's H / 4 heads, the cache
    aliased in place, no collective."""
    pytest.importorskip("cutlass", reason="needs nvidia-cutlass-dsl")
    from jax import export

    config = KdaConfig(heads=8, tokens=4, split=2)
    local = local_config(config, DEVICES)
    four = jax.make_mesh((DEVICES,), (AXIS,))

    def step(params, cache, inputs):
        def layer(cache, i):
            out, cache = fused_verify(params, cache, inputs, local, backend="cutedsl",
                                      layer=i)
            return cache, out

        cache, outs = jax.lax.scan(layer, cache, jnp.arange(LAYERS, dtype=jnp.int32))
        return outs, accept(cache, inputs.record_rows, jnp.ones_like(inputs.slots), local)

    args = kernel_arguments(draw, config)
    specs = head_specs(args, AXIS)
    run = jax.shard_map(step, mesh=four, in_specs=specs,
                        out_specs=(P(None, *output_spec(AXIS)), specs[1]))
    target = "CuteDSLRT_NvJaxCutlassCall_v2"
    text = export.export(jax.jit(run, donate_argnums=1), platforms=["cuda"], disabled_checks=[
        export.DisabledSafetyCheck.custom_call(target)])(
            *typed(args, four, specs)).mlir_module()
    assert text.count(f"stablehlo.custom_call @{target}") == 1
    assert not re.search(r"all_gather|all_reduce|all_to_all|collective_permute", text)
    call = re.search(rf"custom_call @{target}\(.*", text).group(0)
    H = config.heads // DEVICES
    assert f"tensor<{LAYERS}x{NUM_SLOTS}x{H}x128x128xf32>" in call, "not the local heads"
    main = re.search(r"func\.func public @main\((.*?)\) ->", text, re.S).group(1)
    assert main.count("tf.aliasing_output") == len(jax.tree.leaves(args[1]))  # the cache's


@on_devices
@pytest.mark.kernels
def test_kernel_prefill_under_shard_map_exports_one_call_per_device(draw):
    """The prefill with its kernels, of one layer of a stacked cache, under
    jax.shard_map over four devices, exported for CUDA: one call of each (the
    convolution, the chunks' operands, the scan over them) on each device's H / 4 heads,
    no collective."""
    pytest.importorskip("cutlass", reason="needs nvidia-cutlass-dsl")
    config = KdaConfig(heads=8, tokens=4)
    local = local_config(config, DEVICES)
    four = jax.make_mesh((DEVICES,), (AXIS,))
    params, cache, _ = kernel_arguments(draw, config)
    wide = dataclasses.replace(config, tokens=PROMPT)
    prompts = jax.eval_shape(lambda: prompts_of(draw.inputs(
        draw.key(2), wide, jnp.asarray(SLOTS, jnp.int32), jnp.asarray(ROWS, jnp.int32)),
        PROMPT))
    args = (params, cache, prompts)
    specs = head_specs(args, AXIS)
    step = jax.shard_map(
        lambda p, c, i: prefill(p, c, i, local, backend="cutedsl", layer=1), mesh=four,
        in_specs=specs, out_specs=(output_spec(AXIS), specs[1]))
    text, target = exported_for_cuda(jax.jit(step, donate_argnums=1),
                                     *typed(args, four, specs))
    calls = re.findall(rf"custom_call @{target}\(.*", text)
    assert len(calls) == 3, calls
    assert not re.search(r"all_gather|all_reduce|all_to_all|collective_permute", text)
    local_heads = config.heads // DEVICES
    assert f"-> tensor<2x{PROMPT}x3x{local_heads}x128xbf16>" in calls[0], "not the local heads"
    for call in calls[1:]:
        assert f"tensor<2x{local_heads}x1x64x128xf32>" in call, "not the local heads"


@on_devices
@pytest.mark.kernels
def test_kernel_step_under_jit_carries_the_rule(draw):
    """Under plain jit on head-sharded arrays the kernel's verify lowers (for CUDA) to
    the library's partitioned op, with its sharding rule, which XLA's partitioner turns
    into the kernel's call on each device's heads: no kernel call outside it."""
    pytest.importorskip("cutlass", reason="needs nvidia-cutlass-dsl")
    config = KdaConfig(heads=8, tokens=4, split=2)
    args = kernel_arguments(draw, config)
    step = jax.jit(lambda p, c, i: fused_verify(p, c, i, config, backend="cutedsl", layer=1),
                   donate_argnums=1)
    text = step.trace(*typed(args, mesh(), head_specs(args, AXIS))).lower(
        lowering_platforms=("cuda",)).as_text()
    assert text.count("CustomSPMDPartitioning") == 1
    assert "sdy.sharding_rule" in text and "CuteDSLRT" not in text
