"""results.json -> the targets, RESULTS.md (tables, date, GPU, command) and the plot, on
any machine:

    python benchmarks/report.py RESULTS_JSON [-o benchmarks/RESULTS.md]
        [--plot benchmarks/bench.png] [--command "the command that ran the benchmark"]

bench.py calls the same functions at the end of a run.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys

import measure  # benchmarks/, on sys.path as the script's folder

METHOD_ORDER = ("graph", "events", "jit fori_loop")
COLUMNS = (  # (impl, label) of the per-T tables
    ("ours-eager", "ours (kernel, eager)"),
    ("ours-eager-bfloat16-state", "ours (kernel, eager, bf16 state)"),
    ("ours-jit", "ours (jitted fused_verify)"),
    ("xla", "XLA backend (backend=jax)"),
    ("stock-xla", "stock_verify (XLA)"),
    ("fla-recurrence", "fla recurrence"),
    ("fla-pipeline", "fla pipeline"),
)
# Peer checks (info rows): fla's recurrence at H = 32, T = 4 and the copy bandwidth as
# first measured on an H200, to show that the peer and the ceiling run as expected.
FLA_EXPECTED_US = {1: 11.5, 64: 221.0, 256: 976.0}
LAZY_TARGETS_US = {256: 240.0, 64: 66.0}  # the lazy checkpoint's, C = 4, T = 4
COPY_EXPECTED_TBPS = 4.14
WHAT_WAS_TIMED = ("Each row's method (the implementation, the timer, the bytes counted) is in "
                  "[docs/performance.md](../docs/performance.md), \"How it is measured\".")
DECODER_TEXT = """\
What a JAX decoder gets (`benchmarks/decoder.py`): one speculative step of {layers}
layers (H = {heads}, T = {tokens}), jitted with the cache donated. **scan**: stacked params
and cache, `jax.lax.scan` over the layer index with the cache in the carry,
`fused_verify(..., layer=i)` per layer, then one `accept` of the stacked cache.
**list**: per-layer params and caches, a Python loop of `fused_verify`, then `accept`
per layer. Every layer verifies the same step's inputs (nothing runs between the layers);
the cache holds B + 16 slots and record rows. `lower + compile`: the first
`jit(step).lower(...)` and `.compile()` at that B (the first lowering of a kernel
configuration also compiles its CuTe DSL kernel); `new batch`: lower + compile at the
next B that launches the same kernel, same cache. `loop`: wall time per step of N steps
called from Python without blocking, then one block (the dispatch-bound throughput);
`blocked`: a block after every step (a decoder that needs its tokens back); tokens/s =
B x T / blocked. `GPU`: the device's time per step from JAX's profiler trace of
host-called steps (`jax_kda.profiling.traced_steps`): the span of a step's activities
(busy: the time some activity ran), with the activities per step. `raw`: the step's own
layers through the eager kernel on its buffers, per layer, in one CUDA graph (PDL
overlaps the launches) and with each launch a child graph of its own (as XLA's command
buffers hold a custom call); `XLA per layer` = (GPU - layers x raw in child graphs) /
layers. Command buffers: XLA's default (on) or `--xla_gpu_enable_command_buffer=`
(off), each setting in a process of its own. The scan's unroll is tried both ways at the
first B (1: a while loop; True: the layers in a straight line) and the one with the
lower GPU time per step is used (within 2%, the cheaper new-batch compile); the other is
marked `not used`. The row of the larger S (1025, or what a quarter of the device's
memory holds) is the used scan at the first B on a cache of that many slots (the same
live rows): the step must not depend on S.
"""


def best_time(results, impl, T, B, split="auto"):
    """The point of impl at (T, B), split auto (or any for the peers), best method first."""
    rows = [r for r in results.get("points", []) if r.get("impl") == impl
            and r.get("T") == T and r.get("B") == B and "us" in r
            and (r.get("split") is None or split is None or (
                r["split"] == split if isinstance(split, int)
                else str(r["split"]).startswith(split)))]
    order = lambda r: METHOD_ORDER.index(r["method"]) if r.get("method") in METHOD_ORDER else 9
    rows.sort(key=order)
    return rows[0] if rows else None


def cell(row):
    if row is None:
        return "-"
    frac = row.get("frac")
    text = f"{row['us']:.1f} us"
    if frac:
        text += f" ({100 * frac:.0f}%)"
    if row.get("method") and row["method"] != "graph":
        text += f" [{row['method'].split()[0]}]"
    if row.get("flag"):
        text += " **!**"
    return text


def table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def tokens_and_batches(results):
    points = [r for r in results.get("points", []) if "us" in r]
    return (sorted({r["T"] for r in points}), sorted({r["B"] for r in points}))


def decoder_row(results, form, B, cmdbuf="on", check=None):
    """The decoder step's timed row of `form` at B (the scan's used unroll; check
    "slots": its row on the big cache), or None."""
    for r in results.get("decoder", []):
        if (r.get("cmdbuf"), r.get("form"), r.get("B"), r.get("check")) == (
                cmdbuf, form, B, check) and r.get("used", True) and "loop_us" in r:
            return r
    return None


def gpu_us(row):
    return ((row or {}).get("gpu") or {}).get("step_us")


def targets(results) -> list:
    """The targets table: one row per target ("met" True or False), then info rows
    (met None: other timing modes and the peer checks)."""
    rows, info = [], []

    def target(name, goal, measured, met, margin, into=rows):
        into.append({"name": name, "target": goal, "measured": measured, "met": met,
                     "margin": margin})

    T, H = 4, results.get("meta", {}).get("heads")
    find = lambda impl, B: best_time(results, impl, T, B)
    _, Bs = tokens_and_batches(results)
    for B in (b for b in Bs if H and b * H >= 2048):
        ours, fla = find("ours-eager", B), find("fla-recurrence", B)
        if ours and ours.get("frac"):
            frac = ours["frac"]
            target(f"bandwidth B={B} T=4", ">= 85% of copy", f"{100 * frac:.1f}%",
                   frac >= 0.85, f"{100 * (frac - 0.85):+.1f} points")
        if ours and fla:
            speedup = fla["us"] / ours["us"]
            target(f"vs fla B={B} T=4", ">= 3x faster than fla recurrence",
                   f"{speedup:.2f}x ({ours['us']:.1f} vs {fla['us']:.1f} us)",
                   speedup >= 3, f"{speedup / 3:.2f} of target")
    ours = find("ours-eager", 1)
    if ours:
        target("latency B=1 T=4", "<= 5.5 us", f"{ours['us']:.3f} us", ours["us"] <= 5.5,
               f"{ours['us'] - 5.5:+.3f} us")

    for (B, L), impls in prefill_pairs(results.get("prefill", [])).items():
        ours, fla = impls.get("ours", {}), impls.get("fla", {})
        if L >= 4096 and "us" in ours and "us" in fla:
            ratios = {key: ours[key] / fla[key] for key in ("us", "wall_us")
                      if key in ours and key in fla}
            measured = ", ".join(
                f"{'GPU' if key == 'us' else 'wall'} {r:.2f}x ({1e-3 * ours[key]:.2f} vs "
                f"{1e-3 * fla[key]:.2f} ms)" for key, r in ratios.items())
            worst = max(ratios.values())
            target(f"prefill B={B} L={L} vs fla chunk_kda", "<= 2x its time", measured,
                   worst <= 2, f"{worst - 2:+.2f}x")

    lazy = lazy_times(results.get("lazy", []))
    for B, goal in LAZY_TARGETS_US.items():
        row = lazy.get((B, 4, 4))
        if row:
            target(f"lazy checkpoint B={B} T=4 C=4, time per step", f"<= {goal} us",
                   f"{row['step_us']:.1f} us", row["step_us"] <= goal,
                   f"{row['step_us'] - goal:+.1f} us")
    every_step, lazy_one = lazy.get((1, 4, 1)), lazy.get((1, 4, 4))
    if every_step and lazy_one:
        target("lazy checkpoint B=1 T=4: C=4 against C=1", "no slower",
               f"{lazy_one['step_us']:.2f} vs {every_step['step_us']:.2f} us",
               lazy_one["step_us"] <= every_step["step_us"],
               f"{lazy_one['step_us'] - every_step['step_us']:+.2f} us")

    decoder = [r for r in results.get("decoder", []) if "loop_us" in r]
    B = min((r["B"] for r in decoder), default=None)
    scan, listed = decoder_row(results, "scan", B), decoder_row(results, "list", B)
    big = decoder_row(results, "scan", B, check="slots")
    where = f"B={B}, cmdbuf on"
    if gpu_us(scan) and gpu_us(listed):
        ratio = gpu_us(scan) / gpu_us(listed)
        target(f"decoder step: scan GPU time vs list's ({where})", "within 5% (scan <= 1.05x)",
               f"{gpu_us(scan):.1f} vs {gpu_us(listed):.1f} us", ratio <= 1.05,
               f"{100 * (ratio - 1):+.1f}%")
    if gpu_us(scan) and gpu_us(big):
        ratio = gpu_us(big) / gpu_us(scan)
        target(f"decoder step: GPU time at S={big['S']} vs S={scan['S']} (scan, {where})",
               "within 5%", f"{gpu_us(big):.1f} vs {gpu_us(scan):.1f} us",
               abs(ratio - 1) <= 0.05, f"{100 * (ratio - 1):+.1f}%")
    if gpu_us(scan):
        ratio = scan["loop_us"] / gpu_us(scan)
        target(f"decoder step: wall per step vs GPU time (scan, Python loop, {where})",
               "<= 1.15x", f"{scan['loop_us']:.1f} vs {gpu_us(scan):.1f} us ({ratio:.2f}x)",
               ratio <= 1.15, f"{ratio - 1.15:+.2f}x")
        ratio = scan["blocked_us"] / gpu_us(scan)
        target(f"decoder step: wall per step blocked after each step (scan, {where})", "-",
               f"{scan['blocked_us']:.1f} us ({ratio:.2f}x GPU time)", None, "", info)
        if scan.get("chain_serial_us"):
            layers = scan["layers"]
            extra = (gpu_us(scan) - layers * scan["chain_serial_us"]) / layers
            target(f"decoder step: XLA's time per layer beyond the raw kernel's (scan, {where})",
                   "-", f"{extra:+.2f} us (raw in child graphs {scan['chain_serial_us']:.2f} "
                   f"us, in one graph {scan['chain_us']:.2f} us)", None, "", info)
    off = decoder_row(results, "scan", B, cmdbuf="off")
    if off and gpu_us(off):
        target(f"decoder step: command buffers off (scan, B={B})", "-",
               f"loop {off['loop_us']:.1f} us, GPU {gpu_us(off):.1f} us", None, "", info)
    compiles = [r for r in decoder if r.get("cmdbuf") == "on" and r["form"] == "scan"
                and r.get("used") and "new_batch_s" in r]
    if compiles:
        worst = max(compiles, key=lambda r: r["new_batch_s"])
        target(f"decoder step: lower + compile at a new batch size (scan, unroll="
               f"{worst['unroll']}, cmdbuf on, worst of B = "
               f"{', '.join(str(r['B']) for r in compiles)})", "<= 0.5 s",
               f"{worst['new_batch_s']:.2f} s (B={worst['B']} -> {worst['new_batch']})",
               worst["new_batch_s"] <= 0.5, f"{worst['new_batch_s'] - 0.5:+.2f} s")

    for B, expected in FLA_EXPECTED_US.items() if H == 32 else ():
        fla = find("fla-recurrence", B)
        if fla:
            target(f"fla recurrence B={B} T=4 (peer check)", f"about {expected} us on an H200",
                   f"{fla['us']:.1f} us", None, f"{fla['us'] / expected:.2f}x", info)
    copy = results.get("copy")
    if copy and results.get("meta", {}).get("platform") == "gpu":
        target("copy bandwidth (peer check)", f"about {COPY_EXPECTED_TBPS} TB/s on an H200",
               f"{copy['tbps']:.3f} TB/s", None,
               f"{copy['tbps'] / COPY_EXPECTED_TBPS:.2f}x", info)
    return rows + info


def render(results, command=None) -> str:
    meta = results.get("meta", {})
    copy = results.get("copy", {})
    out = ["# Benchmark results: KDA speculative verify", ""]
    out += [f"- date: {meta.get('date')}", f"- GPU: {meta.get('gpu')} ({meta.get('platform')})",
            f"- command: `{command or meta.get('command')}`",
            f"- heads H = {meta.get('heads')}, K = 128; run took {meta.get('elapsed_s')} s of a "
            f"{meta.get('budget_s')} s budget"
            + (" (--quick dry run)" if meta.get("quick") else ""),
            "- versions: " + ", ".join(f"{k} {v}" for k, v in meta.get("versions", {}).items()
                                        if v),
            f"- kernel eager: {meta.get('kernel_eager')}; kernel under jit: "
            f"{meta.get('kernel_jit')}; fla: {meta.get('fla')}"]
    if copy:
        out.append(f"- measured copy bandwidth: **{copy['tbps']:.3f} TB/s** (read + write; "
                   f"{copy['how']}); every % below is of this")
    out.append("")

    out += ["## Correctness (against the stock reference and the XLA backend, both run on "
            "the CPU, checked before timing)", ""]
    rows = []
    for c in results.get("correctness", []):
        if "error" in c:
            rows.append([c["T"], c["impl"], "-", "ERROR", c["error"][:120], "", ""])
            continue
        w = c["worst"]
        rows.append([c["T"], c["impl"], c["reference"], "ok" if c["ok"] else "**DISAGREES**",
                     w["field"], f"{w['rel_l2']:.2e}", f"{w['max_abs']:.2e}"])
    out += [table(["T", "implementation", "against", "result", "worst field", "rel L2",
                   "max abs"], rows),
            "", "Tolerance (relative L2): 2e-2 on the bf16 output, keys and raw gates, 1e-4 "
            "on the FP32 state and corrections; the window and pending exact. NaN (an "
            "unwritten output: the eager kernel's output is poisoned first) fails. The "
            "references run on the CPU: XLA on a GPU drops f32 -> bf16 -> f32 round trips, "
            "some of the stock roundings.", ""]

    out += ["## Targets", ""]
    verdict = lambda met: "info" if met is None else "met" if met else "**missed**"
    rows = [[t["name"], t["target"], t["measured"], verdict(t["met"]), t["margin"]]
            for t in results.get("targets", [])]
    out += [table(["target", "goal", "measured", "", "margin"], rows) if rows else
            "(no target could be measured)", ""]

    Ts, Bs = tokens_and_batches(results)
    for T in Ts:
        out += [f"## Time per call, T = {T} (split auto; % of the copy bandwidth for the "
                f"bytes that must move)", ""]
        present = [(impl, label) for impl, label in COLUMNS
                   if any(best_time(results, impl, T, B) for B in Bs)]
        rows = [[B] + [cell(best_time(results, impl, T, B)) for impl, _ in present] for B in Bs]
        out += [table(["B"] + [label for _, label in present], rows), "",
                "Graph replay where measured, else `[events]` (one launch at a time) or "
                "`[jit]` (jitted fori_loop); **!** marks an implementation whose output "
                "disagreed with a reference.", ""]
        fixed = sorted({r["split"] for r in results.get("points", [])
                        if r.get("impl") == "ours-eager" and r.get("T") == T and "us" in r
                        and isinstance(r.get("split"), int)})
        if fixed:
            out += [f"### Our kernel by split, T = {T}", ""]
            rows = []
            for B in Bs:
                auto = best_time(results, "ours-eager", T, B)
                row = [B, "-" if auto is None else f"{cell(auto)} [{auto['split']}]"]
                for split in fixed:
                    row.append(cell(best_time(results, "ours-eager", T, B, split=split)))
                rows.append(row)
            out += [table(["B", "split auto"] + [f"split {s}" for s in fixed], rows), ""]

    out += decoder_section(results.get("decoder", []))
    out += prefill_section(results.get("prefill", []))
    out += lazy_section(results.get("lazy", []))

    memory = results.get("memory", [])
    if memory:
        out += [f"## Cache bytes per request (H = {memory[0]['heads']})", "",
                "Ours: one FP32 checkpoint, the conv window (W = T + 3 positions), one record "
                "row (T corrections f32, T keys and raw gates bf16), pending (an int32 per "
                "head). Stock speculative layout: one FP32 state per verify token and a conv "
                "window of 3 + T - 1 positions.", ""]
        mib = lambda b: f"{b / 2**20:.2f} MiB"
        rows = [[m["T"], mib(m["ours_bytes"]), mib(m["stock_bytes"]),
                 f"{m['ours_over_stock']:.3f}", mib(20 * m["ours_bytes"]),
                 mib(20 * m["stock_bytes"])] for m in memory]
        out += [table(["T", "ours", "stock", "ours / stock", "ours, 20 layers",
                       "stock, 20 layers"], rows), ""]

    out += ["## What was timed", "", WHAT_WAS_TIMED]
    skipped = results.get("skipped", [])
    if skipped:
        out += ["## Skipped", ""] + [f"- {s}" for s in skipped] + [""]
    errors = [r for r in results.get("points", []) if "error" in r]
    if errors:
        out += ["## Errors", ""] + [f"- {r.get('what')}: {r['error'][:300]}" for r in errors] + [""]
    out += ["![bandwidth fraction and time per call against batch](bench.png)", ""]
    return "\n".join(out)


def form_label(row):
    """"list", or "scan, unroll=U" with "(not used)" for the unroll not chosen."""
    if row["form"] != "scan":
        return row["form"]
    return f"scan, unroll={row['unroll']}" + ("" if row.get("used") else " (not used)")


def prefill_pairs(rows):
    """{(B, L): {impl: row}} of the prefill section's rows."""
    pairs = {}
    for r in rows:
        pairs.setdefault((r["B"], r["L"]), {})[r["impl"]] = r
    return pairs


