"""The fused CuTe DSL kernel on a Hopper GPU (marker `gpu`), against both JAX references
run on the CPU (the XLA backend and the stock scan) over multi-step speculative
episodes, with every edge case of docs/spec.md; stacked layers; in place under jit with
donation; in a CUDA graph; bitwise repeatable; the eager DLPack path identical to the
custom call; the raw gates of both gate modes bit for bit. The prefill's chunk kernel
against XLA's scan over chunks (the prefill with it: tests/test_prefill_pieces.py).

Skipped without a GPU of compute capability >= 9.0 or without nvidia-cutlass-dsl. Set
KDA_GPU_LOG=path to append each comparison's worst errors (one JSON line each).
"""
import dataclasses
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import bad_values
from jax_kda import AWAITING, KdaConfig, accept, fused_verify
from jax_kda.ffi import cutedsl_chunk_states
from jax_kda.prompt_chunks import scan_chunks
from jax_kda.ref import stock_verify
from jax_kda.testing import random_cache, random_inputs, random_params
from jax_kda import cutedsl_supported
from numpy_model import tree_parents
from poison import poison
from tree_shapes import SHAPES, a_path, check_bad_branch, tree_of

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not cutedsl_supported(),
                       reason="needs a CUDA GPU of compute capability >= 9.0 and CuTe DSL"),
]

# Worst error allowed against each reference. "out": |a - e| / (|e| + mean |e| of its
# (token, head) row): a bf16 rounding of o_t, of a SiLU output or of a raw gate that
# falls the other way (FP32 order, exp, division) moves an output by a few 2^-8. "state",
# "corrections": |a - e| / max |e|: FP32 reassociation for the state; for u_t one v
# rounding flip is beta 2^-8 |v| (~2^-9 of the buffer's max). "keys": bf16 ulps of a
# recorded key or raw gate (a flip is one ulp), counted at no less than 2^-8 of the
# row's mean magnitude: both are FP32 sums (conv taps; the tensor cores' gate
# projection, which adds 16 products at a time) that can cancel to a value far below
# their terms, where FP32 noise is several ulps of the tiny result; "key_flips" the
# fraction that differ. The window and pending are copies: exact. A NaN where the
# reference is finite (or the reverse) is an infinite error in every unit.
TOLERANCES = {"out": 4 * 2**-8, "state": 2e-5, "corrections": 2**-6, "keys": 1,
              "key_flips": 1e-2, "window": 0, "pending": 0}
# A bf16 checkpoint: S_n's FP32 reassociation may round an entry to the neighbouring bf16
# value, one ulp, at most 2^-8 of the largest entry.
BF16_STATE = 2**-8
NUM_SLOTS, NUM_RECORDS, STEPS = 9, 7, 3
# The references run on the CPU: XLA on the GPU drops f32 -> bf16 -> f32 round trips
# (xla_allow_excess_precision), i.e. the stock roundings of q, v, raw gates and o_t.
CPU = jax.devices("cpu")[0]

stock_jit = jax.jit(stock_verify, static_argnames=("config", "layer"))
xla_jit = jax.jit(functools.partial(fused_verify, backend="jax"), static_argnames="config")


def kernel_step(config, **layer):
    return jax.jit(functools.partial(fused_verify, config=config, backend="cutedsl", **layer),
                   donate_argnums=1)


def batch(rng, edge_cases):
    """Slots and record rows of a batch of 6: live requests with records, and with
    edge_cases a padding row (slot 0, naming a record row), a request without records
    (rec -1), an out-of-range slot (padding) and an out-of-range record row."""
    slots = rng.permutation(np.arange(1, NUM_SLOTS))
    rows = rng.permutation(NUM_RECORDS)
    pairs = [(slots[i], rows[i]) for i in range(6)]
    if edge_cases:
        pairs[1] = (0, rows[1])
        pairs[2] = (slots[2], -1)
        pairs[3] = (NUM_SLOTS + 3, rows[3])
        pairs[4] = (slots[4], NUM_RECORDS + 2)
    return (jnp.asarray([s for s, _ in pairs], jnp.int32),
            jnp.asarray([r for _, r in pairs], jnp.int32))


def problem(config, seed, edge_cases, layers=None):
    """Random weights, cache and one step's inputs of a batch (see `batch`)."""
    key = jax.random.key(seed)
    slots, rows = batch(np.random.default_rng(seed), edge_cases)
    return (random_params(key, config, layers=layers),
            random_cache(jax.random.fold_in(key, 1), config, NUM_SLOTS, NUM_RECORDS,
                         layers=layers),
            random_inputs(jax.random.fold_in(key, 2), config, slots, rows))


def copy(tree):
    return jax.tree.map(lambda a: None if a is None else jnp.array(a, copy=True), tree)


def difference(actual, expected):
    """|actual - expected| in float64, 0 where both are NaN, inf where only one is."""
    a, e = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    both, either = np.isnan(a) & np.isnan(e), np.isnan(a) | np.isnan(e)
    return np.where(both, 0.0, np.where(either, np.inf, np.abs(a - e)))


