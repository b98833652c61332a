"""Benchmark of the KDA speculative verify (issue 5): our fused kernel against the same
operation through XLA and against the flash-linear-attention stock pipeline, on an
H100/H200; a dry run on CPU with --quick.

    python benchmarks/bench.py --out DIR [--quick] [--budget-s 400]

In order, each step only while the time budget allows (the device call has 8 minutes;
a watchdog writes the results and exits 30 s past the budget):
1. correctness first: per T, our kernel (eager DLPack, every split at T = 4, and
   jitted), stock_verify and the fla pipeline against reference.chunked_verify on one
   point; worst errors printed, a disagreeing implementation is flagged in every table;
2. the device-to-device copy bandwidth (the ceiling of every fraction);
3. H heads (32: a Kimi-Linear layer), T = 4, B in 1..256: our kernel (eager: CUDA
   events per launch and CUDA-graph replay; jitted fused_verify in a lax.fori_loop),
   chunked_verify in XLA (fori_loop), the fla recurrence alone and the whole fla pipeline;
4. a jitted step of 20 layers calling fused_verify per layer, XLA command buffers (CUDA
   graphs) off and on, each in a subprocess, against the same layers through the raw
   kernel in that process: JAX's overhead per call;
5. the fixed splits at T = 4; 6. T = 2 and 8 for our kernel and fla; 7. stock_verify at
   B = 1, 64; 8. the fixed splits at T = 2, 8; 9. T = 2, 8 under XLA.

XLA's compiles of the references' timed loops (10-15 s each at B >= 16 on the H200, with
their autotuning) run on two threads during step 1, and are all done before anything is
timed.

Operand sets rotate (distinct state slots and inputs, and for ours eager and fla a copy of
the weights per set) so that a repeated call does not find its state or weights in L2.
Writes DIR/results.json (after every step), DIR/log.txt, DIR/RESULTS.md and
DIR/bench.png; prints a short table last.
"""
from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU
os.environ.setdefault("FLA_DISABLE_BACKEND_DISPATCH", "1")  # fla's Triton kernels only

import argparse
import concurrent.futures
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

LAYERS = 20  # KDA layers of Kimi-Linear
CMDBUF_FLAGS = {"off": "--xla_gpu_enable_command_buffer=", "on": ""}  # "on": XLA's default
FLA_ISSUE_US = {1: 11.5, 64: 221.0, 256: 976.0}  # issue 5's fla stock verify at H=32, T=4

import jax
import jax.numpy as jnp
import numpy as np

import measure  # benchmarks/, on sys.path as the script's folder
import peers
import report
from jax_kda import KdaConfig, VerifyInputs, flush, fused_verify
from jax_kda.reference import chunked_verify, stock_verify
from jax_kda.testing import random_cache, random_inputs, random_params
from jax_kda.verify import cutedsl_supported

stock_jit = jax.jit(stock_verify, static_argnames="config")


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
    sets = [VerifyInputs(*(getattr(full, f)[s * B:(s + 1) * B] for f in
                           ("x", "f_a", "beta", "gate", "slots", "record_rows")))
            for s in range(nsets)]
    return params, cache, sets


def make_problem(config: KdaConfig, B: int, nsets: int, seed: int):
    """`problem`'s arrays, ready."""
    return jax.block_until_ready(problem(config, B, nsets, seed))


def loop_operands(config: KdaConfig, B: int, nsets: int, seed: int):
    """The timed fori_loop's operands: weights, cache, the first set's token inputs, and
    every set's slots and record rows, stacked (traceable: eval_shape gives the shapes
    its compile needs)."""
    params, cache, sets = problem(config, B, nsets, seed)
    return (params, cache, sets[0], jnp.stack([s.slots for s in sets]),
            jnp.stack([s.record_rows for s in sets]))


def accepted_tokens(cache, inputs):
    """(sum of n, requests with n > 0) over the requests of `inputs`: what the replay
    moves."""
    n = np.asarray(cache.pending)[np.asarray(inputs.record_rows)]
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


