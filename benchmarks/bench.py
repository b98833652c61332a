"""Benchmark of the KDA speculative verify on an H100 or H200: our fused kernel against
the same operation through XLA (the XLA backend and the stock reference) and against
the flash-linear-attention stock pipeline, and what a JAX decoder gets from it.

    python benchmarks/bench.py --out results              # on the GPU: 520 s by default
    python benchmarks/bench.py --out /tmp/bench --quick   # a CPU dry run: small sizes

It needs jax-kda with its `cuda` extra; torch runs the eager kernel's timings and,
with fla-core, the fla peer (where one is missing, its rows say so and are left out).
In order, each step only while the time budget (--budget-s) allows; a watchdog writes
the results and exits 30 s past it:
1. correctness first: per T, our kernel (eager DLPack with its output poisoned, every
   split at T = 4, and jitted), the XLA backend and stock_verify on the GPU, and the fla
   pipeline, against both references run on the CPU: the stock per-token recurrence
   (`jax_kda.ref.stock_verify`) and the XLA backend (`fused_verify(...,
   backend="jax")`); worst errors printed, an implementation that disagrees with either
   is flagged in every table;
2. the device-to-device copy bandwidth (the ceiling of every fraction);
3. H heads (32: a Kimi-Linear layer), T = 4, B in 1..256: our kernel (eager: CUDA
   events per launch and CUDA-graph replay; jitted fused_verify in a lax.fori_loop),
   the XLA backend (fori_loop), the fla recurrence alone and the whole fla pipeline;
4. the decoder step (`decoder.py`): 20 layers under `jax.lax.scan` over stacked params
   and cache and as a Python list of layers, jitted with the cache donated, compile
   and step times, once with XLA's command buffers on (its default) and once off, each
   in a subprocess; 4b. the prefill (`prefill.py`): one layer over prompts of 1k-16k
   tokens, ours against fla's `chunk_kda`, in a subprocess; 4c. the lazy checkpoint
   (`lazy.py`): our kernel at checkpoint_every 1, 2, 4, 8, time and bytes per step, in
   a subprocess;
5. the fixed splits at T = 4; 6. T = 2 and 8 for our kernel and fla; 7. stock_verify at
   B = 1, 64; 8. the fixed splits at T = 2, 8; 9. T = 2, 8 under XLA.

XLA's compiles of the references' timed loops (10-15 s each at B >= 16 on the H200,
with their autotuning) run on two threads during step 1 and are all done before
anything is timed.

Operand sets rotate (distinct state slots and inputs, and for ours eager and fla a copy of
the weights per set) so that a repeated call does not find its state or weights in L2.
A verify leaves its record rows awaiting an accept, so that every timed call replays as
many tokens as the first: each jitted verify is followed by `accept`, and the eager
kernel's pending counts are restored between timed launches, outside the timing.
Writes DIR/results.json (after every step), DIR/log.txt, DIR/RESULTS.md and
DIR/bench.png; prints a short table last.
"""
from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU
os.environ.setdefault("FLA_DISABLE_BACKEND_DISPATCH", "1")  # fla's Triton kernels only

import argparse
import concurrent.futures
import dataclasses
import datetime
import functools
import importlib.metadata
import json
import pathlib
import platform
import subprocess
import sys
import tempfile
import threading
import time
import traceback

# "on" (XLA's default, the targets' setting) first, so that a short budget keeps it
CMDBUF_FLAGS = {"on": "", "off": "--xla_gpu_enable_command_buffer="}
DECODER = pathlib.Path(__file__).resolve().parent / "decoder.py"
PREFILL = pathlib.Path(__file__).resolve().parent / "prefill.py"
LAZY = pathlib.Path(__file__).resolve().parent / "lazy.py"

import jax
import jax.numpy as jnp
import numpy as np

import measure  # benchmarks/, on sys.path as the script's folder
import peers
import report
from jax_kda import KdaConfig, accept, flush, fused_verify
from jax_kda.ref import stock_verify
from jax_kda.profiling import wall_times
from jax_kda.testing import random_cache, random_inputs, random_params
from jax_kda import cutedsl_supported

stock_jit = jax.jit(stock_verify, static_argnames="config")
xla_verify = functools.partial(fused_verify, backend="jax")
xla_jit = jax.jit(xla_verify, static_argnames="config")
# The references of the correctness step, on the CPU: XLA on a GPU drops f32 -> bf16 ->
# f32 round trips, i.e. some of the stock roundings.
REFERENCES = {"stock": stock_jit, "xla": xla_jit}
CPU = jax.devices("cpu")[0]
SAME_AS = {"xla": "xla", "stock-xla": "stock"}  # the reference each timed XLA program is