def errors(out, cache, out_ref, cache_ref):
    """The worst error of each quantity, in TOLERANCES' units (NaN-safe: see
    `difference`; a mean over a row of NaNs counts as 0)."""
    f64 = lambda a: np.asarray(a, np.float64)
    mean_abs = lambda a: (np.nansum(np.abs(a), -1, keepdims=True)
                          / np.maximum(np.sum(~np.isnan(a), -1, keepdims=True), 1))
    e = f64(out_ref)
    row_scale = np.abs(np.nan_to_num(e)) + mean_abs(e) + 1e-30
    scaled = lambda x, y: float(difference(x, y).max() / np.nanmax(np.abs(f64(y))))
    keys_e = f64(cache_ref.key_gates)
    ulp = 2.0**-7 * (np.abs(np.nan_to_num(keys_e)) + 2.0**-8 * mean_abs(keys_e)) + 1e-30
    keys = difference(cache.key_gates, keys_e)
    u16 = lambda a: np.asarray(a).view(np.uint16)
    return {
        "out": float(np.max(difference(out, out_ref) / row_scale)),
        "state": scaled(cache.state[..., 1:, :, :, :], cache_ref.state[..., 1:, :, :, :]),
        "corrections": scaled(cache.corrections, cache_ref.corrections),
        "keys": float(np.max(keys / ulp)),
        "key_flips": float(np.mean(keys > 0)),
        "window": int(np.sum(u16(cache.conv) != u16(cache_ref.conv))),
        "pending": int(np.sum(np.asarray(cache.pending) != np.asarray(cache_ref.pending))),
    }


def log(case, reference, worst):
    path = os.environ.get("KDA_GPU_LOG")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"case": case, "reference": reference, **worst}) + "\n")


def check(case, reference, out, cache, out_ref, cache_ref, zero_rows, slack=0.0):
    """Every quantity within TOLERANCES (the state within BF16_STATE where the cache
    holds it in bf16; plus `slack` on "out"); padding outputs zero."""
    worst = errors(out, cache, out_ref, cache_ref)
    log(case, reference, worst)
    assert np.all(np.asarray(out, np.float32)[zero_rows] == 0), f"{case}: padding row not 0"
    tolerances = dict(TOLERANCES, **({"state": BF16_STATE}
                                     if cache.state.dtype == jnp.bfloat16 else {}))
    allowed = lambda k: tolerances[k] + (slack if k == "out" else 0)
    bad = {k: v for k, v in worst.items() if not v <= allowed(k)}
    assert not bad, f"{case} vs {reference}: {bad} (tolerances {tolerances})"


def run_episode(config, seed, *, conv_dtype=jnp.float32, norm_dtype=jnp.float32,
                conv_bias=True, edge_cases=True, pending_shift=0, steps=STEPS):
    """`steps` verifies of the kernel with random accepted counts (0..T) in between;
    before each, both references run on the CPU from the kernel's cache, so that every
    step is checked alone (the records' bf16 flips do not compound into the next
    step's checkpoint). With trees, step s verifies trees of shape SHAPES[s % 4] and
    accepts a random path of each (`tree_shapes.a_path`), the second step's broken
    after its first node."""
    rng = np.random.default_rng(seed)
    key = jax.random.key(seed)
    params = random_params(jax.random.fold_in(key, 0), config, conv_dtype=conv_dtype,
                           conv_bias=conv_bias, norm_dtype=norm_dtype)
    cache = random_cache(jax.random.fold_in(key, 1), config, NUM_SLOTS, NUM_RECORDS)
    if pending_shift:  # pending past RQ (clamped) or awaiting an accept
        cache = dataclasses.replace(cache, pending=cache.pending + pending_shift)
    slots, rows = batch(rng, edge_cases)
    zero_rows = ~((np.asarray(slots) > 0) & (np.asarray(slots) < NUM_SLOTS))
    step = kernel_step(config)
    case = (f"T{config.tokens} RQ{config.rq} C{config.checkpoint_every} "
            f"gate{config.gate_mode} split{config.split} "
            f"{jnp.dtype(conv_dtype).name}/{jnp.dtype(norm_dtype).name} bias={conv_bias} "
            f"seed{seed}")
    for s in range(steps):
        cache = poison(cache, config, slots, rows)
        inputs = random_inputs(jax.random.fold_in(key, 10 + s), config, slots, rows)
        if config.trees:
            inputs = dataclasses.replace(inputs, parents=tree_of(
                SHAPES[s % len(SHAPES)], rng, len(rows), config.tokens))
        on_cpu = jax.device_put((params, cache, inputs), CPU)
        out_ref, cache_ref = xla_jit(*on_cpu, config=config)
        out_stock, cache_stock = stock_jit(*on_cpu, config=config)
        out, cache = step(params, cache, inputs)
        # The chunked form (the kernel's) is itself off the stock loop where o_t cancels
        # (large u_s, T x T solve): the kernel may be that much further from stock.
        drift = errors(out_ref, cache_ref, out_stock, cache_stock)["out"]
        log(f"{case} step{s}", "xla_vs_stock", {"out": drift})
        check(f"{case} step{s}", "xla", out, cache, out_ref, cache_ref, zero_rows)
        check(f"{case} step{s}", "stock", out, cache, out_stock, cache_stock, zero_rows,
              slack=drift)
        if config.trees:
            paths, counts = zip(*(a_path(rng, tree_parents(p, config.tokens),
                                         config.tokens) for p in np.asarray(inputs.parents)))
            path = jnp.asarray(paths, jnp.int32)
            if s == 1:
                path = path.at[0, 1].set((path[0, 1] + 1) % config.tokens)
            cache = accept(cache, rows, jnp.asarray(counts, jnp.int32), config, path=path)
            continue
        accepted = jnp.asarray(rng.integers(0, config.tokens + 1, len(rows)), jnp.int32)
        cache = accept(cache, rows, accepted, config)


CONFIGS = [(T, g, split) for T in (*range(2, 9), 12, 15, 16) for g in (0, 1)
           for split in (1, 2, 4, 8)]