def prefill_section(rows) -> list:
    """The prefill's section of RESULTS.md (lines), [] without rows."""
    if not rows:
        return []
    cell = lambda r: (f"{1e-3 * r['us']:.2f} ms ({r['tokens_per_s'] / 1e3:.0f}k tok/s)"
                      if r and "us" in r else (r or {}).get("error") or
                      (r or {}).get("skipped") or "-")
    wall = lambda r: f"{1e-3 * r['wall_us']:.2f} ms" if r and "wall_us" in r else "-"
    ratio = lambda a, b, key: (f"{a[key] / b[key]:.2f}x" if a and b and key in a and key in b
                               else "-")
    lines = []
    for (B, L), impls in prefill_pairs(rows).items():
        ours, fla = impls.get("ours"), impls.get("fla")
        compile_s = f"{ours['compile_s']:.1f}" if ours and "compile_s" in ours else "-"
        lines.append([str(B), str(L), cell(ours), cell(fla), ratio(ours, fla, "us"),
                      wall(ours), wall(fla), ratio(ours, fla, "wall_us"), compile_s])
    return ["## Prefill: one layer over whole prompts", "",
            "`benchmarks/prefill.py`: `jax_kda.prefill` (the whole layer: convolutions, gate "
            "projection, the recurrence in chunks of 64, gated norm; jitted, cache donated) "
            "against fla's `chunk_kda` (the recurrence with its gate, beta sigmoid and q/k "
            "norms in kernel) on prompts of the same size and heads. GPU: ours the span of "
            "a call in JAX's profiler trace, fla CUDA events; wall: a call blocked until "
            "done, on the host's clock.", "",
            table(["B", "L", "ours GPU", "fla GPU", "ratio", "ours wall", "fla wall",
                   "ratio", "ours compile s"], lines),
            ""]


