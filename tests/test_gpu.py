"""The fused CuTe DSL kernel on a Hopper GPU (marker `gpu`), against both JAX references
(`chunked_verify`, `stock_verify`) over multi-step speculative episodes, with every edge
case of SPEC.md; in place under jit with donation; in a CUDA graph; bitwise repeatable;
the eager DLPack path identical to the custom call.

Skipped without a GPU of compute capability >= 9.0 or without nvidia-cutlass-dsl. Set
KDA_GPU_LOG=path to append each comparison's worst errors (tests/GPU_RESULTS.md).
"""
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_kda import KdaCache, KdaConfig, accept, fused_verify
from jax_kda.reference import chunked_verify, stock_verify
from jax_kda.testing import random_accepted, random_cache, random_inputs, random_params
from jax_kda.verify import cutedsl_supported
from poison import poison

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
# projection, whose accumulation order is not XLA's) that can cancel to a value far
# below their terms, where FP32 noise is several ulps of the tiny result (seen on the
# H200: up to 6 at |raw gate| << mean); "key_flips" the fraction that differ.
# The window and pending are copies: exact.
TOLERANCES = {"out": 4 * 2**-8, "state": 2e-5, "corrections": 2**-6, "keys": 1,
              "key_flips": 1e-2, "window": 0, "pending": 0}
NUM_SLOTS, NUM_RECORDS, STEPS = 9, 7, 3
# The references run on the CPU: XLA on the GPU drops f32 -> bf16 -> f32 round trips
# (xla_allow_excess_precision), i.e. the stock roundings of q, v, raw gates and o_t.
CPU = jax.devices("cpu")[0]

stock_jit = jax.jit(stock_verify, static_argnames="config")


def kernel_step(config):
    return jax.jit(functools.partial(fused_verify, config=config, backend="cutedsl"),
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


def problem(config, seed, edge_cases):
    """Random weights, cache and one step's inputs of a batch (see `batch`)."""
    key = jax.random.key(seed)
    slots, rows = batch(np.random.default_rng(seed), edge_cases)
    return (random_params(key, config),
            random_cache(jax.random.fold_in(key, 1), config, NUM_SLOTS, NUM_RECORDS),
            random_inputs(jax.random.fold_in(key, 2), config, slots, rows))


def copy(tree):
    return jax.tree.map(lambda a: None if a is None else jnp.array(a, copy=True), tree)


def errors(out, cache, out_ref, cache_ref):
    """The worst error of each quantity, in TOLERANCES' units."""
    f32 = lambda a: np.asarray(a, np.float32)
    a, e = f32(out), f32(out_ref)
    row_scale = np.abs(e) + np.mean(np.abs(e), axis=-1, keepdims=True) + 1e-30
    rel = lambda x, y: float(np.nanmax(np.abs(f32(x) - f32(y))) / np.nanmax(np.abs(f32(y))))
    keys_a, keys_e = f32(cache.key_gates), f32(cache_ref.key_gates)
    ulp = 2.0**-7 * (np.abs(keys_e) + 2.0**-8 * np.nanmean(np.abs(keys_e), -1, keepdims=True))
    differ = ~((keys_a == keys_e) | (np.isnan(keys_a) & np.isnan(keys_e)))
    return {
        "out": float(np.max(np.abs(a - e) / row_scale)),
        "state": rel(cache.state[1:], cache_ref.state[1:]),
        "corrections": rel(cache.corrections, cache_ref.corrections),
        "keys": float(np.nanmax(np.where(differ, np.abs(keys_a - keys_e) / ulp, 0.0))),
        "key_flips": float(np.mean(differ)),
        "window": int(np.sum(~((f32(cache.conv) == f32(cache_ref.conv))
                               | np.isnan(f32(cache_ref.conv))))),
        "pending": int(np.sum(np.asarray(cache.pending) != np.asarray(cache_ref.pending))),
    }


def log(case, reference, worst):
    path = os.environ.get("KDA_GPU_LOG")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"case": case, "reference": reference, **worst}) + "\n")


def check(case, reference, out, cache, out_ref, cache_ref, zero_rows, slack=0.0):
    """Every quantity within TOLERANCES (plus `slack` on "out")."""
    worst = errors(out, cache, out_ref, cache_ref)
    log(case, reference, worst)
    assert not np.any(np.isnan(np.asarray(out, np.float32))), f"{case}: NaN in out"
    assert np.all(np.asarray(out, np.float32)[zero_rows] == 0), f"{case}: padding row not 0"
    bad = {k: v for k, v in worst.items() if v > TOLERANCES[k] + (slack if k == "out" else 0)}
    assert not bad, f"{case} vs {reference}: {bad} (tolerances {TOLERANCES})"


