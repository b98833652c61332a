"""results.json -> RESULTS.md (tables, date, GPU, command) and the plot, on any machine:

    python benchmarks/report.py RESULTS_JSON [-o benchmarks/RESULTS.md]
        [--plot benchmarks/bench.png] [--command "the exact device command"]

bench.py calls the same functions at the end of a run.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys

METHOD_ORDER = ("graph", "events", "jit fori_loop")
COLUMNS = (  # (impl, label) of the per-T tables
    ("ours-eager", "ours (kernel, eager)"),
    ("ours-jit", "ours (jitted fused_verify)"),
    ("ours-jit[jax]", "fused_verify backend=jax"),
    ("chunked-xla", "chunked_verify (XLA)"),
    ("stock-xla", "stock_verify (XLA)"),
    ("fla-recurrence", "fla recurrence"),
    ("fla-pipeline", "fla pipeline"),
)
WHAT_WAS_TIMED = """\
- **ours (kernel, eager)**: the fused CuTe DSL kernel through `jax_kda.ffi.eager_verify` on
  torch tensors (no XLA): CUDA events around each launch (`events`), and CUDA-graph replay
  of a captured sequence of launches (`graph`, for B <= 64). Split `auto` is the split
  `kernel_split` picks; the bytes are the state read once and written once per request with
  n > 0, the n accepted and T new records, the conv history and window, the inputs, the
  output and the weights.
- **ours (jitted fused_verify)**: `fused_verify(..., backend="cutedsl")` inside a jitted
  `lax.fori_loop` of N calls with the cache carried (donated): the per-call time includes
  XLA's launch gaps and one small dynamic-slice of the slot and record-row arrays per call
  (the state rotates through the slots; the token inputs stay the same), and each
  iteration of XLA's while loop, whose condition XLA on GPUs can read back on the host:
  an upper bound on the cost of a call under jit, not the straight-line overhead that
  the 20-layer step measures. Wall clock over the whole loop / N.
- **chunked_verify / stock_verify (XLA)**: `reference.chunked_verify` and
  `reference.stock_verify` (jitted) in the same fori_loop: what a JAX user has without us.
  Their cache holds only the B + 1 slots of the batch (no rotation), so at small B their
  state may sit in L2, which favours them.
- **fla recurrence**: `fla.ops.kda.fused_recurrent.fused_recurrent_kda_fwd` (fla-core
  wheel, Triton) as vLLM's spec-decode path calls it: state pool updated in place, per-token
  state indices [B, T] and accepted counts [B] (one FP32 state written per verify token),
  gate (lower bound, A_log, dt_bias), beta sigmoid and q/k L2 norms in the kernel,
  value-first state layout (ours), on q, k, v from the conv and the raw gate. Its bytes:
  one state read, T states written, q/k/v/g/beta in, output out.