class Log:
    """print() to stdout and DIR/log.txt."""

    def __init__(self, path):
        self.file = open(path, "a", buffering=1)
        self.start = time.perf_counter()

    def __call__(self, *parts):
        line = f"[{time.perf_counter() - self.start:5.0f}s] " + " ".join(str(p) for p in parts)
        print(line, flush=True)
        self.file.write(line + "\n")


def problem(config: KdaConfig, B: int, nsets: int, seed: int):
    """Weights, one cache of 1 + nsets * B slots and nsets * B record rows, and nsets
    VerifyInputs of B requests each on disjoint slots and record rows (traceable)."""
    kp, kc, ki = jax.random.split(jax.random.key(seed), 3)
    params = random_params(kp, config)
    cache = random_cache(kc, config, 1 + nsets * B, nsets * B)
    rows = jnp.arange(nsets * B, dtype=jnp.int32)
    full = random_inputs(ki, config, rows + 1, rows)
    sets = [jax.tree.map(lambda a: a[s * B:(s + 1) * B], full) for s in range(nsets)]
    return params, cache, sets


def make_problem(config: KdaConfig, B: int, nsets: int, seed: int):
    """`problem`'s arrays, ready."""
    return jax.block_until_ready(problem(config, B, nsets, seed))


def loop_operands(config: KdaConfig, B: int, nsets: int, seed: int):
    """The timed fori_loop's operands: weights, cache, the first set's token inputs, and
    every set's slots, record rows and accepted counts (their pending counts at the
    start, so that each accept restores them), stacked (traceable: eval_shape gives the
    shapes its compile needs)."""
    params, cache, sets = problem(config, B, nsets, seed)
    return (params, cache, sets[0], jnp.stack([s.slots for s in sets]),
            jnp.stack([s.record_rows for s in sets]),
            jnp.stack([cache.pending[s.record_rows, 0] for s in sets]))


def accepted_tokens(cache, inputs):
    """(sum of n, requests with n > 0) over the requests of `inputs`: what the replay
    moves (every head of a record row has the same count)."""
    n = np.asarray(cache.pending)[np.asarray(inputs.record_rows), 0]
    return int(n.sum()), int((n > 0).sum())


def auto_split_label(config, batch):
    """"auto(s)" with the split the kernel runs `config` with at `batch`, or "auto"."""
    try:
        from jax_kda.ffi import kernel_split
        return f"auto({kernel_split(config, batch)})"
    except Exception:  # noqa: BLE001 - only a label
        return "auto"


def compare(name, got, ref, tol):
    """Relative L2 error and max abs error of `got` against `ref`; NaN (unwritten or
    broken) fails."""
    got = np.asarray(got, np.float64)
    ref = np.asarray(ref, np.float64)
    finite = bool(np.isfinite(got).all())
    diff = np.nan_to_num(got - ref, nan=np.inf)
    rel = float(np.linalg.norm(diff) / max(np.linalg.norm(ref), 1e-30)) if finite else float("inf")
    return {"field": name, "rel_l2": rel, "max_abs": float(np.abs(diff).max()),
            "finite": finite, "ok": finite and rel <= tol}


def to_numpy(array):
    if hasattr(array, "detach"):  # torch
        return array.detach().float().cpu().numpy()
    return np.asarray(jnp.asarray(array, jnp.float32))


# Relative L2 error allowed per field: bf16 outputs, keys and raw gates; the FP32 state
# and corrections up to summation order; the window and pending are copies.
TOLERANCES = {"out": 2e-2, "state": 1e-4, "corrections": 1e-4, "key_gates": 2e-2,
              "conv": 0.0, "pending": 0.0}