def lazy_times(rows):
    """{(B, T, C): row} of the lazy checkpoint section's timed rows."""
    return {(r["B"], r["T"], r["C"]): r for r in rows
            if r.get("kind") == "time" and "step_us" in r}


def lazy_section(rows) -> list:
    """The lazy checkpoint's section of RESULTS.md (lines), [] without rows."""
    if not rows:
        return []
    mib = lambda b: f"{b / 2**20:.2f} MiB"
    checks = [[r["C"], f"{r['out_bf16_units']:.2f}", f"{r['state']:.1e}",
               f"{r['corrections']:.1e}", r["window"], r["pending"]]
              for r in rows if r.get("kind") == "check"]
    timed = []
    for r in rows:
        if r.get("kind") != "time":
            continue
        if "error" in r:
            timed.append([r["B"], r["T"], r["C"], "-", r["error"][:100], "", "", "", ""])
            continue
        per = ", ".join(f"{n}: {us:.1f}" for n, us in r["us_per_n"].items())
        H, T, B = measure.KIMI_HEADS, r["T"], r["B"]
        stock = measure.fla_recurrence_bytes(H, T, B)["total"]
        stock_cache = measure.memory_per_request(H, T)["stock_bytes"]
        timed.append([B, T, r["C"], r["split"], f"{r['step_us']:.1f} us", per,
                      f"{r['bytes'] / 1e6:.1f} MB ({stock / 1e6:.1f})",
                      f"{100 * r['copy_fraction']:.1f}%",
                      f"{mib(r['cache_bytes'])} ({mib(stock_cache)})"])
    return ["## Lazy checkpoint: the state written once every C steps", "",
            "`benchmarks/lazy.py`: `KdaConfig(checkpoint_every=C)`, record_tokens C T, "
            "H = 32. In steady state with every token accepted a verify starts from n = T, "
            "2T, .., C T kept tokens and the last writes the state; a step's time is the "
            "mean over that cycle of each n's time (graph replay, one cache set per launch). "
            "Bytes per step: the cycle's mean of what a verify must move (the state read "
            "at every step, written once a cycle); % of the copy bandwidth for those bytes; "
            "the cache per request (checkpoint, window of C T + 3, C T records). In "
            "parentheses the stock speculative layout's (a state read and T written per "
            "verify; a state per verify token).", "",
            "Checked first, one step at T = 4 (kept counts 0..RQ: steps that keep and that "
            "write) against the XLA backend on the CPU: out in bf16 units of its row's "
            "scale, state and corrections against their largest value, window and pending "
            "differing elements.", "",
            table(["C", "out", "state", "corrections", "window", "pending"], checks), "",
            table(["B", "T", "C", "split", "per step", "us at each n",
                   "bytes per step (stock)", "% of copy", "cache per request (stock)"],
                  timed), ""]


