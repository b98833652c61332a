"""Builds of the fused verify in one process: this checkout's against others' (each a
directory holding that build's fused.py and primitives.py), on the same operands. Per
point: one step of each on copies of the same cache, every output and cache field
compared with this build's; then the graph time of each (`timeline.Point`),
alternating ROUNDS times so that clock and thermal drift fall on all of them.

    mkdir -p /tmp/base && for f in fused primitives; do git show REV:jax_kda/kernels/$f.py \
      | sed 's/jax_kda.kernels.primitives/primitives/' > /tmp/base/$f.py; done
    JAX_PLATFORMS=cpu python tools/kernel_lab/compare.py --baseline /tmp/base 64,4,1 1,4,2

A point B,T,SPLIT,C,N runs the lazy checkpoint (checkpoint_every C) with every request
holding N kept tokens, and the flags `tree` and `bf16` the tree build and a bf16 state, as
in `timeline.py`.

A build must have this checkout's interface: `FusedVerify(config, split, has_bias, *,
timeline, solo, stacked)` with the `config`, `has_bias`, `stacked` and `timeline`
attributes, launched as (stream, *operands) in `jax_kda.kernel_abi` order (a [1] int32
`layer` slot, None here, and per-head pending [R, H]). Builds older than that interface
(a constructor of separate sizes and scalars, no layer operand) need their own
checkout's `jax_kda` package.

--baseline may be given several times; the first is the one changes are reported against.
--between M,N,K puts a bf16 GEMM [M, K] x [K, N] in front of every launch, as a model's
other layers run between its verify calls (a verify's time is then the pair's less the
GEMM's alone); --clock adds each build's SM clock from its timeline build (the clock
the verify's CTAs ran at: `timeline.summarize`).
"""
import argparse
import functools
import importlib.util
import json
import os
import statistics
import sys

import jax.numpy as jnp
import torch

from jax_kda.kernels import FusedVerify, compiled
from jax_kda.kernels.fused import STAMPS
import bench_path  # noqa: F401 - benchmarks/ on sys.path
from graphs import Point, cute_tensors
from timeline import summarize

ROUNDS = 3
CACHE_FIELDS = ("state", "conv", "corrections", "key_gates", "pending", "nodes")


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
def builds(config, others, solo, timeline=False):
    """Every build compiled for `config` (symbolic B: one compile serves every point of
    the same launch shape): name -> compiled, the other builds first, then this
    checkout's, each solo as eager_verify would launch it; timeline: their stamped
    builds."""
    split = config.split
    kernels = [(name, cls(config, split, True, timeline=timeline, solo=solo))
               for name, cls in others]
    kernels.append(("this", FusedVerify(config, split, True, timeline=timeline, solo=solo)))
    return {name: compiled(kernel) for name, kernel in kernels}


def gemm(shape):
    """A callable running one bf16 GEMM of `shape` (M, N, K) on fresh random operands."""
    M, N, K = shape
    a = torch.randn((M, K), dtype=torch.bfloat16, device="cuda")
    w = torch.randn((K, N), dtype=torch.bfloat16, device="cuda") * K**-0.5
    c = torch.empty((M, N), dtype=torch.bfloat16, device="cuda")
    return functools.partial(torch.matmul, a, w, out=c)


def clock(point, compiled, serial, before):
    """GHz the stamped build's CTAs ran at, in the timed graph's steady state."""
    stamps = torch.zeros((point.out.shape[0] * point.config.heads * point.config.split,
                          STAMPS), dtype=torch.int64, device="cuda")
    period = point.graph_time(compiled, cute_tensors([stamps]), serial=serial, before=before)
    return summarize(stamps.cpu().numpy(), period)["ghz"]


def one_step(point, compiled):
    """Every written field after one launch on a fresh copy of cache set 0 (out poisoned)."""
    named = dict(point.named[0])
    fields = [field for field in CACHE_FIELDS if named[field] is not None]  # nodes: trees'
    for field in fields:
        named[field] = named[field].clone()
    named["out"] = torch.full_like(point.out, float("nan"))
    compiled(point.handle, *cute_tensors(list(named.values())))
    torch.cuda.synchronize()
    return {field: named[field] for field in fields + ["out"]}


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
    parser.add_argument("--between", default=None,
                        help="M,N,K of a bf16 GEMM before each launch")
    parser.add_argument("--clock", action="store_true", help="each build's SM clock too")
    parser.add_argument("points", nargs="*", default=["64,4,1", "256,4,1", "1,4,2"])
    args = parser.parse_args()
    before = gemm([int(v) for v in args.between.split(",")]) if args.between else None
    others = tuple(load_build(directory) for directory in args.baseline)
    names = [name for name, _ in others] + ["this"]
    print(torch.cuda.get_device_name(0))
    rows = []
    for text in args.points:
        values = text.split(",")
        flags = [v for v in values if not v.isdigit()]
        B, T, split, *lazy = (int(v) for v in values if v.isdigit())
        point = Point(B, T, split, *lazy[:1], trees="tree" in flags,
                      state_dtype=jnp.bfloat16 if "bf16" in flags else jnp.float32)
        if lazy[1:]:
            point.hold(lazy[1])
        compiled = builds(point.config, others, point.solo)
        steps = {name: one_step(point, c) for name, c in compiled.items()}
        times = {name: [] for name in compiled}
        alone = []  # the GEMM's share of each pair's time
        for _ in range(ROUNDS):
            for name, c in compiled.items():
                times[name].append(point.graph_time(c, serial=args.serial, before=before))
            if before is not None:
                alone.append(point.graph_time(lambda *_: None, serial=args.serial,
                                              before=before))
        if alone:
            times = {name: [t - a for t, a in zip(ts, alone)] for name, ts in times.items()}
        row = dict(B=B, T=T, split=split, lazy=lazy + flags,
                   us={name: statistics.median(t) for name, t in times.items()},
                   spread_us={name: max(t) - min(t) for name, t in times.items()},
                   differences={name: differences(steps[name], steps["this"])
                                for name, _ in others},
                   unwritten={name: int(s["out"].isnan().sum()) for name, s in steps.items()})
        if alone:
            row["gemm_us"] = statistics.median(alone)
        if args.clock:
            row["ghz"] = {name: clock(point, c, args.serial, before) for name, c in
                          builds(point.config, others, point.solo, True).items()}
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
        ghz = ("   GHz " + " ".join(f"{r['ghz'][n]:.3f}" for n in names)) if "ghz" in r else ""
        name = ",".join(str(v) for v in (r['T'], r['split'], *r['lazy']))
        print(f"{r['B']:>4},{name:<7} " + " ".join(f"{c:>12}" for c in cells)
              + f"   {diff}" + (f"; outputs unwritten: {bad}" if bad else "") + ghz)


if __name__ == "__main__":
    sys.exit(main())