class Bench:
    def __init__(self, args, log):
        self.args, self.log = args, log
        self.budget = measure.Budget(args.budget_s)
        self.torch = peers.torch_or_none()
        self.eager_why = peers.kernel_eager_unavailable(self.torch)
        self.fla_why = peers.fla_unavailable(self.torch)
        self.kernel_jit = "cutedsl" if cutedsl_supported() else None
        self.costs = {}
        self.programs = {}
        self.results = {"meta": self.meta(), "correctness": [], "points": [],
                        "decoder": [], "prefill": [], "lazy": [], "memory": [],
                        "targets": [],
                        "skipped": []}
        self.flagged = set()

    # -- bookkeeping ------------------------------------------------------------------

    def meta(self):
        device = jax.devices()[0]
        versions = {"python": platform.python_version(), "jax": jax.__version__}
        for name in ("jaxlib", "jax-cuda13-plugin", "torch", "triton", "nvidia-cutlass-dsl",
                     "fla-core", "cupy-cuda13x"):
            try:
                versions[name] = importlib.metadata.version(name)
            except importlib.metadata.PackageNotFoundError:
                versions[name] = None
        return {
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "gpu": getattr(device, "device_kind", str(device)),
            "platform": device.platform,
            "command": "python " + " ".join(sys.argv),
            "heads": self.args.heads,
            "quick": self.args.quick,
            "versions": versions,
            "budget_s": self.args.budget_s,
            "kernel_eager": self.eager_why or "available",
            "kernel_jit": self.kernel_jit or "not available (no sm_90 GPU or no CuTe DSL)",
            "fla": self.fla_why or "available",
            "rotation": f"operand sets cycled so one cycle touches >= "
                        f"{measure.ROTATE_BYTES >> 20} MiB (at most {measure.MAX_SETS} sets)",
        }

    def save(self):
        self.results["meta"]["elapsed_s"] = round(self.budget.elapsed(), 1)
        path = pathlib.Path(self.args.out) / "results.json"
        path.write_text(json.dumps(self.results, indent=1))

    def affordable(self, kind, what, default_s=15.0):
        cost = self.costs.get(kind, default_s)
        if self.budget.allows(cost):
            return True
        self.results["skipped"].append(f"{what}: budget ({self.budget.left():.0f} s left, "
                                       f"about {cost:.0f} s needed)")
        self.log(f"  skip {what}: budget")
        return False

    def run_point(self, kind, what, fn):
        """fn() -> list of point dicts; errors become rows; the cost is remembered."""
        start = time.perf_counter()
        try:
            rows = fn()
        except Exception as error:  # noqa: BLE001 - a broken peer must not stop the run
            rows = [{"error": f"{type(error).__name__}: {str(error)[:300]}"}]
            self.log(f"  {what}: ERROR {rows[0]['error']}")
            self.log(traceback.format_exc(limit=4))
        self.costs[kind] = time.perf_counter() - start
        for row in rows:
            row.setdefault("what", what)
            self.results["points"].append(row)
            if "us" in row:
                self.log(f"  {what:<44} {row['us']:9.2f} us  {row.get('tbps', 0):6.3f} TB/s"
                         f"  {100 * (row.get('frac') or 0):5.1f}% of copy  {row.get('note', '')}")
        self.save()

    def point(self, impl, T, B, split, seconds, nbytes, **extra):
        copy = self.results.get("copy", {}).get("tbps")
        row = {"impl": impl, "T": T, "B": B, "heads": self.args.heads, "split": split,
               "us": seconds * 1e6, "bytes": nbytes}
        if seconds:
            row["tbps"] = nbytes / seconds / 1e12
            row["frac"] = row["tbps"] / copy if copy else None
        checked = f"{impl}[split={split}]" if isinstance(split, int) else impl
        if checked in self.flagged or (impl == "fla-recurrence" and "fla-pipeline" in self.flagged):
            row["flag"] = "disagrees with a reference"
        row.update(extra)
        return row

    # -- 1. correctness -----------------------------------------------------------------

    def correctness(self, T):
        H, B = self.args.heads, self.args.check_batch
        config = KdaConfig(heads=H, tokens=T)
        params, cache, sets = make_problem(config, B, 1, seed=100 + T)
        inputs = sets[0]
        on_cpu = jax.device_put((params, cache, inputs), CPU)
        references = {}
        for name, fn in REFERENCES.items():
            out, new = fn(*on_cpu, config=config)
            references[name] = (to_numpy(out), {f: to_numpy(getattr(new, f))
                                                for f in TOLERANCES if f != "out"})

        def check(impl, out, new_cache=None):
            fields = [f for f in TOLERANCES if f == "out" or new_cache is not None]
            got = {f: to_numpy(out if f == "out" else getattr(new_cache, f)) for f in fields}
            for reference, (ref_out, ref_cache) in references.items():
                if SAME_AS.get(impl) == reference and jax.devices()[0] == CPU:
                    continue  # the same program on the same device: equal by construction
                rows = [compare(f, got[f], ref_out if f == "out" else ref_cache[f],
                                TOLERANCES[f]) for f in fields]
                worst = max(rows, key=lambda r: r["rel_l2"])
                ok = all(r["ok"] for r in rows)
                if not ok:
                    self.flagged.add(impl)
                self.results["correctness"].append(
                    {"impl": impl, "reference": reference, "T": T, "B": B, "heads": H,
                     "ok": ok, "worst": worst, "fields": rows})
                self.log(f"  T={T} {impl:<22} vs {reference:<5} {'ok ' if ok else 'BAD'} "
                         f"worst {worst['field']}: rel L2 {worst['rel_l2']:.2e}, max abs "
                         f"{worst['max_abs']:.2e}")

        def attempt(impl, fn):
            try:
                fn()
            except Exception as error:  # noqa: BLE001
                self.flagged.add(impl)
                message = f"{type(error).__name__}: {str(error)[:300]}"
                self.results["correctness"].append({"impl": impl, "T": T, "ok": False,
                                                    "error": message})
                self.log(f"  T={T} {impl:<22} ERROR {message}")

        if self.eager_why is None:
            def eager(impl, split):
                kernel = peers.KernelEager.rotating(self.torch, params, cache, sets,
                                                    KdaConfig(heads=H, tokens=T, split=split))
                check(impl, kernel.poisoned_run(0), kernel.caches[0])
            attempt("ours-eager", lambda: eager("ours-eager", None))
            for split in self.args.splits if T == 4 else ():  # every variant timed at T=4
                impl = f"ours-eager[split={split}]"
                attempt(impl, lambda: eager(impl, split))
        if self.kernel_jit:
            attempt("ours-jit", lambda: check("ours-jit", *fused_verify(
                params, cache, inputs, config, backend=self.kernel_jit)))
        attempt("xla", lambda: check("xla", *xla_jit(params, cache, inputs, config=config)))
        if T in self.args.stock_tokens:
            attempt("stock-xla", lambda: check("stock-xla", *stock_jit(params, cache, inputs,
                                                                       config=config)))
        if self.fla_why is None:
            def fla():
                flushed = flush(params, cache, inputs.slots, inputs.record_rows, config)
                stock = peers.FlaStock(
                    self.torch, params, cache, sets, config,
                    checkpoint=flushed.state[inputs.slots],
                    windows=flushed.conv[inputs.slots][..., 0:3])
                check("fla-pipeline", stock.pipeline(0))
            attempt("fla-pipeline", fla)
        self.save()

    # -- 2. ceiling ---------------------------------------------------------------------

    def copy_bandwidth(self):
        nbytes = (64 << 20) if self.args.quick else (1 << 30)
        copy = measure.copy_bandwidth(self.torch if peers.cuda_ready(self.torch) else None,
                                      nbytes)
        self.results["copy"] = copy
        self.log(f"copy bandwidth: {copy['tbps']:.3f} TB/s (read + write, {copy['how']})")
        self.save()

    # -- 3. timed points ------------------------------------------------------------------

    def torch_timings(self, fn, nsets, B, reset=None):
        """events: one launch at a time; graph: replay of a captured launch sequence
        (for B <= graph_max_batch). reset (our kernel's pending counts): run before each
        launch, or each replay of one launch per set, outside the timing."""
        torch = self.torch
        fn(0)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for i in range(5):
            fn(i % nsets)
        torch.cuda.synchronize()
        rough = (time.perf_counter() - start) / 5
        reps = int(min(200, max(10, 0.3 / max(rough, 1e-6))))
        events = measure.torch_event_times(torch, fn, nsets, reps, reset=reset)
        graph, note = None, ""
        if B <= self.args.graph_max_batch:
            calls = nsets if reset else int(min(512, max(nsets, 2e-3 / max(events, 1e-7))))
            try:
                graph = measure.torch_graph_time(torch, fn, nsets, calls, replays=10,
                                                 reset=reset)
            except Exception as error:  # noqa: BLE001
                note = f"graph capture failed: {type(error).__name__}: {str(error)[:120]}"
        return events, graph, note

    def ours_eager(self, T, B, split, state_dtype="float32"):
        H = self.args.heads
        config = KdaConfig(heads=H, tokens=T, split=split, state_dtype=state_dtype)
        state_bytes = config.state_dtype.itemsize
        probe = measure.verify_bytes(H, T, B, B * T, B, state_bytes)["total"]
        # each set is launched once per graph replay: its pending counts are restored
        # between replays
        nsets = measure.rotation_sets(probe, measure.MIN_LAUNCHES)
        params, cache, sets = make_problem(config, B, nsets, seed=B * 10 + T)
        n_total, writes = accepted_tokens(cache, sets[0])
        nbytes = measure.verify_bytes(H, T, B, n_total, writes, state_bytes)["total"]
        kernel = peers.KernelEager.rotating(self.torch, params, cache, sets, config)
        events, graph, note = self.torch_timings(kernel, nsets, B, reset=kernel.rearm)
        del kernel
        label = split if split else auto_split_label(config, B)
        # a bf16 state's rows an implementation of their own in the report's tables
        impl = "ours-eager" if state_bytes == measure.F32 else f"ours-eager-{state_dtype}-state"
        rows = [self.point(impl, T, B, label, events, nbytes, method="events", sets=nsets,
                           state=state_dtype, note=note)]
        if graph:
            rows.append(self.point(impl, T, B, label, graph, nbytes, method="graph",
                                   sets=nsets, state=state_dtype))
        return rows

    def fla_points(self, T, B):
        H = self.args.heads
        config = KdaConfig(heads=H, tokens=T)
        probe = measure.fla_recurrence_bytes(H, T, B)["total"]
        nsets = measure.rotation_sets(probe)
        params, cache, sets = make_problem(config, B, nsets, seed=B * 10 + T + 1)
        stock = peers.FlaStock(self.torch, params, cache, sets, config)
        stock.prepare_recurrence()
        rec_bytes = measure.fla_recurrence_bytes(H, T, B)["total"]
        ours_bytes = measure.verify_bytes(H, T, B, B * (T + 1) // 2, B)["total"]
        rows = []
        # the pipeline's fraction is taken on our bytes: the same operation's minimum
        for name, run, nbytes in (("fla-recurrence", stock.recurrence_only, rec_bytes),
                                  ("fla-pipeline", stock.pipeline, ours_bytes)):
            events, graph, note = self.torch_timings(run, nsets, B)
            rows.append(self.point(name, T, B, None, events, nbytes, method="events",
                                   sets=nsets, note=note))
            if graph:
                rows.append(self.point(name, T, B, None, graph, nbytes, method="graph",
                                       sets=nsets))
        return rows

    def loop_program(self, fn, T, B, rotate=True):
        """`fn` (fused_verify or a reference) and `accept` in a jitted lax.fori_loop
        carrying the cache (donated) and the output, compiled ahead of time for the
        shapes of its operands: (compiled, compile seconds, operand sets, seed). rotate:
        the loop cycles the state slots, record rows and accepted counts of the rotation
        sets (small dynamic slices per call); else one set of B + 1 slots. The token
        inputs stay the same."""
        H = self.args.heads
        config = KdaConfig(heads=H, tokens=T)
        probe = measure.verify_bytes(H, T, B, B * T, B)["total"]
        nsets = measure.rotation_sets(probe) if rotate else 1
        seed = B * 10 + T + 2

        def loop(params, cache, fixed, slots, rows_, accepted, n):
            def body(i, carry):
                cache, _ = carry
                s = i % slots.shape[0]
                inputs = dataclasses.replace(fixed, slots=slots[s], record_rows=rows_[s])
                out, cache = fn(params, cache, inputs, config)
                return accept(cache, rows_[s], accepted[s], config), out

            out0 = jnp.zeros((B, T, H, 128), jnp.bfloat16)
            return jax.lax.fori_loop(0, n, body, (cache, out0))

        shapes = jax.eval_shape(functools.partial(loop_operands, config, B, nsets, seed))
        start = time.perf_counter()
        compiled = jax.jit(loop, donate_argnums=(1,)).lower(
            *shapes, jax.ShapeDtypeStruct((), jnp.int32)).compile()
        return compiled, time.perf_counter() - start, nsets, seed

    def precompile_references(self):
        """XLA's compiles of the references' loops (with its autotuning, 10-15 s each at
        B >= 16 on the H200), two at a time on threads, while the correctness checks run:
        {(impl, T, B): future of loop_program}. Our kernel's jitted loop is compiled where
        it is timed: its lowering compiles the CuTe DSL kernel, kept to the main thread."""
        args = self.args
        jobs = [("xla", xla_verify, T, B) for T in args.tokens for B in args.batches]
        jobs += [("stock-xla", stock_verify, T, B) for T in args.stock_tokens
                 for B in args.stock_batches]
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=2)
        self.programs = {(impl, T, B): pool.submit(self.loop_program, fn, T, B, rotate=False)
                         for impl, fn, T, B in jobs}
        pool.shutdown(wait=False)

    def await_precompiles(self):
        """No compile (nor its autotuning's launches) may run beside a timed kernel."""
        start = time.perf_counter()
        concurrent.futures.wait(self.programs.values())
        self.log(f"  XLA's compiles of the references: waited {time.perf_counter() - start:.0f} s")

    def jax_loop(self, impl, fn, T, B, rotate=True):
        """Per-call time of `fn` in `loop_program`'s loop (precompiled where it could be)."""
        future = self.programs.get((impl, T, B))
        compiled, compile_s, nsets, seed = (future.result() if future else
                                            self.loop_program(fn, T, B, rotate))
        config = KdaConfig(heads=self.args.heads, tokens=T)
        params, cache, fixed, slots, rows_, accepted = jax.block_until_ready(
            loop_operands(config, B, nsets, seed))
        n_total, writes = accepted_tokens(cache, fixed)
        nbytes = measure.verify_bytes(self.args.heads, T, B, n_total, writes)["total"]
        state = {"cache": cache}

        def run(n):
            state["cache"], out = compiled(params, state["cache"], fixed, slots, rows_,
                                           accepted, jnp.int32(n))
            jax.block_until_ready(out)

        run(1)  # warm-up
        rough = wall_times(lambda: run(3), 1) / 3
        n = int(min(5000, max(10, 0.05 / max(rough, 1e-7))))
        seconds = wall_times(lambda: run(n), 3) / n
        return [self.point(impl, T, B, "auto" if impl.startswith("ours") else None, seconds,
                           nbytes, method="jit fori_loop", sets=nsets, loop_calls=n,
                           compile_s=round(compile_s, 1))]

    def sweep(self, T, batches, impls=("eager", "fla", "jit", "xla")):
        """The implementations `impls` at T over `batches` (our kernel at split auto)."""
        jobs = {
            "eager": (self.eager_why is None, "ours-eager",
                      lambda B: [row for dtype in self.args.state_dtypes
                                 for row in self.ours_eager(T, B, None, dtype)]),
            "fla": (self.fla_why is None, "fla", lambda B: self.fla_points(T, B)),
            "jit": (self.kernel_jit is not None, "ours-jit", lambda B: self.jax_loop(
                "ours-jit", functools.partial(fused_verify, backend=self.kernel_jit), T, B)),
            # XLA's scatter into the cache costs O(slots) per call: the references get
            # the smallest cache (B + 1 slots, no rotation), their best case.
            "xla": (True, "xla", lambda B: self.jax_loop("xla", xla_verify, T, B,
                                                         rotate=False)),
            "stock": (True, "stock-xla", lambda B: self.jax_loop(
                "stock-xla", stock_verify, T, B, rotate=False)),
        }
        for B in batches:
            for kind in impls:
                runs, name, job = jobs[kind]
                what = f"{name} T={T} B={B}"
                if runs and self.affordable(kind, what, 30.0 if kind == "stock" else 15.0):
                    self.run_point(kind, what, lambda: job(B))

    def splits(self, T, batches):
        if self.eager_why is not None:
            return
        for split in self.args.splits:
            for B in batches:
                what = f"ours-eager T={T} B={B} split={split}"
                if self.affordable("eager", what):
                    self.run_point("eager", what, lambda: self.ours_eager(T, B, split))

    # -- 4. the decoder step ----------------------------------------------------------------

    def decoder_steps(self):
        """decoder.py once per command-buffer setting, each in a subprocess with its
        XLA_FLAGS (the rows it wrote before an error or the timeout are kept); the
        first setting picks the scan's unroll, the others run the same program."""
        backend = self.kernel_jit or "jax"
        unroll = []
        for setting, flag in CMDBUF_FLAGS.items():
            if not self.affordable("decoder", f"decoder step, command buffers {setting}", 60):
                continue
            start = time.perf_counter()
            left = self.budget.left() - self.budget.reserve_s
            with tempfile.TemporaryDirectory() as tmp:
                target = pathlib.Path(tmp) / "decoder.json"
                env = dict(os.environ)
                env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + flag).strip()
                command = [sys.executable, str(DECODER), "--json", str(target),
                           "--heads", str(self.args.heads), "--layers", str(self.args.layers),
                           "--batches", ",".join(map(str, self.args.layer_batches)),
                           "--backend", backend, "--budget-s", str(max(1.0, left - 30))]
                command += ["--unroll", str(unroll[0])] if unroll else []
                error = None
                try:
                    done = subprocess.run(command, env=env, capture_output=True, text=True,
                                          timeout=max(10.0, left))
                    self.log(done.stdout.strip())
                    if done.returncode != 0:
                        error = f"exit {done.returncode}: {done.stderr[-600:]}"
                except subprocess.TimeoutExpired:
                    error = f"timed out after {left:.0f} s"
                rows = json.loads(target.read_text()) if target.exists() else []
            if error:
                self.log(f"  decoder step, command buffers {setting}: {error}")
                rows.append({"error": error})
            for row in rows:
                row["cmdbuf"] = setting
                row["xla_flags"] = flag or "(XLA default)"
            unroll = unroll or [r["unroll"] for r in rows if r.get("used")][:1]
            self.results["decoder"] += rows
            self.costs["decoder"] = time.perf_counter() - start
            self.save()

    # -- 4b, 4c. the prefill and the lazy checkpoint -----------------------------------

    def section(self, kind, script, arguments, default_s, env=None):
        """`script --json FILE *arguments` in a subprocess; the rows it wrote (before an
        error or the timeout too) go to results[kind]."""
        if not self.affordable(kind, f"{kind} section", default_s):
            return
        start = time.perf_counter()
        left = self.budget.left() - self.budget.reserve_s
        with tempfile.TemporaryDirectory() as tmp:
            target = pathlib.Path(tmp) / f"{kind}.json"
            command = [sys.executable, str(script), "--json", str(target), *arguments]
            try:
                done = subprocess.run(command, capture_output=True, text=True,
                                      timeout=max(10.0, left), env={**os.environ, **(env or {})})
                self.log(done.stdout.strip())
                if done.returncode != 0:
                    self.log(f"  {kind}: exit {done.returncode}: {done.stderr[-600:]}")
            except subprocess.TimeoutExpired:
                self.log(f"  {kind}: timed out after {left:.0f} s")
            self.results[kind] = json.loads(target.read_text()) if target.exists() else []
        self.costs[kind] = time.perf_counter() - start
        self.save()

    def prefills(self):
        """prefill.py: ours and fla's chunk_kda on the same prompts."""
        left = self.budget.left() - self.budget.reserve_s
        self.section("prefill", PREFILL, ["--heads", str(self.args.heads), "--points",
                                          self.args.prefill_points,
                                          "--budget-s", str(max(1.0, left - 30))], 90)

    def lazies(self):
        """lazy.py: the kernel at checkpoint_every 1, 2, 4, 8 (its data built on the CPU,
        its check against the XLA backend there)."""
        if self.eager_why:
            self.results["skipped"].append(f"lazy section: unavailable ({self.eager_why})")
            return
        self.section("lazy", LAZY, ["--points", self.args.lazy_points], 200,
                     env={"JAX_PLATFORMS": "cpu"})

    # -- the run --------------------------------------------------------------------------

    def run(self):
        args, log = self.args, self.log
        meta = self.results["meta"]
        log(f"{meta['date']}  {meta['gpu']}  jax {jax.__version__}  budget {args.budget_s} s")
        log(f"kernel eager: {meta['kernel_eager']}; kernel jit: {meta['kernel_jit']}; "
            f"fla: {meta['fla']}")
        self.results["memory"] = [measure.memory_per_request(measure.KIMI_HEADS, T)
                                  for T in range(2, 9)]
        for rows, why in (("our kernel, eager (ours-eager)", self.eager_why),
                          ("our kernel under jit (ours-jit)",
                           None if self.kernel_jit else "no sm_90 GPU or no CuTe DSL"),
                          ("fla (fla-recurrence, fla-pipeline)", self.fla_why)):
            if why:
                self.results["skipped"].append(f"{rows}: unavailable ({why})")
        self.precompile_references()
        log("1. correctness (against the stock reference and the XLA backend, on the CPU)")
        for T in args.tokens:
            self.correctness(T)
        self.await_precompiles()
        log("2. ceiling")
        self.copy_bandwidth()
        first = 4 if 4 in args.tokens else args.tokens[0]
        rest = [T for T in args.tokens if T != first]
        log(f"3. T={first}, split auto, every implementation")
        self.sweep(first, args.batches)
        log(f"4. the decoder step: {args.layers} layers, scan and list")
        self.decoder_steps()
        log("4b. the prefill: ours and fla's chunk_kda")
        self.prefills()
        log("4c. the lazy checkpoint: checkpoint_every 1, 2, 4, 8")
        self.lazies()
        log(f"5. T={first}, fixed splits")
        self.splits(first, args.batches)
        for T in rest:
            log(f"6. T={T}, split auto: our kernel and fla")
            self.sweep(T, args.batches, ("eager", "fla"))
        log("7. stock_verify (lax.scan) under XLA")
        for T in args.stock_tokens:
            self.sweep(T, args.stock_batches, ("stock",))
        for T in rest:
            log(f"8. T={T}, fixed splits")
            self.splits(T, args.batches)
        for T in rest:
            log(f"9. T={T}, split auto: under XLA")
            self.sweep(T, args.batches, ("jit", "xla"))
        self.finish()

    def finish(self):
        out = pathlib.Path(self.args.out)
        self.results["targets"] = report.targets(self.results)
        self.save()
        try:
            report.plot(self.results, out / "bench.png")
        except Exception as error:  # noqa: BLE001 - no matplotlib on a dry-run machine
            self.log(f"plot: {type(error).__name__}: {error}")
        (out / "RESULTS.md").write_text(report.render(self.results))
        self.log("")
        self.log(report.summary(self.results))