@pytest.mark.parametrize("tokens,gate_mode,split", CONFIGS,
                         ids=[f"T{T}-gate{g}-split{s}" for T, g, s in CONFIGS])
def test_parity_every_configuration(tokens, gate_mode, split):
    config = KdaConfig(heads=3, tokens=tokens, gate_mode=gate_mode, split=split)
    run_episode(config, seed=100 * tokens + 10 * gate_mode + split)


OPERANDS = [(jnp.float32, jnp.float32, False), (jnp.bfloat16, jnp.bfloat16, True),
            (jnp.bfloat16, jnp.float32, False)]


@pytest.mark.parametrize("split", (1, 2, 4, 8), ids=lambda s: f"split{s}")
@pytest.mark.parametrize("conv_dtype,norm_dtype,conv_bias", OPERANDS,
                         ids=["f32-nobias", "bf16-bias", "bf16conv-f32norm-nobias"])
def test_parity_operand_variants(conv_dtype, norm_dtype, conv_bias, split):
    config = KdaConfig(heads=2, tokens=3, split=split)
    run_episode(config, seed=7 + split, conv_dtype=conv_dtype, norm_dtype=norm_dtype,
                conv_bias=conv_bias)


@pytest.mark.parametrize("split", (1, 8), ids=lambda s: f"split{s}")
def test_parity_long_records_and_clamped_pending(split):
    """record_tokens > tokens, pending beyond RQ (clamped) and negative (awaiting an
    accept with records kept)."""
    config = KdaConfig(heads=2, tokens=3, record_tokens=6, split=split, lower_bound=-3.0,
                       scale=0.1, eps=1e-4)
    run_episode(config, seed=31, pending_shift=5)
    run_episode(config, seed=32, pending_shift=-4)


LAZY = [(4, 2, 1), (4, 2, 2), (2, 4, 1), (4, 4, 1), (4, 4, 4), (8, 2, 8), (3, 3, 2),
        (8, 4, 2)]  # the last: the split `kernel_split` gives T = 8, C = 4 (a lone CTA at 1)


@pytest.mark.parametrize("tokens,every,split", LAZY,
                         ids=[f"T{T}-C{C}-split{s}" for T, C, s in LAZY])
def test_parity_lazy_checkpoint(tokens, every, split):
    """checkpoint_every C > 1 over episodes long enough that records fill and the state
    is written: verifies that keep their replayed tokens and write no state, and ones
    that write it, against both references."""
    config = KdaConfig(heads=3, tokens=tokens, checkpoint_every=every, split=split)
    run_episode(config, seed=500 + 10 * tokens + every, steps=2 * every + 2)


TREES = [(T, split) for T in (2, 5, 8, 12, 16) for split in (1, 2, 4, 8)]


@pytest.mark.parametrize("tokens,split", TREES, ids=[f"T{T}-split{s}" for T, s in TREES])
def test_parity_trees(tokens, split):
    """Token trees of every shape, with path accepts, against both references (gate_mode
    1 at split 8: a tree of 16 there spilled before its convolution looped)."""
    gate_mode = 1 if split == 8 else tokens % 2
    config = KdaConfig(heads=3, tokens=tokens, gate_mode=gate_mode, split=split, trees=True)
    run_episode(config, seed=700 + 10 * tokens + split, steps=4)


SOFTPLUS = [(T, trees, split) for T, trees in ((4, False), (8, False), (16, True))
            for split in (1, 2, 4, 8)]


@pytest.mark.parametrize("tokens,trees,split", SOFTPLUS,
                         ids=[f"T{T}-{'tree' if t else 'chain'}-split{s}" for T, t, s in SOFTPLUS])
def test_parity_softplus_gate(tokens, trees, split):
    """The softplus gate (lower_bound None, Kimi-Linear's) computed in the kernel
    (`primitives.softplus_decays`), its replays and verifies against both references; at
    the random weights (exp(a_log) up to 16, raw gates about unit normal) its log decays
    reach about -50."""
    config = KdaConfig(heads=3, tokens=tokens, gate_mode=1, split=split, trees=trees,
                       lower_bound=None)
    run_episode(config, seed=900 + 10 * tokens + split, steps=4)


CHAIN_TREES = [(6, 1), (6, 2), (6, 8), (16, 1), (16, 2)]  # 16, 2: the runtime loops


@pytest.mark.parametrize("tokens,split", CHAIN_TREES,
                         ids=[f"T{T}-split{s}" for T, s in CHAIN_TREES])
def test_a_chain_tree_is_the_chain_bit_for_bit(tokens, split):
    """The tree build given parents t - 1 and its kept tokens at positions 0 .. n - 1
    computes the chain build's bits: a selected factor of 1 and a sum's selected term
    are exact (nodes aside, which only it has). Past BATCHED_TREE_TOKENS nodes a tree
    sums its pair products node by node (docs/design.md), so there only what the
    convolution writes (the window, the records' keys and raw gates) is compared, but
    where both builds loop over the nodes (`looped_tokens`)."""
    chain = KdaConfig(heads=3, tokens=tokens, split=split)
    tree = dataclasses.replace(chain, trees=True)
    params, cache, inputs = problem(chain, seed=61 + split, edge_cases=True)
    nodes = jnp.broadcast_to(jnp.arange(tree.rq, dtype=jnp.int32),
                             (NUM_RECORDS, tree.heads, tree.rq))
    out, after = kernel_step(chain)(params, copy(cache), inputs)
    tree_out, tree_after = kernel_step(tree)(
        params, dataclasses.replace(copy(cache), nodes=nodes),
        dataclasses.replace(inputs, parents=tree_of("chain", None, 6, tokens)))
    from jax_kda.kernels import FusedVerify
    from jax_kda.kernels.fused import BATCHED_TREE_TOKENS

    if tokens > BATCHED_TREE_TOKENS and not FusedVerify(chain, split, True).looped_tokens():
        for field in ("conv", "key_gates"):
            assert bits(getattr(tree_after, field)) == bits(getattr(after, field)), field
        return
    assert bits(tree_out) == bits(out)
    assert bits(dataclasses.replace(tree_after, nodes=None)) == bits(after)


