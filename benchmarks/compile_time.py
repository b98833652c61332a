"""Where the example's cold start goes: its decode step and its prefill (at a full
batch's rows) traced, their CuTe DSL kernels compiled (`jax_kda.compile_kernels`, where
the kernels run), lowered and compiled by XLA, per form of the model and per XLA compile
option, each pair in a process of its own with every cache off; on a GPU also the
decode step's time (median GPU time per step from JAX's profiler trace, and jax-kda's
kernels' share of it). The forms:

- stacked: the example's, the KDA params and one cache stacked, the blocks' other
  weights per layer;
- list: per-layer KDA params and caches (the example's `--layer-list`).

    python benchmarks/compile_time.py [--layers 20 --heads 32 --dim 2304 --batch 1]
        [--forms stacked,list] [--options default,no_triton_gemm] [--json out.json]

The options (`OPTIONS`) other than "default" are XLA's GPU compile options; on a CPU
only "default" runs.
"""
from __future__ import annotations

import argparse
import functools
import json
import pathlib
import subprocess
import sys
import time

from kimi_example import add_size_flags, load_example, model_config

OPTIONS = {  # name: XLA compile options
    "default": {},
    "no_triton_gemm": {"xla_gpu_enable_triton_gemm": False},  # cuBLAS, no Triton GEMMs
    "autotune_0": {"xla_gpu_autotune_level": 0},  # nothing autotuned
}
STEPS = 20  # decode steps under the profiler


def stages(jitted, args, options: dict) -> tuple[dict, object]:
    """Seconds of trace, kernels (compiled ahead in processes, where they run), lower and
    XLA's compile of jitted(*args); and the compiled program."""
    import jax_kda

    times, tick = {}, time.perf_counter()
    traced = jitted.trace(*args)
    times["trace_s"], tick = time.perf_counter() - tick, time.perf_counter()
    times["kernels"] = jax_kda.compile_kernels(traced) if jax_kda.cutedsl_supported() else 0
    times["kernels_s"], tick = time.perf_counter() - tick, time.perf_counter()
    lowered = traced.lower()
    times["lower_s"], tick = time.perf_counter() - tick, time.perf_counter()
    compiled = lowered.compile(compiler_options=options)
    times["xla_s"] = time.perf_counter() - tick
    return times, compiled


def one(args) -> dict:
    """One (form, option): the decode step's and the prefill's stages, and on a GPU the
    decode step's time."""
    import jax
    import numpy as np

    import jax_kda
    from jax_kda.profiling import traced_steps

    example = load_example()
    config = model_config(example, args)
    model = example.init_model(0, config)
    B, L = args.batch, config.layers
    if args.form == "list":
        model = example.unstacked(model, config)
        cache = [jax_kda.init_cache(config.kda, B + 1, B) for _ in range(L)]
    else:
        cache = jax_kda.init_cache(config.kda, B + 1, B, layers=L)
    options = OPTIONS[args.option]
    row = dict(form=args.form, option=args.option, batch=B, device=jax.devices()[0].device_kind)
    slots, rows = example.indices(np.arange(B))
    last = np.zeros(B, np.int32)
    decode = jax.jit(functools.partial(example.decode_step, config=config, backend="auto"),
                     donate_argnums=1)
    times, step = stages(decode, (model, cache, last, slots, rows), options)
    row.update({f"decode_{k}": v for k, v in times.items()})
    piece = example.round_up(min(args.max_prompt, example.PREFILL_PIECE))
    prompts = example.prefill_args(model, cache, B, piece,
                                   example.prefill_resumes(B, args.max_prompt, piece))
    for program, program_args in zip(example.prefill_programs(config), prompts):
        times, _ = stages(program, program_args, options)
        for k, v in times.items():  # the prefill's programs summed
            row[f"prefill_{k}"] = row.get(f"prefill_{k}", 0) + v
    if jax.default_backend() == "gpu":
        held = {"cache": cache}

        def run():
            for _ in range(STEPS):
                held["cache"], *out = step(model, held["cache"], last, slots, rows)
            jax.block_until_ready(out)

        run()
        traced = traced_steps(run, STEPS)
        row.update(step_us=traced.get("step_us"), ours_us=traced.get("ours_us"),
                   kernels=traced.get("kernels"))
    return row


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_size_flags(parser, batch=1)
    parser.add_argument("--forms", default="stacked,list")
    parser.add_argument("--options", default="default,no_triton_gemm")
    parser.add_argument("--json", default=None)
    parser.add_argument("--form", help=argparse.SUPPRESS)  # one pair, in this process
    parser.add_argument("--option", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.form:
        print(json.dumps(one(args)), flush=True)
        return 0
    import jax

    options = args.options.split(",")
    unknown = [o for o in options if o not in OPTIONS]
    if unknown:
        parser.error(f"--options: expected names of {list(OPTIONS)}, got {unknown}")
    if jax.default_backend() != "gpu" and options != ["default"]:
        print(f"on {jax.default_backend()} only the default options run (the others are "
              f"XLA's GPU options)")
        options = ["default"]
    shared = [f"--{k.replace('_', '-')}={getattr(args, k)}"
              for k in ("layers", "heads", "dim", "vocab", "tokens", "batch", "max_prompt")]
    rows = []
    for form in args.forms.split(","):
        for option in options:
            child = subprocess.run([sys.executable, __file__, *shared, f"--form={form}",
                                    f"--option={option}"], capture_output=True, text=True)
            lines = [line for line in child.stdout.splitlines() if line.startswith("{")]
            if child.returncode or not lines:
                print(f"{form}, {option}: failed\n{child.stderr[-2000:]}")
                continue
            rows.append(json.loads(lines[-1]))
            print(json.dumps(rows[-1]), flush=True)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(rows, indent=1))
    print(f"\n{'form':<8} {'option':<15} {'decode: trace':>13} {'kernels':>8} {'lower':>6} "
          f"{'XLA':>6} | {'prefill: trace':>14} {'kernels':>8} {'lower':>6} {'XLA':>6} | "
          f"{'step us':>8} {'ours us':>8}")
    for r in rows:
        step = (f"{'':>8} {'':>8}" if r.get("step_us") is None else
                f"{r['step_us']:8.1f} {r['ours_us']:8.1f}")
        print(f"{r['form']:<8} {r['option']:<15} {r['decode_trace_s']:13.2f} "
              f"{r['decode_kernels_s']:8.2f} {r['decode_lower_s']:6.2f} {r['decode_xla_s']:6.2f} | "
              f"{r['prefill_trace_s']:14.2f} {r['prefill_kernels_s']:8.2f} "
              f"{r['prefill_lower_s']:6.2f} {r['prefill_xla_s']:6.2f} | {step}")
    print("seconds; kernels: the CuTe DSL kernels compiled ahead in processes (none on a CPU)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