def parse(argv):
    ints = lambda text: [int(v) for v in text.split(",") if v]
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder for results.json, log, plot")
    parser.add_argument("--quick", action="store_true",
                        help="CPU dry run: H=2, T 2,4, B 1,2, 3 layers")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="wall-clock budget of the run (default 520; --quick 480)")
    parser.add_argument("--heads", type=int, default=None, help="H (default 32; --quick 2)")
    parser.add_argument("--tokens", type=ints, default=None, help="T values (default 2,4,8)")
    parser.add_argument("--batches", type=ints, default=None,
                        help="B values (default 1,4,16,64,256; --quick 1,2)")
    parser.add_argument("--state-dtypes", type=lambda text: text.split(","),
                        default=["float32"], help="the eager kernel's state dtypes "
                                                  "(default float32; float32,bfloat16)")
    parser.add_argument("--splits", type=ints, default=[1, 2, 4, 8],
                        help="fixed splits timed besides auto (default 1,2,4,8)")
    parser.add_argument("--stock-tokens", type=ints, default=[4],
                        help="T values where stock_verify is checked and timed (default 4)")
    parser.add_argument("--stock-batches", type=ints, default=None,
                        help="B values where stock_verify is timed (default 1,64)")
    parser.add_argument("--check-batch", type=int, default=4, help="B of the correctness points")
    parser.add_argument("--graph-max-batch", type=int, default=256,
                        help="largest B also timed through CUDA-graph replay (default 256)")
    parser.add_argument("--layers", type=int, default=None,
                        help=f"layers of the decoder step (default {measure.KIMI_LAYERS})")
    parser.add_argument("--layer-batches", type=ints, default=None,
                        help="B of the decoder step (default 1,16,64; --quick 1,2)")
    parser.add_argument("--lazy-points", default=None,
                        help="BxTxC points of the lazy checkpoint section (default: T = 4 at "
                             "B = 1, 64, 256 and C = 1, 2, 4, 8; T = 2, 8 at B = 64 and C = 1, "
                             "4; --quick 2x4x1,2x4x2)")
    parser.add_argument("--prefill-points", default=None,
                        help="BxL prompts of the prefill section (default 1x1024,1x4096,"
                             "1x16384,8x2048; --quick 1x128,2x160)")
    args = parser.parse_args(argv)
    quick = args.quick
    args.budget_s = args.budget_s or (480.0 if quick else 520.0)
    args.heads = args.heads or (2 if quick else measure.KIMI_HEADS)
    args.tokens = args.tokens or ([2, 4] if quick else [2, 4, 8])
    args.batches = args.batches or ([1, 2] if quick else [1, 4, 16, 64, 256])
    args.stock_batches = args.stock_batches or ([1] if quick else [1, 64])
    args.layers = args.layers or (3 if quick else measure.KIMI_LAYERS)
    args.layer_batches = args.layer_batches or ([1, 2] if quick else [1, 16, 64])
    args.lazy_points = args.lazy_points or ("2x4x1,2x4x2" if quick else ",".join(
        f"{B}x{T}x{C}" for B, T, C in measure.LAZY_POINTS))
    args.prefill_points = args.prefill_points or (
        "1x128,2x160" if quick else "1x1024,1x4096,1x16384,8x2048")
    return args


def main(argv=None):
    args = parse(sys.argv[1:] if argv is None else argv)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    bench = Bench(args, Log(out / "log.txt"))
    threading.Thread(target=watchdog, args=(bench,), daemon=True).start()
    bench.run()
    return 0


def watchdog(bench, grace_s=30.0):
    """A run stuck past its budget (a hung launch, a slow compile) still leaves its
    results: write them and exit."""
    while bench.budget.left() > -grace_s:
        time.sleep(1.0)
    bench.log(f"watchdog: {bench.budget.elapsed():.0f} s, past the budget; writing results "
              f"and exiting")
    try:
        bench.results["skipped"].append("the rest: the run passed its budget (watchdog)")
        bench.finish()
    finally:
        os._exit(3)


if __name__ == "__main__":
    sys.exit(main())