BAD_BRANCHES = [(5, 1), (5, 2), (16, 2)]  # 16: the runtime loops (`looped_tokens`)


@pytest.mark.parametrize("tokens,split", BAD_BRANCHES,
                         ids=[f"T{T}-split{s}" for T, s in BAD_BRANCHES])
def test_a_bad_branch_reaches_no_other(tokens, split):
    """tests/tree_shapes.py's `check_bad_branch` on the kernel, the bad node's x.v NaN."""
    config = KdaConfig(heads=3, tokens=tokens, split=split, trees=True)
    params, cache, inputs = problem(config, seed=95 + split, edge_cases=False)
    check_bad_branch(kernel_step(config),
                     lambda i, node: bad_values.spoiled(i, "x.v", node, "nan"), params,
                     lambda: copy(cache), inputs, config, copy=copy)


BF16 = [(T, every, trees, split) for T, every, trees in ((4, 1, False), (8, 1, True),
                                                        (4, 4, False), (16, 1, False))
        for split in (1, 2, 4, 8)]


@pytest.mark.parametrize("tokens,every,trees,split", BF16,
                         ids=[f"T{T}-C{C}-{'tree' if tr else 'chain'}-split{s}"
                              for T, C, tr, s in BF16])
def test_parity_bf16_state(tokens, every, trees, split):
    """A bf16 checkpoint (half the state's bytes), chains, trees and the lazy checkpoint,
    against both references from the same bf16 cache."""
    config = KdaConfig(heads=3, tokens=tokens, checkpoint_every=every, trees=trees,
                       split=split, state_dtype=jnp.bfloat16)
    assert random_cache(jax.random.key(0), config, 2, 1).state.dtype == jnp.bfloat16
    run_episode(config, seed=900 + 10 * tokens + split, steps=2 * every + 2)


def test_split_none_and_one_head():
    run_episode(KdaConfig(heads=1, tokens=4), seed=41)


def test_crowded_grid():
    """The kernel requests a CTA's state rows with its small operands in a crowded grid
    (T <= 4, more than CROWDED_CTAS_PER_SM CTAs per SM) and after them otherwise; every
    other test's grid is small. H = 32 at split 8 gives the batch of 6 1536 CTAs."""
    from jax_kda.ffi import sm_count
    from jax_kda.kernels.fused import CROWDED_CTAS_PER_SM
    config = KdaConfig(heads=32, tokens=4, split=8)
    assert 6 * config.heads * config.split > CROWDED_CTAS_PER_SM * sm_count()
    run_episode(config, seed=53)


def bits(tree):
    """Every leaf's shape and bytes, so that trees compare bit for bit (NaNs too)."""
    return [(np.shape(a), np.asarray(a).tobytes()) for a in jax.tree.leaves(tree)]


@pytest.mark.parametrize("split", (1, 2, 4, 8), ids=lambda s: f"split{s}")
def test_stacked_layer_equals_its_slice(split):
    """fused_verify(layer=i) on stacked params and cache gives the unstacked call's bits
    on layer i's slices, leaves every other layer's bits alone, and a layer outside
    [0, L) makes every row padding (zero outputs, cache untouched)."""
    config = KdaConfig(heads=2, tokens=4, split=split)
    params, cache, inputs = problem(config, seed=61 + split, edge_cases=True, layers=3)
    cache = poison(cache, config, inputs.slots, inputs.record_rows, layer=1)
    before = jax.tree.map(np.asarray, cache)
    out, stacked = kernel_step(config, layer=1)(params, copy(cache), inputs)
    one = lambda tree: jax.tree.map(lambda a: a[1], tree)
    out_one, cache_one = kernel_step(config)(one(params), one(copy(cache)), inputs)
    assert bits((out, one(stacked))) == bits((out_one, cache_one))
    for layer in (0, 2):
        assert bits(jax.tree.map(lambda a: a[layer], stacked)) == bits(
            jax.tree.map(lambda a: a[layer], before))
    traced = jax.jit(lambda p, c, i, l: fused_verify(p, c, i, config, backend="cutedsl",
                                                     layer=l), donate_argnums=1)
    for bad in (-1, 3):
        out_bad, untouched = traced(params, copy(cache), inputs, jnp.int32(bad))
        assert np.all(np.asarray(out_bad, np.float32) == 0)
        assert bits(untouched) == bits(before)


def test_scanned_layers_equal_a_loop():
    """A lax.scan over stacked layers (the layer traced, the cache in the carry) gives
    the bits of a Python loop over the per-layer calls."""
    config = KdaConfig(heads=2, tokens=4)
    L = 3
    params, cache, inputs = problem(config, seed=71, edge_cases=True, layers=L)

    @functools.partial(jax.jit, donate_argnums=1)
    def scanned(params, cache, inputs):
        def body(cache, layer):
            out, cache = fused_verify(params, cache, inputs, config, backend="cutedsl",
                                      layer=layer)
            return cache, out
        cache, outs = jax.lax.scan(body, cache, jnp.arange(L, dtype=jnp.int32))
        return outs, cache

    outs, after = scanned(params, copy(cache), inputs)
    looped = copy(cache)
    for layer in range(L):
        out, looped = kernel_step(config, layer=layer)(params, looped, inputs)
        assert bits(out) == bits(outs[layer])
    assert bits(after) == bits(looped)