def run_episode(config, seed, *, conv_dtype=jnp.float32, norm_dtype=jnp.float32,
                conv_bias=True, edge_cases=True, pending_shift=0):
    """STEPS verifies of the kernel with random accepted counts in between; before each,
    both references run on the CPU from the kernel's cache, so that every step is checked
    alone (the records' bf16 flips do not compound into the next step's checkpoint)."""
    rng = np.random.default_rng(seed)
    key = jax.random.key(seed)
    params = random_params(jax.random.fold_in(key, 0), config, conv_dtype=conv_dtype,
                           conv_bias=conv_bias, norm_dtype=norm_dtype)
    cache = random_cache(jax.random.fold_in(key, 1), config, NUM_SLOTS, NUM_RECORDS)
    if pending_shift:  # out-of-range pending counts, clamped to [0, RQ]
        cache = KdaCache(cache.state, cache.conv, cache.corrections, cache.key_gates,
                         cache.pending + pending_shift)
    slots, rows = batch(rng, edge_cases)
    zero_rows = ~((np.asarray(slots) > 0) & (np.asarray(slots) < NUM_SLOTS))
    step = kernel_step(config)
    case = (f"T{config.tokens} RQ{config.rq} gate{config.gate_mode} split{config.split} "
            f"{jnp.dtype(conv_dtype).name}/{jnp.dtype(norm_dtype).name} bias={conv_bias} "
            f"seed{seed}")
    cache = poison(cache, config)
    for s in range(STEPS):
        inputs = random_inputs(jax.random.fold_in(key, 10 + s), config, slots, rows)
        on_cpu = jax.device_put((params, cache, inputs), CPU)
        out_ref, cache_ref = chunked_verify(*on_cpu, config)
        out_stock, cache_stock = stock_jit(*on_cpu, config)
        out, cache = step(params, cache, inputs)
        # The chunked form (the kernel's) is itself off the stock loop where o_t cancels
        # (large u_s, T x T solve): the kernel may be that much further from stock.
        drift = errors(out_ref, cache_ref, out_stock, cache_stock)["out"]
        log(f"{case} step{s}", "chunked_vs_stock", {"out": drift})
        check(f"{case} step{s}", "chunked", out, cache, out_ref, cache_ref, zero_rows)
        check(f"{case} step{s}", "stock", out, cache, out_stock, cache_stock, zero_rows,
              slack=drift)
        accepted = random_accepted(rng, rows, config.tokens)
        cache = poison(accept(cache, rows, accepted), config)


CONFIGS = [(T, g, split) for T in range(2, 9) for g in (0, 1) for split in (1, 2, 4, 8)]


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
    """record_tokens > tokens, pending beyond RQ (clamped) and negative (0)."""
    config = KdaConfig(heads=2, tokens=3, record_tokens=6, split=split, lower_bound=-3.0,
                       scale=0.1, eps=1e-4)
    run_episode(config, seed=31, pending_shift=5)
    run_episode(config, seed=32, pending_shift=-4)


def test_split_none_and_one_head():
    run_episode(KdaConfig(heads=1, tokens=4), seed=41)


def test_crowded_grid():
    """The kernel requests a CTA's state rows with its small operands in a crowded grid
    (T <= 4, more than CROWDED_CTAS_PER_SM CTAs per SM) and after them otherwise; every
    other test's grid is small. H = 32 at split 8 gives the batch of 6 1536 CTAs."""
    from jax_kda.ffi.call import sm_count
    from jax_kda.kernels.fused import CROWDED_CTAS_PER_SM
    config = KdaConfig(heads=32, tokens=4, split=8)
    assert 6 * config.heads * config.split > CROWDED_CTAS_PER_SM * sm_count()
    run_episode(config, seed=53)


