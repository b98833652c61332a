"""The CuTe DSL kernel without a GPU (marker `kernels`): the custom call lowered for
CUDA with jax.export (CuTe DSL compiles the kernel for sm_90a during lowering) aliases
the cache buffers in place, compiles once per kernel configuration whatever the batch,
cache and layer counts (symbolic B too), and raises a clear error where it cannot run;
the operand table is the kernel's and the docs'; configurations compile without spills;
the compile cache is keyed by value; the launch heuristics; the eager entry point's
argument errors; the prefill's chunk kernel lowered for CUDA, once for every prompt
shape.
"""
import dataclasses
import functools
import pathlib
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("cutlass", reason="needs nvidia-cutlass-dsl")

from jax import export  # noqa: E402

from jax_kda import (KdaConfig, PrefillInputs, backends, fused_verify, kernel_abi,  # noqa: E402
                     prefill)
from jax_kda.ffi import choose_split, eager_verify, kernel_split, solo_ctas  # noqa: E402
from jax_kda.testing import random_cache, random_inputs, random_params  # noqa: E402

pytestmark = pytest.mark.kernels

TARGET = "CuteDSLRT_NvJaxCutlassCall_v2"
CACHE = ("state", "conv", "corrections", "key_gates", "pending")
DESIGN = pathlib.Path(__file__).parent.parent / "docs" / "design.md"


def shapes(tree):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)


def example(config, conv_bias=True, batch=3, layers=None):
    key = jax.random.key(0)
    params = random_params(key, config, conv_bias=conv_bias, layers=layers)
    cache = random_cache(jax.random.fold_in(key, 1), config, num_slots=5, num_records=4,
                         layers=layers)
    inputs = random_inputs(jax.random.fold_in(key, 2), config, list(range(1, batch + 1)),
                           list(range(batch)))
    return params, cache, inputs


def exported(function, *args):
    return export.export(jax.jit(function), platforms=["cuda"], disabled_checks=[
        export.DisabledSafetyCheck.custom_call(TARGET)])(*args)


@pytest.mark.parametrize("conv_bias, layers, trees, state_dtype",
                         [(True, None, False, jnp.float32), (False, None, False, jnp.float32),
                          (True, 3, False, jnp.float32), (True, 3, True, jnp.bfloat16)],
                         ids=["bias", "no-bias", "stacked", "stacked-trees-bf16-state"])
def test_export_aliases_the_cache_in_place(conv_bias, layers, trees, state_dtype):
    """The exported module holds one CuTe DSL custom call whose outputs 1.. alias the
    cache operands (nodes too with trees; a bf16 state as it is), and the donated cache
    arguments alias the jitted function's outputs (stacked: the whole stacked buffers,
    no slice, no conversion)."""
    config = KdaConfig(heads=2, tokens=4, split=2, trees=trees, state_dtype=state_dtype)
    params, cache, inputs = example(config, conv_bias, layers=layers)
    extra = {} if layers is None else {"layer": 1}
    step = jax.jit(functools.partial(fused_verify, config=config, backend="cutedsl", **extra),
                   donate_argnums=1)
    text = export.export(step, platforms=["cuda"], disabled_checks=[
        export.DisabledSafetyCheck.custom_call(TARGET)])(
            shapes(params), shapes(cache), shapes(inputs)).mlir_module()
    assert text.count(f"stablehlo.custom_call @{TARGET}") == 1
    aliases = re.findall(r"output_tuple_indices = \[(\d)\], operand_index = (\d+)", text)
    fields = CACHE + (("nodes",) if trees else ())
    assert sorted(int(o) for o, _ in aliases) == list(range(1, len(fields) + 1))
    main = re.search(r"func\.func public @main\((.*?)\) ->", text, re.S).group(1)
    for name in fields:
        argument = re.search(rf"%arg\d+: tensor<([^>]*)>[^%]*?loc\(\"cache\.{name}\"\)", main)
        assert "tf.aliasing_output" in argument.group(0), f"cache.{name} is not aliased"
        leaf = getattr(cache, name)
        assert argument.group(1) == "x".join(map(str, leaf.shape)) + "x" + {
            "float32": "f32", "bfloat16": "bf16", "int32": "i32"}[leaf.dtype.name], \
            f"cache.{name} was sliced or converted"
    assert "dynamic_slice" not in text and "dynamic_update_slice" not in text