def test_raw_gates_of_both_modes_bit_for_bit():
    """The recorded raw gates of gate_mode 0 and 1 on inputs whose two sums round
    differently: per feature 2^30 (rank 0), 50 (rank 32), 50 (rank 36), -2^30 (rank
    64). One chain loses each 50 against 2^30 and ends at 0; the quarter chains add
    100 to 2^30 (rounded to 2^30 + 128) and end at 128. Every partial sum inside a
    tensor-core step is exact, so the kernel must give these bits in either mode."""
    config = KdaConfig(heads=2, tokens=4)
    rows = {0: (2.0**15, 2.0**15), 32: (1.0, 50.0), 36: (1.0, 50.0), 64: (-(2.0**15), 2.0**15)}
    f_a = np.zeros((config.tokens, 128), np.float32)
    f_b = np.zeros((config.heads, 128, 128), np.float32)
    for rank, (a, b) in rows.items():
        f_a[:, rank], f_b[:, :, rank] = a, b
    expected = {0: 0.0, 1: 128.0}
    for gate_mode, value in expected.items():
        config = KdaConfig(heads=2, tokens=4, gate_mode=gate_mode, split=1)
        params, cache, inputs = problem(config, seed=81, edge_cases=False)
        params = dataclasses.replace(params, f_b=jnp.asarray(f_b, jnp.bfloat16))
        inputs = dataclasses.replace(inputs, f_a=jnp.broadcast_to(
            jnp.asarray(f_a, jnp.bfloat16), inputs.f_a.shape))
        _, cache = kernel_step(config)(params, cache, inputs)
        gates = np.asarray(cache.key_gates[np.asarray(inputs.record_rows), :, :4, 1],
                           np.float32)
        np.testing.assert_array_equal(gates, value, err_msg=f"gate_mode {gate_mode}")


BAD_CASES = [(field, value, split) for field in bad_values.FIELDS
             for value in bad_values.VALUES for split in (1, 2)]


@pytest.mark.parametrize("field, value, split", BAD_CASES,
                         ids=[f"{f}-{v}-split{s}" for f, v, s in BAD_CASES])
def test_a_bad_draft_reaches_nothing_before_it(field, value, split):
    """A bad value (NaN, +-inf, 3e38) in the last draft of request 0 leaves its earlier
    tokens, their records and window, the other requests and the next step after
    accepting the earlier tokens bitwise as a clean run leaves them
    (tests/bad_values.py)."""
    config = KdaConfig(heads=3, tokens=4, split=split)
    params, cache, inputs = problem(config, seed=90 + split, edge_cases=False)
    step = kernel_step(config)
    bad_values.check_verify(
        lambda p, c, i: step(p, c, i), lambda c, rows, a: accept(c, rows, a, config),
        params, cache, inputs, config, field, config.tokens - 1, value, copy=copy)


def test_pending_awaits_the_accept():
    """After a verify every live record row's pending is -1 in each head (the padding
    row's and the unused rows' untouched); accept then sets the accepted counts."""
    config = KdaConfig(heads=3, tokens=4, split=2)
    params, cache, inputs = problem(config, seed=91, edge_cases=True)
    before = np.asarray(cache.pending)
    _, after = kernel_step(config)(params, copy(cache), inputs)
    slots, rows = np.asarray(inputs.slots), np.asarray(inputs.record_rows)
    live = (slots > 0) & (slots < NUM_SLOTS) & (rows >= 0) & (rows < NUM_RECORDS)
    expected = before.copy()
    expected[rows[live]] = AWAITING
    np.testing.assert_array_equal(np.asarray(after.pending), expected)


def test_vmap_folds_into_the_batch():
    """jax.vmap over an extra axis of the inputs equals one call on the folded batch."""
    config = KdaConfig(heads=2, tokens=4, split=1)
    params, cache, inputs = problem(config, seed=95, edge_cases=False)
    halves = jax.tree.map(lambda a: a.reshape((2, 3) + a.shape[1:]), inputs)
    run = lambda i: fused_verify(params, cache, i, config, backend="cutedsl")
    out_v, cache_v = jax.jit(jax.vmap(run, out_axes=(0, None)))(halves)
    out, folded = jax.jit(run)(inputs)
    assert bits((out_v.reshape(out.shape), cache_v)) == bits((out, folded))


def test_in_place_under_jit_with_donation():
    """Same buffers after a donated jitted step, and no copy in the compiled HLO, for
    one layer's cache and a stacked one."""
    config = KdaConfig(heads=4, tokens=4, split=2)
    names = ("state", "conv", "corrections", "key_gates", "pending")
    for layers, extra in ((None, {}), (3, {"layer": 2})):
        params, cache, inputs = problem(config, seed=5, edge_cases=False, layers=layers)
        step = kernel_step(config, **extra)
        hlo = step.lower(params, cache, inputs).compile().as_text()
        assert "copy(" not in hlo and "copy-start" not in hlo, "XLA copies a cache buffer"
        before = {n: getattr(cache, n).unsafe_buffer_pointer() for n in names}
        _, cache = step(params, cache, inputs)
        assert {n: getattr(cache, n).unsafe_buffer_pointer() for n in names} == before


