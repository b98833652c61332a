"""Two builds of the fused verify in one process: this checkout's against another's (a
directory holding that build's fused.py and primitives.py), on the same operands. Per
point: one step of each on copies of the same cache, every output and cache field
compared; then the graph time of each (gpu_timeline.Point), alternating ROUNDS times
so that clock and thermal drift fall on both.

    mkdir -p tests/_base && for f in fused primitives; do git show REV:jax_kda/kernels/$f.py \\
      | sed 's/jax_kda.kernels.primitives/primitives/' > tests/_base/$f.py; done
    JAX_PLATFORMS=cpu python tests/gpu_compare.py --baseline tests/_base 64,4,1 1,4,2
"""
import argparse
import functools
import json
import statistics
import sys

import torch

from jax_kda.ffi.eager import FIELDS
from jax_kda.kernels import compile_kernel, verify_kernel
from gpu_timeline import Point, operands

ROUNDS = 3
CACHE_FIELDS = ("state", "conv", "corrections", "key_gates", "pending")


def load_baseline(directory):
    sys.path.insert(0, directory)  # its fused.py imports `primitives` from there
    import fused
    return fused.FusedVerify


@functools.lru_cache(maxsize=None)
def builds(config, baseline):
    """Both builds compiled for `config` (symbolic B: one compile serves every point)."""
    split = config.split
    ours = verify_kernel(config, split, True)
    theirs = baseline(config.heads, config.tokens, config.rq, config.gate_mode, True, split,
                      float(config.lower_bound), config.query_scale, float(config.eps))
    return {name: compile_kernel(kernel, config, True, "float32", "float32")
            for name, kernel in (("baseline", theirs), ("this", ours))}


def one_step(point, compiled):
    """Every written field after one launch on a fresh copy of cache set 0 (out poisoned)."""
    named = dict(point.named[0])
    for field in CACHE_FIELDS:
        named[field] = named[field].clone()
    named["out"] = torch.full_like(point.out, float("nan"))
    compiled(point.handle, *operands([named[name] for name in FIELDS]))
    torch.cuda.synchronize()
    return {field: named[field] for field in CACHE_FIELDS + ("out",)}


def differences(a, b):
    """Per field: elements that differ and the largest absolute difference."""
    result = {}
    for field in a:
        x, y = a[field].float(), b[field].float()
        unequal = ~((x == y) | (x.isnan() & y.isnan()))
        result[field] = (int(unequal.sum()), float((x - y).abs().nan_to_num(float("inf")).max()))
    return result


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--baseline", required=True)
    parser.add_argument("points", nargs="*", default=["64,4,1", "256,4,1", "1,4,2"])
    args = parser.parse_args()
    baseline = load_baseline(args.baseline)
    print(torch.cuda.get_device_name(0))
    rows = []
    for text in args.points:
        B, T, split = (int(v) for v in text.split(","))
        point = Point(B, T, split)
        compiled = builds(point.config, baseline)
        steps = {name: one_step(point, c) for name, c in compiled.items()}
        times = {name: [] for name in compiled}
        for _ in range(ROUNDS):
            for name, c in compiled.items():
                times[name].append(point.graph_time(c))
        row = dict(B=B, T=T, split=split,
                   **{f"{name}_us": statistics.median(t) for name, t in times.items()},
                   spread_us={name: max(t) - min(t) for name, t in times.items()},
                   differences=differences(steps["baseline"], steps["this"]),
                   this_unwritten=int(steps["this"]["out"].isnan().sum()))
        rows.append(row)
        print(json.dumps(row), flush=True)
        del point
        torch.cuda.empty_cache()
    print(f"\n{'point':>10} {'baseline':>9} {'this':>9} {'change':>7}  differing elements")
    for r in rows:
        change = r["this_us"] / r["baseline_us"] - 1
        diff = ", ".join(f"{f} {n}" for f, (n, _) in r["differences"].items() if n)
        print(f"{r['B']:>4},{r['T']},{r['split']:<3} {r['baseline_us']:9.2f} "
              f"{r['this_us']:9.2f} {100 * change:+6.1f}%  {diff or 'none'}"
              + (f"; {r['this_unwritten']} outputs unwritten" if r["this_unwritten"] else ""))


if __name__ == "__main__":
    sys.exit(main())