def test_in_place_under_jit_with_donation():
    """Same buffers after a donated jitted step, and no copy in the compiled HLO."""
    config = KdaConfig(heads=4, tokens=4, split=2)
    params, cache, inputs = problem(config, seed=5, edge_cases=False)
    step = kernel_step(config)
    hlo = step.lower(params, cache, inputs).compile().as_text()
    assert "copy(" not in hlo and "copy-start" not in hlo, "XLA copies a cache buffer"
    names = ("state", "conv", "corrections", "key_gates")
    before = {n: getattr(cache, n).unsafe_buffer_pointer() for n in names}
    _, cache = step(params, cache, inputs)
    after = {n: getattr(cache, n).unsafe_buffer_pointer() for n in names}
    assert after == before


def test_bitwise_repeatable():
    config = KdaConfig(heads=3, tokens=5, split=4)
    params, cache, inputs = problem(config, seed=9, edge_cases=True)
    step = kernel_step(config)
    results = [step(params, copy(cache), inputs) for _ in range(3)]
    for out, c in results[1:]:
        for a, b in zip(jax.tree.leaves((out, c)), jax.tree.leaves(results[0])):
            np.testing.assert_array_equal(np.asarray(a).view(np.uint8),
                                          np.asarray(b).view(np.uint8))


def test_untouched_slots_and_records_bitwise_unchanged():
    config = KdaConfig(heads=2, tokens=4, split=8)
    params, cache, inputs = problem(config, seed=11, edge_cases=True)
    slots, rows = inputs.slots, inputs.record_rows
    before = jax.tree.map(np.asarray, cache)
    _, after = kernel_step(config)(params, copy(cache), inputs)
    live = (np.asarray(slots) > 0) & (np.asarray(slots) < NUM_SLOTS)
    used_slots = set(np.asarray(slots)[live].tolist())
    used_rows = set(np.asarray(rows)[live & (np.asarray(rows) >= 0)
                                     & (np.asarray(rows) < NUM_RECORDS)].tolist())
    for s in set(range(NUM_SLOTS)) - used_slots:
        np.testing.assert_array_equal(np.asarray(after.state[s]), before.state[s])
        np.testing.assert_array_equal(np.asarray(after.conv[s]).view(np.uint16),
                                      before.conv[s].view(np.uint16))
    for r in set(range(NUM_RECORDS)) - used_rows:
        np.testing.assert_array_equal(np.asarray(after.corrections[r]), before.corrections[r])
        np.testing.assert_array_equal(np.asarray(after.key_gates[r]).view(np.uint16),
                                      before.key_gates[r].view(np.uint16))


def torch_pytree(tree):
    torch = pytest.importorskip("torch")
    return jax.tree.map(lambda a: torch.from_dlpack(jnp.array(a, copy=True)), tree)


def test_eager_dlpack_and_cuda_graph_match_the_custom_call():
    """eager_verify on torch tensors gives the custom call's bits, directly and replayed
    from a captured CUDA graph."""
    torch = pytest.importorskip("torch")
    from jax_kda.ffi import eager_verify

    config = KdaConfig(heads=3, tokens=4, split=2)
    params, cache, inputs = problem(config, seed=13, edge_cases=True)
    out_jax, cache_jax = kernel_step(config)(params, copy(cache), inputs)
    expected = jax.tree.map(np.asarray, (out_jax, cache_jax))

    def bits(tree):
        return [t.cpu().view(torch.uint8).numpy() if t.dtype == torch.bfloat16
                else t.cpu().numpy() for t in jax.tree.leaves(tree)]

    t_params, t_inputs = torch_pytree(params), torch_pytree(inputs)
    t_cache = torch_pytree(cache)
    t_out = torch.full(out_jax.shape, float("nan"), dtype=torch.bfloat16, device="cuda")
    eager_verify(t_params, t_cache, t_inputs, t_out, config,
                 stream=torch.cuda.current_stream())
    torch.cuda.synchronize()
    for a, b in zip(bits((t_out, t_cache)), jax.tree.leaves(expected)):
        np.testing.assert_array_equal(a, b.view(np.uint8) if b.dtype == jnp.bfloat16 else b)

    g_cache = torch_pytree(cache)  # capture records the launch; replay runs it
    g_out = torch.full(out_jax.shape, float("nan"), dtype=torch.bfloat16, device="cuda")
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.graph(graph, stream=stream):
        eager_verify(t_params, g_cache, t_inputs, g_out, config, stream=stream)
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(bits((g_out, g_cache)), jax.tree.leaves(expected)):
        np.testing.assert_array_equal(a, b.view(np.uint8) if b.dtype == jnp.bfloat16 else b)


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