def decoder_section(rows) -> list:
    """The decoder step's section of RESULTS.md (lines), [] without rows."""
    if not rows:
        return []
    first = next((r for r in rows if "loop_us" in r), rows[0])
    out = [f"## The decoder step: {first.get('layers')} layers through JAX", "",
           DECODER_TEXT.format(layers=first.get("layers"), heads=first.get("heads"),
                               tokens=first.get("T")), ""]
    fmt = lambda v, spec=".1f": "-" if v is None else format(v, spec)
    lines = []
    for r in rows:
        if "loop_us" not in r:
            lines.append([r.get("cmdbuf"), "ERROR" if "error" in r else "skipped",
                          r.get("B", ""), (r.get("error") or r.get("skipped", ""))[:150]]
                         + [""] * 9)
            continue
        gpu = r.get("gpu") or {}
        chain = r.get("chain_serial_us")
        per_layer = ((gpu["step_us"] - r["layers"] * chain) / r["layers"]
                     if chain and gpu.get("step_us") else None)
        lines.append([
            r["cmdbuf"], form_label(r), r["B"], r["S"],
            f"{r['lower_s']:.2f} + {r['compile_s']:.2f}",
            f"{r['new_batch_s']:.2f} (B={r['new_batch']})" if "new_batch_s" in r else "-",
            fmt(r["loop_us"]), fmt(r["blocked_us"]),
            f"{fmt(gpu.get('step_us'))} ({fmt(gpu.get('busy_us'))})",
            fmt(gpu.get("kernels"), "g"), f"{r['tokens_per_s']:.0f}",
            f"{fmt(r.get('chain_us'), '.2f')} / {fmt(chain, '.2f')}",
            fmt(per_layer, "+.2f")])
    out += [table(["cmdbuf", "form", "B", "S", "lower + compile s", "new batch s", "loop us",
                   "blocked us", "GPU us (busy)", "activities", "tokens/s",
                   "raw us/layer: graph / child graphs", "XLA per layer us"], lines), ""]
    return out


