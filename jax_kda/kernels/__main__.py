"""Compile the fused verify kernel for every configuration (no GPU needed) and print a
table: registers per thread, spill (local memory) bytes, shared memory, compile seconds;
then the prefill's three kernels: the chunk scan for each chunk size it runs (16, 32, 64
tokens), the chunks' operands at the default config and the prompt's convolution.

    python -m jax_kda.kernels --arch sm_90a [--subset] [--jobs N]

Every T of 2..8, 12, 15 and 16, gate mode and split, then the operand variants (no bias;
bf16 conv and norm weights), the stacked-layer build, the lazy checkpoint
(checkpoint_every 4), the token-tree build, a bf16 state and the softplus gate on one
shape per split, checkpoint_every 2 and 8 at split 1 and 2 and 4 at T = 8 and split 2,
the tree build at T = 2, 8, 12 and 16 on every split, a bf16 state at T = 8 and in a
tree of 16 on every split, and the softplus gate at T = 8 on every split and in a tree
of 16: each but the builds the launch never takes (`backends.spilling_build`);
`--subset`: every split at tokens 2, 4 and 8.
Configurations compile in N processes (default: one per CPU). The exit status is 1 if a
configuration fails to compile or spills.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import io
import itertools
import os
import re
import sys
import time


def ptxas_usage(text):
    """(registers, spill bytes) from the ptxas report that remarks{ptx} prints."""
    regs = re.findall(r"Used (\d+) registers", text)
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    stack = re.findall(r"(\d+) bytes stack frame", text)
    if not regs or not spills:
        return None, None
    local = max(int(a) + int(b) for a, b in spills) + max(int(s) for s in stack)
    return max(map(int, regs)), local


def launch_smem_bytes(compiled):
    """Dynamic shared memory the host code passes at launch (from the lowered IR)."""
    text = str(compiled.ir_module)
    consts = dict(re.findall(r"(%\w+) = llvm\.mlir\.constant\((\d+) : i64\)", text))
    slots = re.findall(r"(%\w+) = llvm\.getelementptr %\w+\[0, 2\] : \(!llvm\.ptr\) -> "
                       r"!llvm\.ptr, !llvm\.struct<\(array<3 x i32>, array<3 x i32>, i64", text)
    for slot in slots:
        store = re.search(rf"llvm\.store (%\w+), {re.escape(slot)} : i64", text)
        if store and store.group(1) in consts:
            return int(consts[store.group(1)])
    return None


def configurations(subset, only=()):
    base = dict(has_bias=True, conv_dtype="float32", norm_dtype="float32", stacked=False,
                checkpoint_every=1, trees=False, state_dtype="float32", softplus=False)
    if only:
        for T, gate_mode, split in only:
            yield dict(base, tokens=T, gate_mode=gate_mode, split=split)
        return
    tokens = (2, 4, 8) if subset else (*range(2, 9), 12, 15, 16)
    for T, gate_mode, split in itertools.product(tokens, (0, 1), (1, 2, 4, 8)):
        yield dict(base, tokens=T, gate_mode=gate_mode, split=split)
    if not subset:  # the operand variants, stacked and lazy builds, one shape per split
        variants = [dict(has_bias=False), dict(conv_dtype="bfloat16", norm_dtype="bfloat16"),
                    dict(stacked=True), dict(checkpoint_every=4), dict(trees=True),
                    dict(state_dtype="bfloat16"), dict(softplus=True)]
        for split, variant in itertools.product((1, 2, 4, 8), variants):
            yield dict(base, tokens=4, gate_mode=0, split=split, **variant)
        for every in (2, 8):  # the shortest and the longest records of split 1
            yield dict(base, tokens=4, gate_mode=0, split=1, checkpoint_every=every)
        for every in (2, 4):  # T = 8's records past half an SM: split 2 (`kernel_split`)
            yield dict(base, tokens=8, gate_mode=0, split=2, checkpoint_every=every)
        for T, split in itertools.product((2, 8, 12, 16), (1, 2, 4, 8)):
            yield dict(base, tokens=T, gate_mode=1, split=split, trees=True)
        for split in (1, 2, 4, 8):  # a bf16 state past one shape: two rows a thread, a tree
            yield dict(base, tokens=8, gate_mode=1, split=split, state_dtype="bfloat16")
            yield dict(base, tokens=16, gate_mode=1, split=split, trees=True,
                       state_dtype="bfloat16")
        for split in (1, 2, 4, 8):
            yield dict(base, tokens=8, gate_mode=1, split=split, softplus=True)
            yield dict(base, tokens=16, gate_mode=1, split=split, trees=True, softplus=True)


def launched(heads, c) -> bool:
    """Whether the launch may take the configuration (`backends.spilling_build`)."""
    from jax_kda.backends import spilling_build

    return spilling_build(config_of(heads, c), c["split"]) is None


def config_of(heads, c):
    """The `KdaConfig` of a configuration of the table."""
    from jax_kda.config import KdaConfig

    return KdaConfig(heads=heads, tokens=c["tokens"], gate_mode=c["gate_mode"],
                     checkpoint_every=c["checkpoint_every"], trees=c["trees"],
                     state_dtype=c["state_dtype"],
                     **({"lower_bound": None} if c["softplus"] else {}))


def compile_one(arch, heads, c):
    """One row of the table: (configuration, regs, local bytes, smem, seconds, status)."""
    from jax_kda.kernels import FusedVerify

    config = config_of(heads, c)
    return (c, *measured(arch, lambda: FusedVerify(
        config, c["split"], c["has_bias"], conv_dtype=c["conv_dtype"],
        norm_dtype=c["norm_dtype"], stacked=c["stacked"])))


def compile_chunk_kernel(arch, chunk):
    """The chunk kernel's row: (chunk, regs, local bytes, smem, seconds, status)."""
    from jax_kda.kernels import ChunkStates

    return (chunk, *measured(arch, lambda: ChunkStates(chunk)))


