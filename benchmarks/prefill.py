"""The prefill section of the benchmark: one layer (H = 32, K = 128) over prompts of
B x L tokens, ours against flash-linear-attention's `chunk_kda` in the same process.

- ours: `jax_kda.prefill`, the whole layer (short convolutions, gate projection, the
  recurrence in chunks, the gated norm), jitted with the cache donated; `compile_s` the
  first lower + compile at that shape;
- fla: `chunk_kda` on the same prompts' q, k, v after the convolution, with the gate,
  beta's sigmoid and the q / k norms in its kernel (`use_gate_in_kernel`; the sigmoid
  gate as a safe gate at the same lower bound, or the softplus gate), the final state
  out.

Both timed two ways, medians: `us`, the GPU's time of a call (ours: the span of its
activities in JAX's profiler trace; fla: CUDA events around it), and `wall_us`, the
host's wall time of a call that blocks until it is done (what one call costs a
program that waits for it: launches and dispatch included).

With `--ragged`, the B prompts of a point are of lengths drawn uniformly from 1..L
(the same for both): ours padded to L tokens (`PrefillInputs.lengths`), fla's packed
into one sequence (`cu_seqlens`), as a server batches prompts of different lengths.

Each row: impl, B, L, tokens (the prompts' in all), us, wall_us, tokens_per_s (tokens
by us), compile_s (ours), or error; with `--profile` also `kernels`, the GPU time of one
call by kernel name (the commonest first). Run by bench.py; alone:

    python benchmarks/prefill.py --json prefill.json [--points 1x1024,1x4096,...] [--profile]
        [--gate softplus] [--ragged]
"""
from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU
os.environ.setdefault("FLA_DISABLE_BACKEND_DISPATCH", "1")  # fla's Triton kernels only

import functools
import itertools
import statistics
import sys
import time

import jax
import jax.numpy as jnp

import measure  # benchmarks/, on sys.path as the script's folder
import peers
from jax_kda import KdaConfig, PrefillInputs, prefill
from jax_kda.testing import random_cache, random_params

POINTS = ((1, 1024), (1, 4096), (1, 16384), (8, 2048))
CALLS = 5  # timed calls per point, after one warm-up


def prompt_lengths(B: int, L: int, ragged: bool) -> list:
    """The B prompts' lengths: L, or with `ragged` drawn uniformly from 1..L (seeded)."""
    if not ragged:
        return [L] * B
    return [int(n) for n in jax.random.randint(jax.random.key(B * L), (B,), 1, L + 1)]


def prompts(config: KdaConfig, B: int, L: int, seed: int, lengths=None) -> PrefillInputs:
    """B random prompts of L tokens (or of `lengths`, padded to L) at slots 1..B, record
    rows 0..B-1."""
    k = jax.random.split(jax.random.key(seed), 4)
    H = config.heads
    bf16 = lambda i, shape: jax.random.normal(k[i], shape).astype(jnp.bfloat16)
    slots = jnp.arange(1, B + 1, dtype=jnp.int32)
    return PrefillInputs(x=bf16(0, (B, L, 3, H, 128)), f_a=bf16(1, (B, L, 128)),
                         beta=bf16(2, (B, L, H)), gate=bf16(3, (B, L, H, 128)),
                         lengths=jnp.asarray(lengths or [L] * B, jnp.int32), slots=slots,
                         record_rows=slots - 1)


def by_kernel(kernels, top: int = 12) -> dict:
    """[(name, ns)] -> the `top` names of most GPU time, in us, and the rest as "other"."""
    totals = {}
    for name, ns in kernels:
        totals[name[:80]] = totals.get(name[:80], 0) + ns * 1e-3
    ranked = sorted(totals.items(), key=lambda item: -item[1])
    rest = sum(us for _, us in ranked[top:])
    return {**dict(ranked[:top]), **({"other": rest} if rest else {})}


def ours(config: KdaConfig, B: int, L: int, lengths: list, profile: bool = False) -> dict:
    params = random_params(jax.random.key(1), config)
    cache = random_cache(jax.random.key(2), config, B + 1, B)
    inputs = jax.block_until_ready(prompts(config, B, L, 3, lengths))
    step = jax.jit(functools.partial(prefill, config=config), donate_argnums=1)
    start = time.perf_counter()
    compiled = step.lower(params, cache, inputs).compile()
    compile_s = time.perf_counter() - start
    from jax_kda.profiling import traced_kernels, traced_steps

    def call():
        nonlocal cache
        out, cache = compiled(params, cache, inputs)
        jax.block_until_ready((out, cache))

    def calls():
        nonlocal cache
        for _ in range(CALLS):
            out, cache = compiled(params, cache, inputs)
        jax.block_until_ready((out, cache))

    call()
    wall = wall_us(call)
    # without a GPU (the CPU dry run) nothing is traced: the wall time stands in
    row = dict(us=traced_steps(calls, CALLS).get("step_us", wall), wall_us=wall,
               compile_s=compile_s)
    if profile:
        row["kernels"] = by_kernel((k.name, k.end_ns - k.start_ns)
                                   for k in traced_kernels(call))
    return row