def test_bitwise_repeatable():
    config = KdaConfig(heads=3, tokens=5, split=4)
    params, cache, inputs = problem(config, seed=9, edge_cases=True)
    step = kernel_step(config)
    results = [step(params, copy(cache), inputs) for _ in range(3)]
    for result in results[1:]:
        assert bits(result) == bits(results[0])


def test_untouched_slots_and_records_bitwise_unchanged():
    config = KdaConfig(heads=2, tokens=4, split=8)
    params, cache, inputs = problem(config, seed=11, edge_cases=True)
    slots, rows = np.asarray(inputs.slots), np.asarray(inputs.record_rows)
    before = jax.tree.map(np.asarray, cache)
    _, after = kernel_step(config)(params, copy(cache), inputs)
    live = (slots > 0) & (slots < NUM_SLOTS)
    used_slots = set(slots[live].tolist())
    used_rows = set(rows[live & (rows >= 0) & (rows < NUM_RECORDS)].tolist())
    for s in set(range(NUM_SLOTS)) - used_slots:
        for field in ("state", "conv"):
            assert bits(getattr(after, field)[s]) == bits(getattr(before, field)[s])
    for r in set(range(NUM_RECORDS)) - used_rows:
        for field in ("corrections", "key_gates", "pending"):
            assert bits(getattr(after, field)[r]) == bits(getattr(before, field)[r])


def torch_pytree(tree):
    torch = pytest.importorskip("torch")
    return jax.tree.map(lambda a: torch.from_dlpack(jnp.array(a, copy=True)), tree)


def test_eager_dlpack_and_cuda_graph_match_the_custom_call():
    """eager_verify on torch tensors gives the custom call's bits, directly and replayed
    from a captured CUDA graph, for one layer's cache and a stacked one."""
    torch = pytest.importorskip("torch")
    from jax_kda.ffi import eager_verify

    config = KdaConfig(heads=3, tokens=4, split=2)
    for layers in (None, 3):
        extra = {} if layers is None else {"layer": 1}
        params, cache, inputs = problem(config, seed=13, edge_cases=True, layers=layers)
        out_jax, cache_jax = kernel_step(config, **extra)(params, copy(cache), inputs)
        expected = [np.asarray(b).tobytes() for b in jax.tree.leaves((out_jax, cache_jax))]
        as_bits = lambda tree: [t.cpu().contiguous().view(torch.uint8).numpy().tobytes()
                                for t in jax.tree.leaves(tree)]
        layer = None if layers is None else torch.tensor([1], dtype=torch.int32, device="cuda")
        t_params, t_inputs = torch_pytree(params), torch_pytree(inputs)
        t_cache = torch_pytree(cache)
        t_out = torch.full(out_jax.shape, float("nan"), dtype=torch.bfloat16, device="cuda")
        eager_verify(t_params, t_cache, t_inputs, t_out, config,
                     stream=torch.cuda.current_stream(), layer=layer)
        torch.cuda.synchronize()
        assert as_bits((t_out, t_cache)) == expected

        g_cache = torch_pytree(cache)  # capture records the launch; replay runs it
        g_out = torch.full(out_jax.shape, float("nan"), dtype=torch.bfloat16, device="cuda")
        graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
        with torch.cuda.graph(graph, stream=stream):
            eager_verify(t_params, g_cache, t_inputs, g_out, config, stream=stream,
                         layer=layer)
        graph.replay()
        torch.cuda.synchronize()
        assert as_bits((g_out, g_cache)) == expected


