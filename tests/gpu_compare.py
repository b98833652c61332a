"""Builds of the fused verify in one process: this checkout's against others' (each a
directory holding that build's fused.py and primitives.py), on the same operands. Per
point: one step of each on copies of the same cache, every output and cache field
compared with this build's; then the graph time of each (gpu_timeline.Point),
alternating ROUNDS times so that clock and thermal drift fall on all of them.

    mkdir -p tests/_base && for f in fused primitives; do git show REV:jax_kda/kernels/$f.py \\
      | sed 's/jax_kda.kernels.primitives/primitives/' > tests/_base/$f.py; done
    JAX_PLATFORMS=cpu python tests/gpu_compare.py --baseline tests/_base 64,4,1 1,4,2

--baseline may be given several times; the first is the one changes are reported against.
"""
import argparse
import functools
import importlib.util
import json
import os
import statistics
import sys

import torch

from jax_kda.ffi.eager import FIELDS
from jax_kda.kernels import compile_kernel, verify_kernel
from gpu_timeline import Point, operands

ROUNDS = 3
CACHE_FIELDS = ("state", "conv", "corrections", "key_gates", "pending")


def load_module(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def load_build(directory):
    """(name, FusedVerify) of the build in `directory`, named after it; its fused.py
    imports `primitives`, which is that directory's while it loads."""
    name = os.path.basename(os.path.normpath(directory))
    sys.modules["primitives"] = load_module(f"{name}_primitives",
                                            os.path.join(directory, "primitives.py"))
    fused = load_module(f"{name}_fused", os.path.join(directory, "fused.py"))
    del sys.modules["primitives"]
    return name, fused.FusedVerify


@functools.lru_cache(maxsize=None)
def builds(config, others, solo):
    """Every build compiled for `config` (symbolic B: one compile serves every point of
    the same launch shape): name -> compiled, the other builds first, then this
    checkout's, each solo as eager_verify would launch it."""
    split = config.split
    kernels = [(name, cls(config.heads, config.tokens, config.rq, config.gate_mode, True,
                          split, float(config.lower_bound), config.query_scale,
                          float(config.eps), solo=solo)) for name, cls in others]
    kernels.append(("this", verify_kernel(config, split, True, solo=solo)))
    return {name: compile_kernel(kernel, config, True, "float32", "float32")
            for name, kernel in kernels}


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
    parser.add_argument("--baseline", action="append", required=True)
    parser.add_argument("--serial", action="store_true",
                        help="each launch a child graph: no PDL overlap, as under XLA")
    parser.add_argument("points", nargs="*", default=["64,4,1", "256,4,1", "1,4,2"])
    args = parser.parse_args()
    others = tuple(load_build(directory) for directory in args.baseline)
    names = [name for name, _ in others] + ["this"]
    print(torch.cuda.get_device_name(0))
    rows = []
    for text in args.points:
        B, T, split = (int(v) for v in text.split(","))
        point = Point(B, T, split)
        compiled = builds(point.config, others, point.solo)
        steps = {name: one_step(point, c) for name, c in compiled.items()}
        times = {name: [] for name in compiled}
        for _ in range(ROUNDS):
            for name, c in compiled.items():
                times[name].append(point.graph_time(c, serial=args.serial))
        row = dict(B=B, T=T, split=split,
                   us={name: statistics.median(t) for name, t in times.items()},
                   spread_us={name: max(t) - min(t) for name, t in times.items()},
                   differences={name: differences(steps[name], steps["this"])
                                for name, _ in others},
                   unwritten={name: int(s["out"].isnan().sum()) for name, s in steps.items()})
        rows.append(row)
        print(json.dumps(row), flush=True)
        del point
        torch.cuda.empty_cache()
    first = names[0]
    print(f"\n{'point':>10} " + " ".join(f"{n[:12]:>12}" for n in names)
          + f"   (change against {first}; elements differing from this build's)")
    for r in rows:
        cells = [f"{r['us'][first]:9.2f} us"] + [
            f"{100 * (r['us'][n] / r['us'][first] - 1):+11.1f}%" for n in names[1:]]
        diff = "; ".join(f"{n}: " + (", ".join(f"{f} {c}" for f, (c, _) in d.items() if c)
                                     or "none") for n, d in r["differences"].items())
        bad = ", ".join(f"{n} {c}" for n, c in r["unwritten"].items() if c)
        print(f"{r['B']:>4},{r['T']},{r['split']:<3} " + " ".join(f"{c:>12}" for c in cells)
              + f"   {diff}" + (f"; outputs unwritten: {bad}" if bad else ""))


if __name__ == "__main__":
    sys.exit(main())