OUT_TOL, STATE_TOL = 2e-2, 1e-4  # bf16 outputs; FP32 state up to summation order


class Bench:
    def __init__(self, args, log):
        self.args, self.log = args, log
        self.budget = measure.Budget(args.budget_s)
        self.torch = peers.torch_or_none()
        self.eager_why = peers.kernel_eager_unavailable(self.torch)
        self.fla_why = peers.fla_unavailable(self.torch)
        self.kernel_jit = "cutedsl" if cutedsl_supported() else None
        self.jit_backend = self.kernel_jit or ("jax" if args.quick else None)
        self.costs = {}
        self.programs = {}
        self.results = {"meta": self.meta(), "correctness": [], "points": [],
                        "layers20": [], "memory": [], "targets": [], "skipped": []}
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
                         f"  {100 * row.get('frac', 0):5.1f}% of copy  {row.get('note', '')}")
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
            row["flag"] = "disagrees with chunked_verify"
        row.update(extra)
        return row

    # -- 1. correctness -----------------------------------------------------------------

    def correctness(self, T):
        H, B = self.args.heads, self.args.check_batch
        config = KdaConfig(heads=H, tokens=T)
        params, cache, sets = make_problem(config, B, 1, seed=100 + T)
        inputs = sets[0]
        ref_out, ref_cache = chunked_verify(params, cache, inputs, config)
        ref_out = to_numpy(ref_out)
        cache_fields = ("state", "conv", "corrections", "key_gates")

        def check(impl, out, new_cache=None):
            rows = [compare("out", to_numpy(out), ref_out, OUT_TOL)]
            for name in cache_fields if new_cache is not None else ():
                tol = STATE_TOL if name in ("state", "corrections") else OUT_TOL
                rows.append(compare(name, to_numpy(getattr(new_cache, name)),
                                    to_numpy(getattr(ref_cache, name)), tol))
            worst = max(rows, key=lambda r: r["rel_l2"])
            ok = all(r["ok"] for r in rows)
            if not ok:
                self.flagged.add(impl)
            entry = {"impl": impl, "T": T, "B": B, "heads": H, "ok": ok, "worst": worst,
                     "fields": rows}
            self.results["correctness"].append(entry)
            self.log(f"  T={T} {impl:<22} {'ok ' if ok else 'BAD'} worst {worst['field']}: "
                     f"rel L2 {worst['rel_l2']:.2e}, max abs {worst['max_abs']:.2e}")

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
        if self.jit_backend:
            impl = "ours-jit" if self.kernel_jit else "ours-jit[jax]"
            attempt(impl, lambda: check(impl, *fused_verify(
                params, cache, inputs, config, backend=self.jit_backend)))
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

    def torch_timings(self, fn, nsets, B):
        """events: one launch at a time; graph: replay of a captured launch sequence
        (for B <= graph_max_batch)."""
        torch = self.torch
        fn(0)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for i in range(5):
            fn(i % nsets)
        torch.cuda.synchronize()
        rough = (time.perf_counter() - start) / 5
        reps = int(min(200, max(10, 0.3 / max(rough, 1e-6))))
        events = measure.torch_event_times(torch, fn, nsets, reps)
        graph, note = None, ""
        if B <= self.args.graph_max_batch:
            calls = int(min(512, max(nsets, 2e-3 / max(events, 1e-7))))
            try:
                graph = measure.torch_graph_time(torch, fn, nsets, calls, replays=10)
            except Exception as error:  # noqa: BLE001
                note = f"graph capture failed: {type(error).__name__}: {str(error)[:120]}"
        return events, graph, note

    def ours_eager(self, T, B, split):
        H = self.args.heads
        config = KdaConfig(heads=H, tokens=T, split=split)
        probe = measure.verify_bytes(H, T, B, B * T, B)["total"]
        nsets = measure.rotation_sets(probe)
        params, cache, sets = make_problem(config, B, nsets, seed=B * 10 + T)
        n_total, writes = accepted_tokens(cache, sets[0])
        nbytes = measure.verify_bytes(H, T, B, n_total, writes)["total"]
        kernel = peers.KernelEager.rotating(self.torch, params, cache, sets, config)
        events, graph, note = self.torch_timings(kernel, nsets, B)
        serial = None
        if graph and not split and T == 4 and B in self.args.layer_batches:
            # as the 20-layer step's launches run under XLA: its overhead's other reference
            calls = int(min(512, max(nsets, 2e-3 / max(events, 1e-7))))
            try:
                serial = measure.torch_child_graph_time(self.torch, kernel, nsets, calls,
                                                        replays=10)
            except Exception as error:  # noqa: BLE001
                note += f"; child graphs failed: {type(error).__name__}: {str(error)[:120]}"
        del kernel
        label = split if split else auto_split_label(config, B)
        rows = [self.point("ours-eager", T, B, label, events, nbytes, method="events",
                           sets=nsets, note=note)]
        if graph:
            rows.append(self.point("ours-eager", T, B, label, graph, nbytes, method="graph",
                                   sets=nsets))
        if serial:
            rows.append(self.point("ours-eager", T, B, label, serial, nbytes,
                                   method="child graphs", sets=nsets))
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
        """`fn` (fused_verify or a reference) in a jitted lax.fori_loop carrying the cache
        (donated) and the output, compiled ahead of time for the shapes of its operands:
        (compiled, compile seconds, operand sets, seed). rotate: the loop cycles the state
        slots and record rows of the rotation sets (one small dynamic-slice per call); else
        one set of B + 1 slots. The token inputs stay the same."""
        H = self.args.heads
        config = KdaConfig(heads=H, tokens=T)
        probe = measure.verify_bytes(H, T, B, B * T, B)["total"]
        nsets = measure.rotation_sets(probe) if rotate else 1
        seed = B * 10 + T + 2

        def loop(params, cache, fixed, slots, rows_, n):
            def body(i, carry):
                cache, _ = carry
                s = i % slots.shape[0]
                inputs = VerifyInputs(fixed.x, fixed.f_a, fixed.beta, fixed.gate, slots[s],
                                      rows_[s])
                out, cache = fn(params, cache, inputs, config)
                return cache, out

            out0 = jnp.zeros((B, T, H, 128), jnp.bfloat16)
            return jax.lax.fori_loop(0, n, body, (cache, out0))

        shapes = jax.eval_shape(functools.partial(loop_operands, config, B, nsets, seed))
        start = time.perf_counter()
        compiled = jax.jit(loop, donate_argnums=(1,)).lower(
            *shapes, jax.ShapeDtypeStruct((), jnp.int32)).compile()
        return compiled, time.perf_counter() - start, nsets, seed

    def precompile_references(self):
        """XLA's compiles of the references' loops (with its autotuning, 10-15 s each at
        B >= 16 on the H200), two at a time on threads, while the correctness checks run
        (one at a time took 30 s past them, 04:33 run): {(impl, T, B): future of
        loop_program}. Our kernel's jitted loop is compiled where it is timed: its
        lowering compiles the CuTe DSL kernel, kept to the main thread."""
        args = self.args
        jobs = [("chunked-xla", chunked_verify, T, B) for T in args.tokens for B in args.batches]
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
        params, cache, fixed, slots, rows_ = jax.block_until_ready(
            loop_operands(config, B, nsets, seed))
        n_total, writes = accepted_tokens(cache, fixed)
        nbytes = measure.verify_bytes(self.args.heads, T, B, n_total, writes)["total"]
        state = {"cache": cache}

        def run(n):
            state["cache"], out = compiled(params, state["cache"], fixed, slots, rows_,
                                           jnp.int32(n))
            jax.block_until_ready(out)

        run(1)  # warm-up
        rough = measure.wall_times(lambda: run(3), 1) / 3
        n = int(min(5000, max(10, 0.05 / max(rough, 1e-7))))
        seconds = measure.wall_times(lambda: run(n), 3) / n
        return [self.point(impl, T, B, "auto" if impl.startswith("ours") else None, seconds,
                           nbytes, method="jit fori_loop", sets=nsets, loop_calls=n,
                           compile_s=round(compile_s, 1))]

    def sweep(self, T, batches, impls=("eager", "fla", "jit", "chunked")):
        """The implementations `impls` at T over `batches` (our kernel at split auto)."""
        jit_impl = "ours-jit" if self.kernel_jit else "ours-jit[jax]"
        jobs = {
            "eager": (self.eager_why is None, "ours-eager",
                      lambda B: self.ours_eager(T, B, None)),
            "fla": (self.fla_why is None, "fla", lambda B: self.fla_points(T, B)),
            "jit": (self.jit_backend is not None, jit_impl, lambda B: self.jax_loop(
                jit_impl, functools.partial(fused_verify, backend=self.jit_backend), T, B)),
            # XLA's scatter into the cache costs O(slots) per call: the references get
            # the smallest cache (B + 1 slots, no rotation), their best case.
            "chunked": (True, "chunked-xla", lambda B: self.jax_loop(
                "chunked-xla", chunked_verify, T, B, rotate=False)),
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

    # -- 4. the 20-layer step -------------------------------------------------------------

    def layers20(self):
        backend = self.jit_backend
        if backend is None:
            self.results["skipped"].append("20-layer step: no kernel under jit")
            return
        for setting, flag in CMDBUF_FLAGS.items():
            if not self.affordable("layers20", f"20-layer step, command buffers {setting}", 60):
                continue
            start = time.perf_counter()
            with tempfile.TemporaryDirectory() as tmp:
                target = pathlib.Path(tmp) / "child.json"
                env = dict(os.environ)
                env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + flag).strip()
                command = [sys.executable, str(pathlib.Path(__file__).resolve()),
                           "--layers20-child", str(target), "--out", tmp,
                           "--heads", str(self.args.heads), "--backend", backend,
                           "--layers", str(self.args.layers),
                           "--layer-batches", ",".join(map(str, self.args.layer_batches))]
                timeout = max(10, self.budget.left() - self.budget.reserve_s)
                try:
                    done = subprocess.run(command, env=env, capture_output=True, text=True,
                                          timeout=timeout)
                    if done.returncode != 0 or not target.exists():
                        raise RuntimeError(f"exit {done.returncode}: {done.stderr[-600:]}")
                    rows = json.loads(target.read_text())
                except Exception as error:  # noqa: BLE001
                    rows = [{"error": f"{type(error).__name__}: {str(error)[-600:]}"}]
            for row in rows:
                row["cmdbuf"] = setting
                row["xla_flags"] = flag or "(XLA default)"
                # the raw kernel on the step's own layers in its process, else the sweep's
                if "chain_us" in row:
                    raw = row["chain_us"], "ours-eager graph, the step's layers"
                    serial = row["chain_serial_us"]
                else:
                    raw = self.raw_kernel_us(row.get("B"), row.get("T"))
                    serial = self.raw_kernel_us(row.get("B"), row.get("T"), "child graphs")
                    serial = serial and serial[0]
                if raw and "step_us" in row:
                    row["raw_us"], row["raw_from"] = raw
                    if row["raw_from"].startswith("ours-eager"):  # the raw kernel, no XLA
                        row["overhead_us"] = (row["step_us"] - row["layers"] * raw[0]
                                              ) / row["layers"]
                if serial and "step_us" in row:
                    row["serial_us"] = serial
                    row["overhead_serial_us"] = (row["step_us"] - row["layers"] * serial
                                                 ) / row["layers"]
                self.results["layers20"].append(row)
                self.log(f"  {self.args.layers} layers, cmdbuf {setting}: " + ", ".join(
                    f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}"
                    for k, v in row.items() if k not in ("xla_flags",)))
            self.costs["layers20"] = time.perf_counter() - start
            self.save()

    def raw_kernel_us(self, B, T, method=None):
        """(per-call us, source) of the raw kernel at (B, T, split auto): the eager
        graph replay, else eager events, else the jitted loop; or the eager kernel's
        `method` alone."""
        order = ((("ours-eager", method),) if method else (
            ("ours-eager", "graph"), ("ours-eager", "events"),
            ("ours-jit", "jit fori_loop"), ("ours-jit[jax]", "jit fori_loop")))
        for impl, method in order:
            for row in self.results["points"]:
                if (row.get("impl"), row.get("method"), row.get("B"), row.get("T")) == (
                        impl, method, B, T) and str(row.get("split")).startswith("auto"):
                    return row["us"], f"{impl} {method}"
        return None

    # -- targets --------------------------------------------------------------------------

    def targets(self):
        T, H = 4, self.args.heads
        find = lambda impl, B: report.best_time(self.results, impl, T, B)
        rows = []

        def target(name, goal, measured, met, margin):
            rows.append({"name": name, "target": goal, "measured": measured, "met": met,
                         "margin": margin})

        for B in (b for b in self.args.batches if b * H >= 2048):
            ours = find("ours-eager", B)
            if ours:
                frac = ours.get("frac")
                target(f"bandwidth B={B} T=4", ">= 85% of copy", f"{100 * frac:.1f}%",
                       frac >= 0.85, f"{100 * (frac - 0.85):+.1f} points")
            fla = find("fla-recurrence", B)
            if ours and fla:
                speedup = fla["us"] / ours["us"]
                target(f"vs fla B={B} T=4", ">= 3x faster than fla recurrence",
                       f"{speedup:.2f}x ({ours['us']:.1f} vs {fla['us']:.1f} us)",
                       speedup >= 3, f"{speedup / 3:.2f} of target")
        ours = find("ours-eager", 1)
        if ours:
            target("latency B=1 T=4", "<= 5.5 us", f"{ours['us']:.3f} us", ours["us"] <= 5.5,
                   f"{ours['us'] - 5.5:+.3f} us")
        for row in self.results["layers20"]:
            if row.get("cmdbuf") == "on" and "overhead_us" in row:
                how = {"host": "host loop", "device": "device loop", "trace": "device trace"}
                target(f"JAX overhead B={row['B']} (20 layers, cmdbuf on, {how[row['mode']]})",
                       "<= 1.5 us per call",
                       f"{row['overhead_us']:.3f} us", row["overhead_us"] <= 1.5,
                       f"{row['overhead_us'] - 1.5:+.3f} us")
        for B, issue_us in FLA_ISSUE_US.items():  # the peer as the issue measured it
            fla = find("fla-recurrence", B)
            if fla:
                target(f"fla recurrence B={B} T=4 (peer check)", f"issue measured {issue_us} us",
                       f"{fla['us']:.1f} us", None, f"{fla['us'] / issue_us:.2f}x the issue's")
        copy = self.results.get("copy")
        if copy:
            target("copy bandwidth (peer check)", "issue measured 4.14 TB/s",
                   f"{copy['tbps']:.3f} TB/s", None, f"{copy['tbps'] / 4.14:.2f}x the issue's")
        self.results["targets"] = rows
        self.save()

    # -- the run --------------------------------------------------------------------------

    def run(self):
        args, log = self.args, self.log
        meta = self.results["meta"]
        log(f"{meta['date']}  {meta['gpu']}  jax {jax.__version__}  budget {args.budget_s} s")
        log(f"kernel eager: {meta['kernel_eager']}; kernel jit: {meta['kernel_jit']}; "
            f"fla: {meta['fla']}")
        self.results["memory"] = [measure.memory_per_request(measure.KIMI_HEADS, T)
                                  for T in range(2, 9)]
        self.precompile_references()
        log("1. correctness (against reference.chunked_verify)")
        for T in args.tokens:
            self.correctness(T)
        self.await_precompiles()
        log("2. ceiling")
        self.copy_bandwidth()
        first = 4 if 4 in args.tokens else args.tokens[0]
        rest = [T for T in args.tokens if T != first]
        log(f"3. T={first}, split auto, every implementation")
        self.sweep(first, args.batches)
        log("4. 20-layer jitted step")
        self.layers20()
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
            self.sweep(T, args.batches, ("jit", "chunked"))
        self.targets()
        self.finish()

    def finish(self):
        out = pathlib.Path(self.args.out)
        self.save()
        try:
            report.plot(self.results, out / "bench.png")
        except Exception as error:  # noqa: BLE001 - no matplotlib on a dry-run machine
            self.log(f"plot: {type(error).__name__}: {error}")
        (out / "RESULTS.md").write_text(report.render(self.results))
        self.log("")
        self.log(report.summary(self.results))