def summary(results) -> str:
    """The short table printed last."""
    lines = []
    copy = results.get("copy", {})
    if copy:
        lines.append(f"copy {copy['tbps']:.3f} TB/s | {results['meta'].get('gpu')}")
    Ts, Bs = tokens_and_batches(results)
    short = [("ours-eager", "ours"), ("ours-jit", "ours-jit"), ("xla", "xla"),
             ("stock-xla", "stock"), ("fla-recurrence", "fla-rec"), ("fla-pipeline", "fla-pipe")]
    for T in Ts:
        present = [(i, n) for i, n in short if any(best_time(results, i, T, B) for B in Bs)]
        lines.append(f"T={T}  " + "".join(f"{n:>17}" for _, n in present))
        for B in Bs:
            cells = []
            for impl, _ in present:
                r = best_time(results, impl, T, B)
                frac = 100 * (r.get("frac") or 0) if r else 0
                cells.append("-" if r is None else f"{r['us']:.1f}us {frac:.0f}%")
            lines.append(f"B={B:<4} " + "".join(f"{c:>17}" for c in cells))
    for r in results.get("decoder", []):
        if "loop_us" in r:
            gpu = gpu_us(r)
            lines.append(f"decoder {form_label(r)} B={r['B']} S={r['S']} cmdbuf {r['cmdbuf']}: "
                         f"loop {r['loop_us']:.1f} us, blocked {r['blocked_us']:.1f} us, GPU "
                         + ("-" if gpu is None else f"{gpu:.1f} us")
                         + (f", new batch {r['new_batch_s']:.2f} s" if "new_batch_s" in r else ""))
        else:
            lines.append(f"decoder cmdbuf {r.get('cmdbuf')} B={r.get('B')}: "
                         f"{(r.get('error') or r.get('skipped', ''))[:200]}")
    bad = sorted({f"{c['impl']} T={c['T']}" for c in results.get("correctness", [])
                  if not c.get("ok")})
    lines.append("correctness: " + ("all agree" if not bad else "FLAGGED " + ", ".join(bad)))
    for t in results.get("targets", []):
        verdict = "info" if t["met"] is None else "met" if t["met"] else "MISSED"
        lines.append(f"target {t['name']}: {t['target']}: {t['measured']} -> {verdict} "
                     f"({t['margin']})")
    if results.get("skipped"):
        lines.append(f"skipped {len(results['skipped'])} items (budget or unavailable)")
    return "\n".join(lines)