def modules(text):
    return re.findall(rf'custom_call @{TARGET}\(.*?module = "(.*?)"', text)


def test_one_binary_per_configuration_for_every_batch():
    """A configuration compiles once: two batch sizes, cache sizes and a stacked call at
    another layer count share its binary (and the second lowering compiles nothing);
    configurations that differ in a compiled-in scalar (eps), the split, the lazy
    checkpoint (the same records) or the forget gate (the softplus gate's) get their
    own."""
    base = KdaConfig(heads=2, tokens=4, split=2)
    others = [dataclasses.replace(base, eps=1e-3), dataclasses.replace(base, split=1),
              dataclasses.replace(base, checkpoint_every=2, record_tokens=base.rq),
              dataclasses.replace(base, lower_bound=None)]

    def program(params, cache, inputs, small):
        outs = []
        for config in [base] + others:
            out, cache = fused_verify(params, cache, inputs, config, backend="cutedsl")
            outs.append(out)
        out, cache = fused_verify(params, cache, small, base, backend="cutedsl")
        return outs + [out], cache

    params, cache, inputs = example(base)
    _, _, small = example(base, batch=2)
    found = modules(exported(program, *map(shapes, (params, cache, inputs, small)))
                    .mlir_module())
    assert len(found) == 6 and len(set(found)) == 5 and found[0] == found[5]

    step = lambda p, c, i: fused_verify(p, c, i, base, backend="cutedsl")
    _, bigger, five = example(base, batch=5)
    bigger = jax.tree.map(lambda a: jnp.concatenate([a, a]), bigger)  # S = 10, R = 8
    start = time.perf_counter()
    again = modules(exported(step, *map(shapes, (params, bigger, five))).mlir_module())
    assert time.perf_counter() - start < 2.0, "a new batch size compiled the kernel again"
    assert again == found[:1]


def test_symbolic_batch_exports():
    """jax.export with a symbolic batch size B lowers the kernel (split given)."""
    config = KdaConfig(heads=2, tokens=4, split=1)
    params, cache, inputs = example(config)
    B, = export.symbolic_shape("B")
    symbolic = jax.tree.map(lambda a: jax.ShapeDtypeStruct((B,) + a.shape[1:], a.dtype),
                            shapes(inputs))
    text = exported(lambda p, c, i: fused_verify(p, c, i, config, backend="cutedsl"),
                    shapes(params), shapes(cache), symbolic).mlir_module()
    assert text.count(f"stablehlo.custom_call @{TARGET}") == 1
    with pytest.raises(ValueError, match="a symbolic batch size .* needs an explicit split"):
        exported(lambda p, c, i: fused_verify(p, c, i, dataclasses.replace(config, split=None),
                                              backend="cutedsl"),
                 shapes(params), shapes(cache), symbolic)


def test_exported_step_round_trips():
    """A step taking the library's pytrees serializes and deserializes (the pytrees are
    registered for jax.export), keeping its custom call."""
    config = KdaConfig(heads=2, tokens=4, split=2)
    params, cache, inputs = example(config)
    step = exported(lambda p, c, i: fused_verify(p, c, i, config, backend="cutedsl"),
                    *map(shapes, (params, cache, inputs)))
    back = export.deserialize(step.serialize())
    assert back.in_tree == step.in_tree and back.out_tree == step.out_tree
    assert back.mlir_module().count(f"stablehlo.custom_call @{TARGET}") == 1


def test_cutedsl_on_the_cpu_raises_a_clear_error():
    config = KdaConfig(heads=2, tokens=4, split=2)
    with pytest.raises(ValueError, match=r"backend='cutedsl': the CuTe DSL kernel runs on "
                                         r"CUDA GPUs .* lowered for \('cpu',\)"):
        jax.jit(functools.partial(fused_verify, config=config, backend="cutedsl")).lower(
            *example(config))