def compile_operands_kernel(arch):
    """The operands kernel's row at the default lower_bound and scale."""
    from jax_kda.config import KdaConfig
    from jax_kda.kernels import ChunkOperands

    config = KdaConfig(heads=1, tokens=2)  # the defaults of lower_bound and scale
    return measured(arch, lambda: ChunkOperands(config.lower_bound, config.query_scale))


def compile_conv_kernel(arch):
    """The prompt convolution kernel's row."""
    from jax_kda.kernels import PromptConvolution

    return measured(arch, PromptConvolution)


def measured(arch, kernel):
    """(regs, local bytes, smem, seconds, status) of compiling kernel() for `arch` with
    ptxas' report on."""
    from jax_kda.kernels import compiled

    report = io.StringIO()
    start = time.perf_counter()
    try:
        with contextlib.redirect_stderr(report):
            binary = compiled(kernel(), "remarks{ptx}", arch)
        regs, local = ptxas_usage(report.getvalue())
        smem = launch_smem_bytes(binary)
        status = "ok" if local == 0 else "SPILLS" if local else "NO REPORT"
    except Exception as error:  # noqa: BLE001 - the DSL raises its own classes
        regs = local = smem = None
        status = f"FAILED: {type(error).__name__}: {str(error).splitlines()[0][:80]}"
    return regs, local, smem, time.perf_counter() - start, status


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m jax_kda.kernels", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", default="sm_90a", help="target (default sm_90a)")
    parser.add_argument("--subset", action="store_true", help="every split at T = 2, 4, 8")
    parser.add_argument("--heads", type=int, default=4, help="H of every configuration")
    parser.add_argument("--jobs", type=int, default=os.cpu_count(),
                        help="compiles in parallel (default: one per CPU)")
    parser.add_argument("--only", action="append", default=[], metavar="T,GATE,SPLIT",
                        type=lambda text: tuple(int(v) for v in text.split(",")),
                        help="compile just this configuration (repeatable)")
    args = parser.parse_args(argv)
    print(f"{'T':>2} {'gate':>4} {'split':>5} {'bias':>5} {'conv':>8} {'norm':>8} "
          f"{'stack':>5} {'every':>5} {'tree':>5} {'state':>8} {'forget':>8} {'regs':>4} "
          f"{'local':>5} {'smem':>6} {'secs':>5}  status",
          flush=True)
    failed = 0
    work = [c for c in configurations(args.subset, args.only)
            if args.only or launched(args.heads, c)]
    with concurrent.futures.ProcessPoolExecutor(max(1, min(args.jobs, len(work)))) as pool:
        for c, regs, local, smem, seconds, status in pool.map(
                compile_one, [args.arch] * len(work), [args.heads] * len(work), work):
            failed += status != "ok"
            print(f"{c['tokens']:>2} {c['gate_mode']:>4} {c['split']:>5} "
                  f"{str(c['has_bias']):>5} {c['conv_dtype']:>8} {c['norm_dtype']:>8} "
                  f"{str(c['stacked']):>5} {c['checkpoint_every']:>5} "
                  f"{str(c['trees']):>5} {c['state_dtype']:>8} "
                  f"{'softplus' if c['softplus'] else 'sigmoid':>8} {regs!s:>4} "
                  f"{local!s:>5} {smem!s:>6} {seconds:5.1f}  {status}", flush=True)
    if not args.only:
        with concurrent.futures.ProcessPoolExecutor(max(1, min(args.jobs, 3))) as pool:
            for chunk, regs, local, smem, seconds, status in pool.map(
                    compile_chunk_kernel, [args.arch] * 3, (16, 32, 64)):
                failed += status != "ok"
                print(f"prefill chunk kernel, chunk {chunk:>2}: regs {regs} local {local} "
                      f"smem {smem} {seconds:5.1f} s  {status}", flush=True)
            regs, local, smem, seconds, status = pool.submit(
                compile_operands_kernel, args.arch).result()
            failed += status != "ok"
            print(f"prefill operands kernel: regs {regs} local {local} smem {smem} "
                  f"{seconds:5.1f} s  {status}", flush=True)
            regs, local, smem, seconds, status = pool.submit(
                compile_conv_kernel, args.arch).result()
            failed += status != "ok"
            print(f"prefill convolution kernel: regs {regs} local {local} smem {smem} "
                  f"{seconds:5.1f} s  {status}", flush=True)
    print(f"{failed} configurations failed or spilled" if failed else "all compiled, no spills")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