def plot(results, path, T=4):
    """Fraction of the copy bandwidth and time per call against B at T, log axes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    Ts, Bs = tokens_and_batches(results)
    T = T if T in Ts else (Ts[0] if Ts else T)
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.4), dpi=80)
    for impl, label in COLUMNS:
        pts = [(B, best_time(results, impl, T, B)) for B in Bs]
        pts = [(B, r) for B, r in pts if r is not None]
        if not pts:
            continue
        xs = [B for B, _ in pts]
        if all(r.get("frac") for _, r in pts):
            left.plot(xs, [100 * r["frac"] for _, r in pts], marker="o", label=label)
        right.plot(xs, [r["us"] for _, r in pts], marker="o", label=label)
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch B")
        ax.grid(alpha=0.3)
    left.axhline(85, color="gray", linestyle="--", linewidth=0.8)
    left.set_ylabel("% of copy bandwidth")
    right.set_yscale("log")
    right.set_ylabel("us per call")
    right.legend(fontsize=7)
    meta = results.get("meta", {})
    fig.suptitle(f"KDA verify, H={meta.get('heads')}, T={T}, {meta.get('gpu')}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", help="results.json written by bench.py")
    parser.add_argument("-o", "--output", default=str(pathlib.Path(__file__).parent / "RESULTS.md"))
    parser.add_argument("--plot", default=None, help="also write the plot here (PNG)")
    parser.add_argument("--command", default=None, help="the command to name in RESULTS.md")
    args = parser.parse_args(argv)
    results = json.loads(pathlib.Path(args.results).read_text())
    results["targets"] = targets(results)
    pathlib.Path(args.output).write_text(render(results, args.command))
    if args.plot:
        plot(results, args.plot)
    print(summary(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
