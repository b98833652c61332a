"""Where the example's decode step spends its GPU time, kernel by kernel: the example's
engine at a size (Kimi-Linear's by default), its full batch prefilled, then `--steps`
decode steps under JAX's profiler; each kernel name's time per step and launches per
step, summed by kind: jax-kda's kernels, XLA's matmuls (its GEMM fusions and library
calls), and XLA's other fusions and copies. With `--prefill` the same of a full batch's
prefill (`--steps` of them, each of the calls an admission of B fresh prompts makes).
With `--hlo FILE` the compiled step's HLO text (the prefill's: its block program's) is
written there, to tell which matmul a fusion's name is.

    python benchmarks/step_kernels.py [--layers 20 --heads 32 --dim 2304 --batch 16]
        [--steps 10] [--prefill] [--top 25] [--compile-cache DIR] [--hlo step.hlo.txt]

On a GPU only: elsewhere the profiler's trace holds no device activity, and it says so.
"""
from __future__ import annotations

import argparse
import collections
import pathlib
import sys

from kimi_example import add_size_flags, load_example, model_config

MATMUL_NAMES = ("gemm", "cublas", "cutlass", "nvjet", "dot")  # how matmul kernels are named


def kind(name: str) -> str:
    """A kernel's kind, by its name: "jax-kda", "matmul" or "other"."""
    from jax_kda.profiling import OURS

    if name.startswith(OURS):
        return "jax-kda"
    return "matmul" if any(word in name.lower() for word in MATMUL_NAMES) else "other"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_size_flags(parser, batch=16)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--prefill", action="store_true",
                        help="a full batch's prefill, not the decode step")
    parser.add_argument("--top", type=int, default=25, help="kernel names listed")
    parser.add_argument("--compile-cache", default=None)
    parser.add_argument("--hlo", default=None, help="where the compiled step's HLO goes")
    args = parser.parse_args(argv)

    import jax
    import numpy as np

    import jax_kda
    from jax_kda.profiling import traced_kernels

    example = load_example()
    if args.compile_cache:
        jax_kda.enable_compile_cache(args.compile_cache)
    config = model_config(example, args)
    engine = example.Engine(example.init_model(0, config), config, args.batch,
                            args.max_prompt)
    prompts = example.random_prompts(0, args.batch, args.max_prompt, config.vocab)
    first, _ = engine.prefill(prompts)
    live = np.ones(args.batch, bool)

    def run():
        if args.prefill:  # each prefill reads its first tokens back: the calls end there
            for _ in range(args.steps):
                engine.prefill(prompts)
            return
        last = first
        for _ in range(args.steps):
            results = engine.decode(last, live)
            last = results[3]
        jax.block_until_ready(results)

    run()  # compiled and warm
    kernels = traced_kernels(run)
    if args.hlo:
        program = max(engine.prefills.items())[1].block if args.prefill else engine._decode
        pathlib.Path(args.hlo).write_text(program.as_text())
    if not kernels:
        print(f"no GPU activity in the trace on {jax.default_backend()}: a GPU only")
        return 0
    us, launches = collections.Counter(), collections.Counter()
    for kernel in kernels:
        us[kernel.name] += 1e-3 * (kernel.end_ns - kernel.start_ns) / args.steps
        launches[kernel.name] += 1 / args.steps
    span = 1e-3 * (max(k.end_ns for k in kernels) - kernels[0].start_ns) / args.steps
    what = "prefill" if args.prefill else "step"
    print(f"{config.layers} layers of {config.heads} heads, dim {config.dim}, B = "
          f"{args.batch}, T = {config.tokens} on {jax.devices()[0].device_kind}: "
          f"{sum(launches.values()):.0f} kernels a {what}, {span:.1f} us a {what} from "
          f"the first one's start to the last one's end (mean of {args.steps})")
    kinds, counts = collections.Counter(), collections.Counter()
    for name in us:
        kinds[kind(name)] += us[name]
        counts[kind(name)] += launches[name]
    for name, total in kinds.most_common():
        print(f"  {name:8} {total:9.1f} us a {what} in {counts[name]:.0f} kernels")
    print(f"{'us a ' + what:>10} {'launches':>8}  kernel")
    for name, total in us.most_common(args.top):
        print(f"{total:10.2f} {launches[name]:8.1f}  {name[:100]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