def test_batched_ieee_math_gives_the_ieee_bits():
    """primitives.sigmoids, silus_bf16 and divided_by_roots (a branch-free fast path for a
    batch, the IEEE operations for the whole batch unless the caller's bounds hold) and
    decays (no fallback) give the bits of div.rn and sqrt.rn: random operands over wide
    ranges (past the bounds' edges: sigmoid and SiLU inputs around -64, -69 and -88,
    numerators past 2^-50 and 2^40, radicands past 2^-20 and 2^100), 3% of them any bit
    pattern (zero, denormal, huge, inf, NaN); divided_by_roots both with a floor that
    implies the radicands' bound (and radicands that keep it) and with one that does not;
    decays at the config's lower bound and at -2^60, the largest without a fallback; and
    exp of a million values below 2^-40 in magnitude, over every binade down to the
    denormals, is 1.0, which decays rely on."""
    torch = pytest.importorskip("torch")
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32
    from cutlass.cute.runtime import from_dlpack

    from jax_kda.kernels.primitives import (decays, divided_by_roots, exp, round_bf16,
                                            sigmoids, silus_bf16)

    batch, threads, blocks = 4, 128, 2048
    size = batch * threads * blocks
    bounds = (KdaConfig(heads=1, tokens=2).lower_bound, -(2.0**60))
    names = ("sigmoids", "silus_bf16", "roots, floor 0", "roots, floor 1e-6",
             *(f"decays, lower bound {b}" for b in bounds), "exp of tiny values")

    @cute.kernel
    def probe(x: cute.Tensor, v: cute.Tensor, r: cute.Tensor, rf: cute.Tensor,
              tiny: cute.Tensor, fast: cute.Tensor, ieee: cute.Tensor):
        tid, _, _ = cute.arch.thread_idx()
        block, _, _ = cute.arch.block_idx()
        first = (block * threads + tid) * batch
        xs = [x[first + i] for i in range(batch)]
        vs = [v[first + i] for i in range(batch)]
        rs = [r[first + i] for i in range(batch)]
        rfs = [rf[first + i] for i in range(batch)]
        ieee_sigmoids = [Float32(1.0) / (Float32(1.0) + exp(-a)) for a in xs]
        results = [sigmoids(xs), silus_bf16(xs), divided_by_roots(vs, rs, 0.0),
                   divided_by_roots(vs, rfs, 1e-6),
                   *(decays(xs, Float32(1.0), [Float32(0.0)] * batch, b) for b in bounds),
                   [exp(tiny[first + i]) for i in range(batch)]]
        references = [ieee_sigmoids,
                      [round_bf16(a / (Float32(1.0) + exp(-a))) for a in xs],
                      [a / cute.math.sqrt(b) for a, b in zip(vs, rs)],
                      [a / cute.math.sqrt(b) for a, b in zip(vs, rfs)],
                      *([exp(b * s) for s in ieee_sigmoids] for b in bounds),
                      [Float32(1.0)] * batch]
        for k in cutlass.range_constexpr(len(names)):
            for i in cutlass.range_constexpr(batch):
                fast[k * size + first + i] = results[k][i]
                ieee[k * size + first + i] = references[k][i]

    @cute.jit
    def launch(x: cute.Tensor, v: cute.Tensor, r: cute.Tensor, rf: cute.Tensor,
               tiny: cute.Tensor, fast: cute.Tensor, ieee: cute.Tensor):
        probe(x, v, r, rf, tiny, fast, ieee).launch(grid=(blocks, 1, 1),
                                                    block=(threads, 1, 1))

    rng = np.random.default_rng(7)

    def operands(low, high, signed, linear=None):
        values = rng.uniform(1, 2, size) * 2.0 ** rng.uniform(low, high, size)
        if signed:
            values *= rng.choice([-1.0, 1.0], size)
        if linear is not None:  # half of them uniform over [-linear, linear]
            half = rng.random(size) < 0.5
            values[half] = rng.uniform(-linear, linear, half.sum())
        values = values.astype(np.float32)
        wild = rng.random(size) < 0.03
        values[wild] = rng.integers(0, 2**32, wild.sum(), dtype=np.uint32).view(np.float32)
        return values

    x = operands(-110, 110, True, linear=100.0)
    v = operands(-60, 50, True)
    r = operands(-30, 110, False)
    rf = np.abs(operands(-30, 110, False)) + np.float32(1e-6)  # NaN stays NaN
    # |t| < 2^-40: bit patterns uniform over every binade, the denormals' included
    tiny = rng.integers(0, 0x2B800000, size, dtype=np.uint32).view(np.float32)
    tiny *= rng.choice(np.float32([-1.0, 1.0]), size)
    inputs = [torch.from_numpy(a).cuda() for a in (x, v, r, rf, tiny)]
    outputs = [torch.full((len(names) * size,), float("nan"), device="cuda")
               for _ in range(2)]
    tensors = [from_dlpack(t, assumed_align=16) for t in (*inputs, *outputs)]
    cute.compile(launch, *tensors)(*tensors)
    torch.cuda.synchronize()
    fast, ieee = (t.cpu().numpy().reshape(len(names), size) for t in outputs)
    for name, f, e in zip(names, fast, ieee):
        nan = np.isnan(e)
        np.testing.assert_array_equal(np.isnan(f), nan, err_msg=name)
        np.testing.assert_array_equal(f[~nan].view(np.uint32), e[~nan].view(np.uint32),
                                      err_msg=name)


