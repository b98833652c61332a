"""Where a CTA of the fused verify spends its life: the kernel built with timeline=True
(thread 0 of every CTA stamps the SM clock at each `Phase`, and the SM id and global
timer at its start and end), launched in steady state (a CUDA graph of back-to-back
launches, each on a cache set of its own, so that the state comes from HBM and PDL
overlaps launches as in the benchmark; with --serial, each launch a child graph of its
own, as XLA's command buffers hold a custom call, so that a launch starts only once the
previous one has ended). The sets' pending counts are restored between replays, so that
every launch replays its requests' tokens. Prints, per point, the mean time of each
phase, the CTAs resident per SM, the share of the SMs' CTA slots busy and waiting over a
launch, how often CTAs sharing an SM run their state passes together, and the kernel
time of the same build without stamps, and writes every stamp to --out.

    JAX_PLATFORMS=cpu python tools/kernel_lab/timeline.py [--out DIR] [--serial] \
        [B,T,SPLIT[,C,N][,tree][,bf16] ...]

A point B,T,SPLIT,C,N runs the lazy checkpoint (checkpoint_every C) with every request
holding N kept tokens: N + T <= C T is a keep step (the state read, not written).
`tree` runs the tree build (each request a random tree), `bf16` a bf16 state.
"""
import argparse
import json
import pathlib
import sys

import jax.numpy as jnp
import numpy as np
import torch

import bench_path  # noqa: F401 - benchmarks/ on sys.path
from graphs import H, Point, cute_tensors
from jax_kda.kernels import compile_verify
from jax_kda.kernels.fused import STAMPS, Phase

# interval i of a CTA's life runs from Phase(i) to Phase(i + 1), named after its end
PHASE_NAMES = [phase.name.lower() for phase in Phase][1:]


def run_point(B, T, split, serial=False, checkpoint_every=1, kept=None, flags=()):
    point = Point(B, T, split, checkpoint_every, trees="tree" in flags,
                  state_dtype=jnp.bfloat16 if "bf16" in flags else jnp.float32)
    if kept is not None:
        point.hold(kept)
    stamps = torch.zeros((B * H * split, STAMPS), dtype=torch.int64, device="cuda")
    result = {}
    for timeline in (False, True):
        compiled = compile_verify(point.config, split, True, "float32", "float32",
                                  timeline=timeline, solo=point.solo)
        extra = cute_tensors([stamps]) if timeline else []
        result["us_stamped" if timeline else "us"] = point.graph_time(compiled, extra,
                                                                      serial=serial)
    result["stamps"] = stamps.cpu().numpy()
    return result


def summarize(stamps, period_us):
    """Mean phase times (us), the clock rate and CTAs per SM from one launch's stamps, and
    how the SMs' CTA slots spent the launch period: `busy` holding a CTA outside
    griddepcontrol.wait, `waiting` holding one in it (the first wave, while the previous
    launch ends), idle the rest."""
    sm, begin, end = stamps[:, 0], stamps[:, 1], stamps[:, 2]
    clocks = stamps[:, 3:3 + len(Phase)]
    live = clocks[:, -1] > 0  # padding CTAs stamp only the start
    ghz = (clocks[live, -1] - clocks[live, 0]).sum() / (end[live] - begin[live]).sum()
    phases = np.diff(clocks[live], axis=1) / ghz / 1e3
    span = (end.max() - begin.min()) / 1e3
    life = (end[live] - begin[live]) / 1e3
    # resident CTAs per SM, averaged over the kernel's span (sampled every 100 ns)
    grid = np.arange(begin.min(), end.max(), 100)
    per_sm = np.array([[((begin[sm == s] <= t) & (end[sm == s] > t)).sum() for t in grid]
                       for s in np.unique(sm)])
    # slots: the most CTAs seen on one SM at once, on every SM of the device
    slots = per_sm.max() * torch.cuda.get_device_properties(0).multi_processor_count
    wait = phases[:, Phase.WAITED - 1].sum()
    return dict(ghz=float(ghz), span_us=float(span), life_us=float(life.mean()),
                resident=float(per_sm.mean()), ctas=int(live.sum()),
                busy=float((life.sum() - wait) / (slots * period_us)),
                waiting=float(wait / (slots * period_us)),
                phases=[float(p) for p in phases.mean(axis=0)])