def wall_us(call) -> float:
    """Median wall microseconds of `call()`, which blocks until its work is done."""
    times = []
    for _ in range(CALLS):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return 1e6 * statistics.median(times)


def fla(config: KdaConfig, B: int, L: int, lengths: list, torch, profile: bool = False
        ) -> dict:
    from fla.ops.kda import chunk_kda

    H, device = config.heads, "cuda"
    g = torch.Generator(device=device).manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, device=device, generator=g,
                                      dtype=torch.bfloat16)
    packed = lengths != [L] * B  # one sequence of the prompts, split by cu_seqlens
    rows, width = (1, sum(lengths)) if packed else (B, L)
    q, k, v, gate = (rand(rows, width, H, 128) for _ in range(4))
    beta = rand(rows, width, H)
    cu_seqlens = (torch.tensor([0, *itertools.accumulate(lengths)], device=device)
                  if packed else None)
    a_log = torch.log(torch.empty(H, device=device).uniform_(1, 16, generator=g))
    dt_bias = 0.5 * torch.randn(H * 128, device=device, generator=g)
    call = lambda: chunk_kda(q, k, v, gate, beta, scale=config.query_scale,
                             output_final_state=True, use_qk_l2norm_in_kernel=True,
                             use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                             safe_gate=config.lower_bound is not None,
                             lower_bound=config.lower_bound,
                             A_log=a_log, dt_bias=dt_bias, cu_seqlens=cu_seqlens)
    call()
    torch.cuda.synchronize()

    def blocked():
        call()
        torch.cuda.synchronize()
    row = dict(us=1e6 * measure.torch_event_times(torch, lambda i: call(), 1, CALLS),
               wall_us=wall_us(blocked))
    if profile:  # JAX's trace sees every CUDA kernel of the process (torch's profiler
        # would take CUPTI from JAX's for the rest of the run)
        from jax_kda.profiling import traced_kernels

        row["kernels"] = by_kernel((k.name, k.end_ns - k.start_ns)
                                   for k in traced_kernels(blocked))
    return row


def run(args) -> list:
    config = KdaConfig(heads=args.heads, tokens=4,
                       **({"lower_bound": None} if args.gate == "softplus" else {}))
    torch = peers.torch_or_none()
    fla_why = peers.fla_unavailable(torch)
    budget = measure.Budget(args.budget_s, reserve_s=5.0)
    rows = []
    for B, L in args.points:
        lengths = prompt_lengths(B, L, args.ragged)
        for impl in ("ours", "fla"):
            row = dict(impl=impl, B=B, L=L, tokens=sum(lengths))
            if not budget.allows(0.0):
                row["skipped"] = f"budget ({budget.left():.0f} s left)"
            elif impl == "fla" and fla_why:
                row["skipped"] = fla_why
            else:
                try:
                    row.update(ours(config, B, L, lengths, args.profile) if impl == "ours"
                               else fla(config, B, L, lengths, torch, args.profile))
                    row["tokens_per_s"] = sum(lengths) / (row["us"] * 1e-6)
                except Exception as error:  # noqa: BLE001 - out of memory, a missing kernel
                    row["error"] = f"{type(error).__name__}: {str(error)[:300]}"
            measure.emit(rows, row, args.json)
    return rows


def parse(argv):
    parser = measure.section_parser(__doc__)
    parser.add_argument("--heads", type=int, default=measure.KIMI_HEADS)
    parser.add_argument("--points", type=measure.points, default=list(POINTS),
                        help="BxL prompts (default 1x1024,1x4096,1x16384,8x2048)")
    parser.add_argument("--profile", action="store_true",
                        help="also trace one call of each: GPU time by kernel name")
    parser.add_argument("--budget-s", type=float, default=600.0,
                        help="no new point is started past it")
    parser.add_argument("--gate", choices=("sigmoid", "softplus"), default="sigmoid",
                        help="the forget gate: the sigmoid gate at KdaConfig's default "
                             "lower_bound, or the softplus gate (lower_bound None, "
                             "Kimi-Linear's)")
    parser.add_argument("--ragged", action="store_true",
                        help="prompts of lengths drawn from 1..L, padded (ours) or packed "
                             "(fla)")
    return parser.parse_args(argv)


if __name__ == "__main__":
    run(parse(sys.argv[1:]))