@pytest.mark.parametrize("chunk", (16, 32, 64))
def test_chunk_kernel_matches_the_xla_scan(chunk):
    """The prefill's scan over chunks, the CuTe DSL kernel against `scan_chunks` on the
    CPU: random operands, 6 chunks of 3 requests x 3 heads, of 6 chunks' tokens, 2 and a
    part, and none, NaN in every chunk past a request's tokens (which neither scan may
    read); the state after them and o of the live chunks within 2e-5 of the largest
    entry (the kernel's products are split TF32, each within 2^-20 of its value: about
    8e-6 measured against float64), none of them NaN."""
    rng = np.random.default_rng(chunk)
    B, H, N, K = 3, 3, 6, 128
    lengths = np.array([N * chunk, 2 * chunk + 5, 0], np.int32)
    dead = np.arange(N)[None, :] >= -(-lengths[:, None] // chunk)  # [B, N]

    def normal(*shape, scale=1.0):
        values = scale * rng.standard_normal(shape)
        if len(shape) > 4:  # a chunk's operand: NaN past the request's tokens
            values[np.broadcast_to(dead[:, None], shape[:3])] = np.nan
        return jnp.asarray(values, jnp.float32)

    decay = rng.uniform(0.5, 1.0, (B, H, N, K))
    decay[np.broadcast_to(dead[:, None], (B, H, N))] = np.nan
    operands = (normal(B, H, K, K), normal(B, H, N, chunk, K),
                normal(B, H, N, chunk, K, scale=0.1), normal(B, H, N, chunk, K),
                normal(B, H, N, chunk, K, scale=0.1), jnp.asarray(decay, jnp.float32),
                jnp.tril(normal(B, H, N, chunk, chunk)), jnp.asarray(lengths))
    got = jax.jit(cutedsl_chunk_states)(*operands)
    expected = jax.jit(scan_chunks)(*jax.device_put(operands, CPU))
    live = np.broadcast_to(~dead[:, None], (B, H, N))
    for name, a, e in (("state", got[0], expected[0]),
                       ("o", np.asarray(got[1])[live], np.asarray(expected[1])[live])):
        a, e = np.asarray(a), np.asarray(e)
        assert np.all(np.isfinite(a)) and np.all(np.isfinite(e)), name
        assert np.max(np.abs(a - e)) <= 2e-5 * np.max(np.abs(e)), name


def test_chunk_operands_kernel_matches_xla():
    """The prefill's chunk operands, the CuTe DSL kernel on the layer's token-major
    tensors against `prompt_chunks.chunk_operands` of `prefill.token_vectors` on the
    CPU: 2 prompts of 200 tokens x 3 heads (a ragged last chunk, the second request
    ending at 137 with NaN past it), compared on the chunks that hold tokens (the kernel
    does not write a chunk wholly past its request's: no scan reads it). Each within
    1e-5 of its largest entry (FP32 in another order: the kernel's decays and norms,
    forward substitution where XLA multiplies by blocked inverses; 5e-5 for the solve's
    u_v and w_k, whose (I + N)^-1 amplifies the roundings by its condition), none NaN;
    Bm exactly 0 above the diagonal."""
    from jax_kda.ffi import cutedsl_chunk_operands
    from jax_kda.layer import Prompt, token_vectors
    from jax_kda.prompt_chunks import chunk_operands

    rng = np.random.default_rng(7)
    config = KdaConfig(heads=3, tokens=4)
    B, P, H, K = 2, 200, config.heads, 128
    params = random_params(jax.random.key(1), config)
    lengths = np.array([200, 137], np.int32)
    past = np.arange(P)[None, :] >= lengths[:, None]

    def bf16(*shape, scale=1.0):
        values = scale * rng.standard_normal((B, P) + shape)
        values[past] = np.nan
        return jnp.asarray(values, jnp.bfloat16)

    prompt = Prompt(y=bf16(3, H, K), raw_g=bf16(H, K, scale=2.0), beta=bf16(H),
                    lengths=jnp.asarray(lengths))
    call = jax.jit(functools.partial(cutedsl_chunk_operands, lower_bound=config.lower_bound,
                                     scale=config.query_scale))
    got = call(*prompt, params.a_log, params.dt_bias)
    # as `layer.convolved` leaves them: FP32 arrays of bf16 values
    f32 = prompt._replace(y=prompt.y.astype(jnp.float32), raw_g=prompt.raw_g.astype(jnp.float32))
    expected = jax.jit(lambda p, t: chunk_operands(*token_vectors(p, t, config),
                                                   lower_bound=config.lower_bound))(
        *jax.device_put((params, f32), CPU))
    errors = {}
    live = np.arange(-(-P // 64))[None, :] < -(-lengths[:, None] // 64)  # [B, N]
    in_live = lambda a: np.moveaxis(np.asarray(a), 1, 2)[live]  # [live chunks, H, ...]
    for name, a, e in zip(expected._fields, got, expected):
        assert a.shape == e.shape, name
        a, e = in_live(a), in_live(e)
        assert np.all(np.isfinite(a)), name
        errors[name] = float(np.max(np.abs(a - e)) / np.max(np.abs(e)))
    log("chunk_operands", "xla", errors)
    print(errors)
    allowed = {"u_v": 5e-5, "w_k": 5e-5}
    assert all(error <= allowed.get(name, 1e-5) for name, error in errors.items()), errors
    upper = np.triu(np.ones((64, 64), bool), 1)
    assert np.all(in_live(got.bm)[..., upper] == 0.0)


@pytest.mark.parametrize("conv_dtype,conv_bias", [(jnp.float32, True), (jnp.bfloat16, False)],
                         ids=["f32-bias", "bf16-nobias"])
def test_prompt_conv_kernel_matches_xla(conv_dtype, conv_bias):
    """The prefill's convolution and SiLU, the CuTe DSL kernel against `layer.convolve`
    on the CPU: 2 prompts of 75 tokens (runs of 32: a ragged last one) x 3 heads (a
    partial block of channels), a random history, NaN from token 40 of the second
    prompt. Each value a bf16 rounding of the same FP32 sum of rounded products and the
    same SiLU, but for exp and division on another device: at most one bf16 ulp apart
    (counted at no less than 2^-8 of the row's mean magnitude, as the GPU suite's keys),
    under 1% of them differing, NaN exactly where the reference has it."""
    from jax_kda.ffi import cutedsl_prompt_conv
    from jax_kda.layer import convolve

    rng = np.random.default_rng(11)
    config = KdaConfig(heads=3, tokens=4)
    B, P, H, K = 2, 75, config.heads, 128
    params = random_params(jax.random.key(2), config, conv_dtype=conv_dtype,
                           conv_bias=conv_bias)
    x = rng.standard_normal((B, P, 3, H, K))
    x[1, 40:] = np.nan
    x = jnp.asarray(x, jnp.bfloat16)
    history = jnp.asarray(rng.standard_normal((B, 3, 3, H, K)), jnp.bfloat16).astype(
        jnp.float32)
    got = np.asarray(jax.jit(cutedsl_prompt_conv)(x, history, params.conv_weight,
                                                  params.conv_bias), np.float32)
    expected = np.asarray(jax.jit(convolve)(*jax.device_put(
        (history, x, params.conv_weight, params.conv_bias), CPU)), np.float32)
    nan = np.isnan(expected)
    assert nan.any() and np.array_equal(np.isnan(got), nan)
    ulp = np.maximum(np.abs(expected), 2**-8 * np.nanmean(np.abs(expected), -1, keepdims=True))
    ulps = np.abs(got - expected)[~nan] / (2.0 ** (np.floor(np.log2(ulp[~nan])) - 7))
    differ = float(np.mean(got[~nan] != expected[~nan]))
    log("prompt_conv", "xla", {"ulps": float(ulps.max()), "differ": differ})
    assert ulps.max() <= 1 and differ <= 1e-2, (ulps.max(), differ)