def neighbours(stamps):
    """Whether the CTAs sharing an SM run their state passes together: the share of a
    CTA's life after griddepcontrol.wait spent in the state pass, and the share of its
    state pass during which another CTA of its SM is in its own (SM clocks compare on
    one SM). Independent phases give about the first times the share of the time a
    neighbour is resident; more means in step, less apart."""
    sm, clocks = stamps[:, 0], stamps[:, 3:3 + len(Phase)]
    live = clocks[:, -1] > 0
    sm, clocks = sm[live], clocks[live]
    start, stop = clocks[:, Phase.STATE_ARRIVED], clocks[:, Phase.STATE_PASSED]
    shared = 0
    for s in np.unique(sm):
        on = np.where(sm == s)[0]
        overlap = (np.minimum(stop[on, None], stop[None, on])
                   - np.maximum(start[on, None], start[None, on])).clip(0)
        shared += overlap.sum() - np.trace(overlap)
    passes = (stop - start).sum()
    return dict(pass_share=float(passes / (clocks[:, -1] - clocks[:, Phase.WAITED]).sum()),
                pass_shared=float(shared / passes))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--serial", action="store_true",
                        help="each launch a child graph: no PDL overlap, as under XLA")
    parser.add_argument("points", nargs="*", default=["64,4,1", "1,4,2", "64,8,1"])
    args = parser.parse_args()
    print(f"{torch.cuda.get_device_name(0)}")
    if args.out:
        pathlib.Path(args.out).mkdir(parents=True, exist_ok=True)
    rows = []
    for point in args.points:
        values = point.split(",")
        flags = [v for v in values if not v.isdigit()]
        B, T, split, *lazy = (int(v) for v in values if v.isdigit())
        r = run_point(B, T, split, args.serial, *lazy, flags=flags)
        rows.append(dict(B=B, T=T, split=split, lazy=lazy + flags, us=r["us"],
                         us_stamped=r["us_stamped"],
                         **summarize(r["stamps"], r["us_stamped"]),
                         **neighbours(r["stamps"])))
        if args.out:
            name = "_".join(str(v) for v in (B, T, split, *lazy, *flags))
            np.save(pathlib.Path(args.out) / f"stamps_{name}.npy", r["stamps"])
        print(json.dumps(rows[-1]), flush=True)
    if args.out:
        (pathlib.Path(args.out) / "timeline.json").write_text(json.dumps(rows, indent=1))
    print(f"\n{'point':>12} {'us':>7} {'stamped':>7} {'life':>6} {'res':>4} {'busy':>5} "
          f"{'wait':>5} {'pass':>5} {'both':>5}  "
          + " ".join(f"{i:>5}" for i in range(len(PHASE_NAMES))))
    for r in rows:
        name = ",".join(str(v) for v in (r['T'], r['split'], *r['lazy']))
        print(f"{r['B']:>4},{name:<7} {r['us']:7.2f} "
              f"{r['us_stamped']:7.2f} {r['life_us']:6.2f} {r['resident']:4.2f} "
              f"{r['busy']:5.1%} {r['waiting']:5.1%} {r['pass_share']:5.1%} "
              f"{r['pass_shared']:5.1%}  "
              + " ".join(f"{p:5.2f}" for p in r["phases"]))
    print("pass: the state pass's share of a CTA's life after the wait; both: the share of "
          "its state pass that another CTA of its SM spends in its own")
    print("phases: " + "; ".join(f"{i} {p}" for i, p in enumerate(PHASE_NAMES)))


if __name__ == "__main__":
    sys.exit(main())