def test_vmap_of_the_kernel_path_folds_into_the_batch():
    """Under jax.vmap the kernel path lowers as one custom call over the folded batch."""
    config = KdaConfig(heads=2, tokens=4, split=2)
    params, cache, inputs = example(config, batch=2)
    mapped = jax.tree.map(lambda a: jnp.stack([a, a]), inputs)
    step = jax.vmap(lambda i: fused_verify(params, cache, i, config, backend="cutedsl"),
                    out_axes=(0, None))
    text = exported(step, shapes(mapped)).mlir_module()
    assert text.count(f"stablehlo.custom_call @{TARGET}") == 1
    assert "tensor<4x4x2x128xbf16>" in text  # the output of B = 2 x 2 folded requests


def test_operand_table_is_the_kernels_and_the_docs():
    """The kernel's __call__ takes the table's operands (its signature's fakes compile, in
    order, in `compiled`); docs/design.md holds the table as `kernel_abi.table()` writes
    it; every cache field is a read-write operand aliased to an output."""
    assert kernel_abi.table() in DESIGN.read_text()
    assert [op.name for op in kernel_abi.OPERANDS if op.tree == "cache"] == list(CACHE) + [
        "nodes"]
    assert all(op.access == kernel_abi.READ_WRITE for op in kernel_abi.OPERANDS
               if op.tree == "cache")
    assert sorted(kernel_abi.aliases(True, True, True).values()) == [1, 2, 3, 4, 5, 6]
    assert sorted(kernel_abi.aliases(True, True, False).values()) == [1, 2, 3, 4, 5]


def test_compiles_without_spills():
    """Two corners of the configuration space compile for sm_90a with no local memory
    (`python -m jax_kda.kernels` compiles them all; CI runs it)."""
    from jax_kda.kernels.__main__ import main

    assert main(["--arch", "sm_90a", "--heads", "2", "--only", "2,0,1", "--only", "8,1,8",
                 "--jobs", "1"]) == 0


def zero_prompts(B, P, H):
    """PrefillInputs of B whole prompts of P tokens at slots 1..B (their shapes matter)."""
    bf16 = lambda *shape: jnp.zeros(shape, jnp.bfloat16)
    return PrefillInputs(x=bf16(B, P, 3, H, 128), f_a=bf16(B, P, 128), beta=bf16(B, P, H),
                         gate=bf16(B, P, H, 128), lengths=jnp.full((B,), P, jnp.int32),
                         slots=jnp.arange(1, B + 1, dtype=jnp.int32),
                         record_rows=jnp.arange(B, dtype=jnp.int32))


@pytest.mark.parametrize("lower_bound,chunk,scale", [
    (-5.0, 64, None), (-15.0, 32, None), (-30.0, 16, None), (-5.0, 64, 1e30), (None, 16, None)])