- **fla pipeline**: the whole stock verify: `causal_conv1d_fwd` three times (q, k, v:
  the window as initial state, the new window as final state, SiLU), the gate
  up-projection as a bf16 `torch.matmul` (the model's linear layer), the recurrence above,
  and `layer_norm_gated_fwd` (RMS, sigmoid gate). Its fraction is taken on *our* bytes
  (the minimum the operation must move), so it compares directly with ours.
- Operand sets rotate (distinct state slots, records and inputs per set; enough sets that
  one cycle touches >= 512 MiB, at most 64) so a repeated call does not find its state in
  the 60 MB L2. For ours (eager) and fla each set also has its own copy of the weights,
  cold when its call runs, as each layer's are in a model; the XLA loops keep one set
  (their loop would slice stacked weights per call). The copy bandwidth is
  `dst.copy_(src)` of 1 GiB, bytes read + written.
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

    out += ["## Correctness (against reference.chunked_verify, checked before timing)", ""]
    rows = []
    for c in results.get("correctness", []):
        if "error" in c:
            rows.append([c["T"], c["impl"], "ERROR", c["error"][:120], "", ""])
            continue
        w = c["worst"]
        rows.append([c["T"], c["impl"], "ok" if c["ok"] else "**DISAGREES**", w["field"],
                     f"{w['rel_l2']:.2e}", f"{w['max_abs']:.2e}"])
    out += [table(["T", "implementation", "result", "worst field", "rel L2", "max abs"], rows),
            "", "Tolerance: rel L2 <= 2e-2 on bf16 fields, 1e-4 on FP32 state and corrections; "
            "NaN (an unwritten output: outputs are poisoned first) fails.", ""]

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
                "disagreed with the reference.", ""]
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

    layers = results.get("layers20", [])
    if layers:
        out += ["## The cost through JAX: a jitted step of 20 layers (T = 4)", "",
                "Each layer its own params and cache (donated), `fused_verify` per layer. "
                "`host`: the jitted step called from Python N times (a decode loop); "
                "`device`: a jitted fori_loop of N steps (its while loop's own cost "
                "included); `trace`: host-called steps timed on the device from JAX's "
                "profiler trace, first kernel's start to last kernel's end (no dispatch, no "
                "loop). Overhead per call = (step time - layers x raw kernel time) / layers, "
                "the raw time that of the step's own layers (their weights, caches and "
                "inputs) through the eager kernel, in the step's process right after it "
                "was timed, in a CUDA graph where PDL overlaps consecutive launches (where "
                "that cannot run, the sweep's eager kernel at the same B); 'raw in child "
                "graphs': the same launches each a child graph of its own, as XLA's "
                "command buffers hold a custom call (no overlap), and the overhead against "
                "that: what XLA adds beyond the lost overlap. Command buffers: "
                "`--xla_gpu_enable_command_buffer=` (off) or XLA's default (on); 'in HLO' "
                "counts `command_buffer` in the compiled HLO (0 is inconclusive: newer XLA "
                "also forms command buffers from thunks after HLO).", ""]
        rows = []
        for r in layers:
            if "error" in r:
                rows.append([r.get("cmdbuf"), "ERROR", r["error"][:150]] + [""] * 7)
                continue
            rows.append([r["cmdbuf"], r["mode"], r["B"], f"{r['step_us']:.1f}",
                         f"{r['raw_us']:.2f} ({r['raw_from']})" if "raw_us" in r else "-",
                         f"{r['overhead_us']:.2f}" if "overhead_us" in r else "-",
                         f"{r['serial_us']:.2f}" if "serial_us" in r else "-",
                         f"{r['overhead_serial_us']:.2f}" if "serial_us" in r else "-",
                         r.get("command_buffers_in_hlo"), r.get("compile_s")])
        out += [table(["cmdbuf", "mode", "B", "step us", "raw us per layer", "overhead us per call",
                       "raw in child graphs", "overhead against it", "in HLO", "compile s"],
                      rows), ""]

    memory = results.get("memory", [])
    if memory:
        out += [f"## Cache bytes per request (H = {memory[0]['heads']})", "",
                "Ours: one FP32 checkpoint, the conv window (T + 2 positions), one record row "
                "(T corrections f32, T keys and raw gates bf16), pending. Stock speculative "
                "layout: one FP32 state per verify token and a conv window of 3 + T - 1 "
                "positions.", ""]
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


def summary(results) -> str:
    """The short table printed last."""
    lines = []
    copy = results.get("copy", {})
    if copy:
        lines.append(f"copy {copy['tbps']:.3f} TB/s | {results['meta'].get('gpu')}")
    Ts, Bs = tokens_and_batches(results)
    short = [("ours-eager", "ours"), ("ours-jit", "ours-jit"), ("ours-jit[jax]", "jit[jax]"),
             ("chunked-xla", "chunked"), ("stock-xla", "stock"), ("fla-recurrence", "fla-rec"),
             ("fla-pipeline", "fla-pipe")]
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
    for r in results.get("layers20", []):
        if "step_us" in r:
            lines.append(f"{r['layers']} layers B={r['B']} cmdbuf {r['cmdbuf']} "
                         f"{r['mode']}: step {r['step_us']:.1f} us, overhead/call "
                         + (f"{r['overhead_us']:.2f} us" if "overhead_us" in r else "-"))
        else:
            lines.append(f"20 layers cmdbuf {r.get('cmdbuf')}: {r.get('error', '')[:200]}")
    bad = [f"{c['impl']} T={c['T']}" for c in results.get("correctness", []) if not c.get("ok")]
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
    pathlib.Path(args.output).write_text(render(results, args.command))
    if args.plot:
        plot(results, args.plot)
    print(summary(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