def layer_chain_us(config, params, caches, inputs, kernel_us):
    """The step's own layers (lists of params, caches and inputs) through the eager
    kernel, in this process right after the step was timed, on the same buffers, so
    that its raw time shares the step's operands, memory and GPU state: us per layer in
    one CUDA graph of launches (PDL overlaps them: `chain_us`) and with each launch a
    child graph of its own (as XLA holds a custom call: `chain_serial_us`). {} where
    torch or the eager kernel cannot run here."""
    torch = peers.torch_or_none()
    if peers.kernel_eager_unavailable(torch) is not None:
        return {}
    chain = peers.KernelEager.layers(torch, params, caches, inputs, config)
    L = len(params)
    calls = L * int(min(50, max(1, 2e3 / (L * kernel_us))))  # whole steps, about 2 ms
    try:
        return {"chain_us": 1e6 * measure.torch_graph_time(torch, chain, L, calls, 10),
                "chain_serial_us": 1e6 * measure.torch_child_graph_time(torch, chain, L,
                                                                        calls, 10)}
    finally:
        del chain
        torch.cuda.empty_cache()


def layers20_child(args):
    """The 20-layer step in this process (XLA_FLAGS set by the parent): per batch, the
    jitted step called from Python (mode host) and a jitted fori_loop of steps (mode
    device), the same steps traced on the device (mode trace), each row with the raw
    times of the step's layers (`layer_chain_us`); writes a JSON list to
    args.layers20_child."""
    T, H, L = 4, args.heads, args.layers
    config = KdaConfig(heads=H, tokens=T)
    verify = functools.partial(fused_verify, config=config, backend=args.backend)
    rows = []
    for B in args.layer_batches:
        keys = jax.random.split(jax.random.key(B), 3 * L)
        params = [random_params(keys[3 * i], config) for i in range(L)]
        caches = [random_cache(keys[3 * i + 1], config, B + 1, B) for i in range(L)]
        slots = jnp.arange(1, B + 1, dtype=jnp.int32)
        inputs = [random_inputs(keys[3 * i + 2], config, slots, slots - 1) for i in range(L)]

        def step(params, caches, inputs):
            outs, new = [], []
            for p, c, x in zip(params, caches, inputs):
                out, c = verify(p, c, x)
                outs.append(out)
                new.append(c)
            return outs, new

        jstep = jax.jit(step, donate_argnums=(1,))
        start = time.perf_counter()
        compiled = jstep.lower(params, caches, inputs).compile()
        compile_s = time.perf_counter() - start
        hlo = compiled.as_text()
        cmdbufs = hlo.count("command_buffer")
        outs, caches = jstep(params, caches, inputs)
        jax.block_until_ready(outs)

        state = {"caches": caches}

        def host(n):
            for _ in range(n):
                outs, state["caches"] = jstep(params, state["caches"], inputs)
            jax.block_until_ready(outs)

        rough = measure.wall_times(lambda: host(3), 1) / 3
        n = int(min(2000, max(5, 0.2 / max(rough, 1e-7))))
        host_s = measure.wall_times(lambda: host(n), 3) / n
        common = {"B": B, "T": T, "heads": H, "layers": L, "backend": args.backend,
                  "compile_s": round(compile_s, 1), "command_buffers_in_hlo": cmdbufs}
        rows.append(dict(common, mode="host", step_us=host_s * 1e6, steps=n))

        @functools.partial(jax.jit, donate_argnums=(1,))
        def loop(params, caches, inputs, n):
            def body(i, carry):
                caches, _ = carry
                outs, caches = step(params, caches, inputs)
                return caches, outs

            outs0 = [jnp.zeros((B, T, H, 128), jnp.bfloat16) for _ in range(L)]
            return jax.lax.fori_loop(0, n, body, (caches, outs0))

        state["caches"], outs = loop(params, state["caches"], inputs, jnp.int32(1))
        jax.block_until_ready(outs)

        def device(n):
            state["caches"], outs = loop(params, state["caches"], inputs, jnp.int32(n))
            jax.block_until_ready(outs)

        rough = measure.wall_times(lambda: device(3), 1) / 3
        n = int(min(5000, max(5, 0.2 / max(rough, 1e-7))))
        device_s = measure.wall_times(lambda: device(n), 3) / n
        rows.append(dict(common, mode="device", step_us=device_s * 1e6, steps=n))

        # the same host-called steps seen from the device: no dispatch, no loop in it
        traced = measure.traced_steps(lambda: host(16), L)
        print(f"B={B} trace: {traced}", flush=True)
        if traced.get("step_us") is not None:
            rows.append(dict(common, mode="trace", step_us=traced["step_us"],
                             steps=traced["steps"], kernel_us=traced["kernel_us"],
                             gap_us=traced["gap_us"]))
        raw = layer_chain_us(config, params, state["caches"], inputs,
                             traced.get("kernel_us") or 1.0)
        print(f"B={B} the step's layers through the eager kernel: {raw}", flush=True)
        for row in rows:
            if row["B"] == B:
                row.update(raw)
    pathlib.Path(args.layers20_child).write_text(json.dumps(rows))
    return 0