def test_prefill_backends_lower_as_asked(lower_bound, chunk, scale):
    """backend='cutedsl' lowers the prefill's scan over chunks to one CuTe DSL custom call
    on [B, H, N, chunk, K] operands, with no loop left in the program (the softplus
    gate's too, lower_bound None: chunks of 16), and at chunks of 64 (lower_bound >=
    -5.2) and query scales <= 2^60 the convolution and the chunks' operands to two more,
    on the token-major bf16 tensors before it; backend='jax' to XLA's while loop, with
    no custom call."""
    config = KdaConfig(heads=2, tokens=4, lower_bound=lower_bound, scale=scale)
    _, cache, _ = example(config)
    params = random_params(jax.random.key(0), config)
    B, P = 2, 300  # 5 chunks or more: XLA's scan keeps its loop
    inputs = zero_prompts(B, P, config.heads)
    texts = {backend: exported(functools.partial(prefill, config=config, backend=backend),
                               *map(shapes, (params, cache, inputs))).mlir_module()
             for backend in ("cutedsl", "jax")}
    calls = [line for line in texts["cutedsl"].splitlines()
             if f"custom_call @{TARGET}" in line]
    fits = chunk == 64 and scale is None
    assert len(calls) == 1 + 2 * fits and "stablehlo.while" not in texts["cutedsl"]
    N = -(-P // chunk)
    assert f"tensor<{B}x2x{N}x{chunk}x128xf32>" in calls[-1]
    if fits:
        assert f"-> tensor<{B}x{P}x3x2x128xbf16>" in calls[0]  # the convolution's y
        assert f"tensor<{B}x{P}x3x2x128xbf16>" in calls[1]
        assert f"-> (tensor<{B}x2x{N}x{chunk}x128xf32>" in calls[1]
    assert "stablehlo.custom_call" not in texts["jax"] and "stablehlo.while" in texts["jax"]
    for B, P in ((2, 0), (0, 300)):  # nothing to launch: no kernel, whatever the backend
        empty = exported(functools.partial(prefill, config=config, backend="cutedsl"),
                         *map(shapes, (params, cache, zero_prompts(B, P, config.heads))))
        assert "stablehlo.custom_call" not in empty.mlir_module()


def test_chunk_kernel_compiles_once_for_every_prompt():
    """Prompts of other batch sizes and lengths (chunk counts) share the prefill kernels'
    binaries (the convolution's, the operands' and the scan's)."""
    config = KdaConfig(heads=2, tokens=4)
    _, cache, _ = example(config)
    params = random_params(jax.random.key(0), config)
    found = []
    for B, P in ((2, 300), (3, 1000)):
        inputs = zero_prompts(B, P, config.heads)
        found += modules(exported(functools.partial(prefill, config=config, backend="cutedsl"),
                                  *map(shapes, (params, cache, inputs))).mlir_module())
    assert len(found) == 6 and found[:3] == found[3:]


def test_one_compile_per_kernel_key():
    """The compile cache is keyed by a kernel's compile-time values, not its identity:
    equal kernel objects share one binary, for the eager path and the custom call
    alike, and another value compiles its own, its device function named by its own
    symbol (which profilers and sanitizers show)."""
    from jax_kda.ffi import lowering
    from jax_kda.kernels import ChunkStates, compiled

    assert ChunkStates(32) == ChunkStates(32) and hash(ChunkStates(32)) == hash(ChunkStates(32))
    assert ChunkStates(32) != ChunkStates(16)
    for binding in ({}, {"binding": lowering.for_xla}):
        first = compiled(ChunkStates(32), **binding)
        assert compiled(ChunkStates(32), **binding) is first
        assert compiled(ChunkStates(16), **binding) is not first
    symbols = [kernel.symbol() for kernel in (ChunkStates(32), ChunkStates(16))]
    assert symbols[0] != symbols[1] and all(s.startswith("kda_chunk_states_") for s in symbols)
    for kernel, symbol, other in zip((ChunkStates(32), ChunkStates(16)), symbols,
                                     symbols[::-1]):
        module = compiled(kernel, binding=lowering.for_xla).module
        assert symbol.encode() in module and other.encode() not in module


def test_verify_symbols_name_the_build():
    """Each verify build's symbol says its T, split, tree, state dtype and lazy
    checkpoint, and no two builds share one."""
    from jax_kda.kernels import FusedVerify

    builds = [FusedVerify(KdaConfig(heads=2, tokens=16, trees=True), 2, True),
              FusedVerify(KdaConfig(heads=2, tokens=4, state_dtype=jnp.bfloat16,
                                    checkpoint_every=2), 1, True),
              FusedVerify(KdaConfig(heads=2, tokens=4), 1, True),
              FusedVerify(KdaConfig(heads=2, tokens=4), 1, False),
              FusedVerify(KdaConfig(heads=2, tokens=4), 1, True, timeline=True)]
    symbols = [build.symbol() for build in builds]
    assert symbols[0].startswith("kda_verify_t16_split2_tree_")
    assert symbols[1].startswith("kda_verify_t4_split1_bf16_state_keep2_")
    assert symbols[2].startswith("kda_verify_t4_split1_") and len(set(symbols)) == len(symbols)


def test_timeline_build_compiles():
    """The diagnostic build (phase stamps into one more operand) compiles for sm_90a."""
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
    from jax_kda.config import CTA_RESERVED, SM_SHARED, SOLO_SHARED
    from jax_kda.kernels.fused_layout import FusedLayout

    layout = FusedLayout(KdaConfig(heads=32, tokens=4), 1)
    assert (2 * (layout.shared_bytes() + CTA_RESERVED) <= SM_SHARED
            < 2 * (SOLO_SHARED + CTA_RESERVED))


def test_kernel_split_fits_the_shared_memory():
    """Long records outgrow one CTA's shared memory at splits 1 and 2 (RQ = 96): split
    None moves up to the next split that fits, an explicit split 1 is refused with the
    need named; at RQ = T the heuristic's split stands."""
    long = KdaConfig(heads=2, tokens=2, record_tokens=96)
    assert choose_split(64 * 2, 132) == 1
    assert kernel_split(long, 64, sms=132) == 4
    with pytest.raises(ValueError, match=r"split=1 needs 2\d\d KiB of shared memory"):
        kernel_split(dataclasses.replace(long, split=1), 64)
    assert kernel_split(KdaConfig(heads=32, tokens=8), 64, sms=132) == 1


def test_kernel_split_leaves_a_lone_cta_from_eight_tokens():
    """Where a split-1 CTA needs more than half an SM's shared memory, split None takes
    split 2 instead from LONE_CTA_TOKENS tokens (a tree or chain of 16, T = 8 with 4
    steps' records) and keeps split 1 below (T = 4 with 8 steps' records); at B = 1 the
    heuristic's larger split stands, and an explicit split 1 is taken."""
    from jax_kda.config import CTA_RESERVED, SM_SHARED
    from jax_kda.ffi.launch import LONE_CTA_TOKENS
    from jax_kda.kernels.fused_layout import FusedLayout

    for config, lone in [(KdaConfig(heads=32, tokens=16), True),
                         (KdaConfig(heads=32, tokens=16, trees=True), True),
                         (KdaConfig(heads=32, tokens=8, checkpoint_every=4), True),
                         (KdaConfig(heads=32, tokens=4, checkpoint_every=8), False)]:
        assert 2 * (FusedLayout(config, 1).shared_bytes() + CTA_RESERVED) > SM_SHARED
        assert (config.tokens >= LONE_CTA_TOKENS) == lone
        for batch in (16, 64):
            assert choose_split(batch * 32, 132) == 1
            assert kernel_split(config, batch, sms=132) == (2 if lone else 1)
        assert kernel_split(config, 1, sms=132) == choose_split(32, 132)
    assert kernel_split(KdaConfig(heads=32, tokens=16, split=1), 64, sms=132) == 1


def test_eager_rejects_a_wrong_shape_before_any_launch():
    config = KdaConfig(heads=2, tokens=4)
    params, cache, inputs = jax.tree.map(np.asarray, example(config))
    out = np.zeros((3, 4, 2, 128), jnp.bfloat16)
    bad = dataclasses.replace(cache, state=cache.state[:, :1])
    with pytest.raises(ValueError, match=r"state: expected \[5, 2, 128, 128\] float32, "
                                         r"got \[5, 1, 128, 128\] float32"):
        eager_verify(params, bad, inputs, out, config)
    with pytest.raises(ValueError, match=r"pending: expected \[4, 2\] int32, got \[4\] int32"):
        eager_verify(params, dataclasses.replace(cache, pending=cache.pending[:, 0]), inputs,
                     out, config)
    with pytest.raises(ValueError, match=r"out: expected \[3, 4, 2, 128\] bfloat16"):
        eager_verify(params, cache, inputs, out.astype(np.float32), config)
    with pytest.raises(TypeError, match="stream: expected None, an int handle"):
        eager_verify(params, cache, inputs, out, config, stream="default")


PLANS = [  # (config, whether the kernel takes it)
    (KdaConfig(heads=32, tokens=16), True),
    (KdaConfig(heads=32, tokens=16, trees=True), True),
    (KdaConfig(heads=32, tokens=13), True),
    (KdaConfig(heads=32, tokens=13, trees=True), False),
    (KdaConfig(heads=32, tokens=9), True),
    (KdaConfig(heads=32, tokens=9, gate_mode=1), False),
    (KdaConfig(heads=32, tokens=16, trees=True, lower_bound=None), True),
    (KdaConfig(heads=32, tokens=16, trees=True, lower_bound=None, split=8), True),
    (KdaConfig(heads=32, tokens=16, trees=True, gate_mode=1, split=8), True),
    (KdaConfig(heads=32, tokens=16, trees=True, split=8), True),
]


@pytest.mark.parametrize("config, kernel", PLANS,
                         ids=["chain-16", "tree-16", "chain-13", "tree-13", "chain-9",
                              "chain-9-gate1", "softplus-tree-16", "softplus-tree-16-split8",
                              "tree-16-gate1-split8", "tree-16-split8"])
def test_the_verify_plan_takes_the_builds_that_compile(config, kernel):
    """"auto" plans the kernel for CUDA where its build compiles without spills (chains
    and trees to T = 16 but a tree of 13 and T = 9 at gate_mode 1: the compile table)
    and XLA elsewhere; "cutedsl" raises there, naming the need."""
    plan = backends.verify_plan(config, 64, "auto")
    assert (plan.cuda is not None) == kernel and plan.other is None
    if not kernel:
        with pytest.raises(ValueError, match="backend='cutedsl': the verify kernel takes"):
            backends.verify_plan(config, 64, "cutedsl")


def test_kernel_split_passes_a_spilling_split(monkeypatch):
    """Where a build spills at split 8 alone, a launch that would take 8 (one request,
    one head) takes 4, the largest below that compiles without spills; larger batches
    keep `choose_split`'s."""
    config = KdaConfig(heads=1, tokens=16, trees=True)
    assert choose_split(1, 132) == 8 and kernel_split(config, 1, sms=132) == 8
    monkeypatch.setattr(backends, "spilling_build",
                        lambda c, split: "split 8" if split == 8 else None)
    assert kernel_split(config, 1, sms=132) == 4
    assert kernel_split(config, 64, sms=132) == choose_split(64, 132)


@pytest.mark.parametrize("tokens,trees,split,shared", [
    (16, True, 2, True), (16, True, 4, True), (16, True, 8, True), (16, False, 2, True),
    (8, True, 2, True), (8, False, 8, True), (6, False, 2, True), (5, False, 2, False),
    (12, True, 2, False), (16, True, 1, False), (16, False, 1, False), (15, False, 4, True)])
def test_the_cluster_shares_the_pair_products(tokens, trees, split, shared):
    """At split > 1 the pair products' units (batches of 32 pairs; nodes past 14 tokens
    or in a tree of 16) go to one CTA each, every rank gets some where there are as many
    units, and the nodes' 2t + 1 pairs split evenly (looped nodes, each one iteration's
    work, in turn); none is shared at split 1, with one unit (T <= 5) or in a batched
    tree past 8 nodes."""
    from jax_kda.kernels import FusedVerify

    kernel = FusedVerify(KdaConfig(heads=2, tokens=tokens, trees=trees), split, True)
    by_node, units = kernel.pair_units()
    owners = [kernel.pair_owner(unit) for unit in range(units)]
    assert kernel.shared_pairs() == shared
    if not shared:
        assert owners == [None] * units
        return
    assert sorted(set(owners)) == list(range(min(split, units)))
    assert units == (tokens if by_node else -(-tokens ** 2 // 32))
    if kernel.looped_tokens():
        assert by_node and owners == [t % split for t in range(tokens)]
    if by_node:
        work = [sum(2 * t + 1 for t, rank in enumerate(owners) if rank == r)
                for r in range(split)]
        assert sum(work) == tokens ** 2 and max(work) - min(work) <= 2 * tokens - 1