def parse(argv):
    ints = lambda text: [int(v) for v in text.split(",") if v]
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder for results.json, log, plot")
    parser.add_argument("--quick", action="store_true",
                        help="CPU dry run: H=2, T 2,4, B 1,2, 3 layers, the jax backend for "
                             "the kernel rows")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="wall-clock budget of the run (default 400; --quick 480)")
    parser.add_argument("--heads", type=int, default=None, help="H (default 32; --quick 2)")
    parser.add_argument("--tokens", type=ints, default=None, help="T values (default 2,4,8)")
    parser.add_argument("--batches", type=ints, default=None,
                        help="B values (default 1,4,16,64,256; --quick 1,4)")
    parser.add_argument("--splits", type=ints, default=[1, 2, 4, 8],
                        help="fixed splits timed besides auto (default 1,2,4,8)")
    parser.add_argument("--stock-tokens", type=ints, default=[4],
                        help="T values where stock_verify is checked and timed (default 4)")
    parser.add_argument("--stock-batches", type=ints, default=None,
                        help="B values where stock_verify is timed (default 1,64)")
    parser.add_argument("--check-batch", type=int, default=4, help="B of the correctness points")
    parser.add_argument("--graph-max-batch", type=int, default=256,
                        help="largest B also timed through CUDA-graph replay (default 256)")
    parser.add_argument("--layers", type=int, default=None, help="layers of the step (20)")
    parser.add_argument("--layer-batches", type=ints, default=[1, 64],
                        help="B of the 20-layer step (default 1,64)")
    parser.add_argument("--layers20-child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--backend", default="cutedsl", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    quick = args.quick
    args.budget_s = args.budget_s or (480.0 if quick else 400.0)
    args.heads = args.heads or (2 if quick else 32)
    args.tokens = args.tokens or ([2, 4] if quick else [2, 4, 8])
    args.batches = args.batches or ([1, 2] if quick else [1, 4, 16, 64, 256])
    args.stock_batches = args.stock_batches or ([1] if quick else [1, 64])
    args.layers = args.layers or (3 if quick else LAYERS)
    if quick and args.layer_batches == [1, 64]:
        args.layer_batches = [1, 2]
    return args


def main(argv=None):
    args = parse(sys.argv[1:] if argv is None else argv)
    if args.layers20_child:
        return layers20_child(args)
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
        bench.targets()
        bench.finish()
    finally:
        os._exit(3)


if __name__ == "__main__":
    sys.exit(main())
