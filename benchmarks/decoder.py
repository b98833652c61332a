"""What a JAX decoder gets from the verify: one speculative step of L KDA layers
(Kimi-Linear's 20 by default, H = 32, T = 4), jitted with the cache donated, in two
forms:

- scan: stacked params and cache (a leading [L] on every leaf), `jax.lax.scan` over the
  layer index with the cache in the carry, `fused_verify(..., layer=i)` per layer, then
  one `accept` of the stacked cache;
- list: L per-layer params and caches, a Python loop of `fused_verify` per layer, then
  `accept` per layer.

Every layer verifies the same step's inputs and nothing runs between the layers (a
decoder's projections would); the step returns the cache, so blocking on it waits for
the whole step. The cache holds B + SPARE slots and record rows, so that a larger batch
fits it. Per batch size B and form, a row of:

- lower_s, compile_s: the first `jax.jit(step).lower(...)` and its `.compile()`; the
  first lowering of a kernel configuration also compiles its CuTe DSL kernel;
- new_batch, new_batch_s: lower + compile at the next batch size that launches the same
  kernel (same split and launch shape), on the same cache: what a decoder pays when
  its batch size changes once the configuration is compiled;
- loop_us: wall time per step of N steps called from Python without blocking, then one
  block (the dispatch-bound throughput); blocked_us: with a block after every step (a
  decoder that needs its tokens back); tokens_per_s = B x T / blocked_us;
- gpu (on a GPU): the device's time per step from JAX's profiler trace of
  TRACED_STEPS host-called steps (`jax_kda.profiling.traced_steps`: step_us the span
  of a step's activities, busy_us the time some activity ran, kernels per step, the
  commonest names);
- chain_us, chain_serial_us: per layer, the step's layers through the eager kernel on
  its own buffers, in one CUDA graph (PDL overlaps the launches) and with each launch a
  child graph of its own (as XLA's command buffers hold a custom call); on a GPU with
  torch only.

The scan's unroll (1: a while loop over the layers; True: the layers in a straight
line) is tried both ways at the first batch, unless --unroll names it; the one with the
lower GPU time per step is used from then on (within 2% of each other, the one with the
cheaper new-batch compile): its rows have used = True. At the first batch the used
scan also runs on a cache of SLOTS_CHECK slots, or as many as a quarter of the device's
memory holds (`check_slots`; the same live rows): its step time must not depend on S.

Tensor parallel (--tp, default 1,2,4): the used scan with every layer's heads split
over tp devices (`jax_kda.head_specs`), tp > 1 where the devices are there and tp
divides H (a row with `skipped` otherwise), in two forms: tp_form "shard_map" (each
device runs the step on its H / tp heads with `jax_kda.local_config`) and "jit" (the
step as written, on head-sharded arrays: the library's sharding rule splits it). Each
first checks its cache after one step against the single-device step's (TP_TOLERANCE),
then is timed as above (tp_error: that check's worst leaf, in units of its tolerance);
speedup is the tp = 1 scan's blocked_us over its own.

--state-dtype bfloat16 times the same step on a bf16 state (`KdaConfig.state_dtype`);
--tree the same step on token trees (`KdaConfig.trees`): a random tree of T nodes per
request, and the accept of a random node's path from the root.

XLA flags come from the environment; bench.py runs it once per command-buffer setting:

    XLA_FLAGS=--xla_gpu_enable_command_buffer= python benchmarks/decoder.py --json out.json
"""
from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU

import argparse
import collections
import dataclasses
import functools
import json
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding

import measure  # benchmarks/, on sys.path as the script's folder
import peers
from jax_kda import KdaConfig, accept, fused_verify, head_specs, local_config
from jax_kda.profiling import traced_steps, wall_times
from jax_kda.testing import (random_accepted, random_cache, random_inputs, random_params,
                             random_parents)
from jax_kda import cutedsl_supported

SPARE = 16  # slots and record rows past the batch's (B = 1 runs on S = 17)
SLOTS_CHECK = 1025
UNROLLS = (1, True)
TRACED_STEPS = 16
STEP_SECONDS = 0.2  # wall time each timed loop aims at
TP_AXIS = "tp"
TP_FORMS = ("shard_map", "jit")
# a tp step's cache against the single-device step's, over the buffer's max |value|: the
# FP32 state and corrections to their rounding; a bf16 raw gate recorded one ulp apart
TP_TOLERANCE = {"float32": 1e-5, "bfloat16": 2**-7, "int32": 0.0}


def scan_step(config: KdaConfig, layers: int, backend: str, unroll):
    """The scan form: (params, cache, inputs, accepted: (counts [B], paths or None)) ->
    cache, params and cache stacked over `layers`."""
    def step(params, cache, inputs, accepted):
        def layer(cache, i):
            _, cache = fused_verify(params, cache, inputs, config, backend=backend, layer=i)
            return cache, None

        cache, _ = jax.lax.scan(layer, cache, jnp.arange(layers, dtype=jnp.int32),
                                unroll=unroll)
        counts, path = accepted
        return accept(cache, inputs.record_rows, counts, config, path=path)
    return step


def list_step(config: KdaConfig, backend: str):
    """The list form: (params [L], caches [L], inputs, accepted) -> caches [L]."""
    def step(params, caches, inputs, accepted):
        caches = [fused_verify(p, c, inputs, config, backend=backend)[1]
                  for p, c in zip(params, caches)]
        counts, path = accepted
        return [accept(c, inputs.record_rows, counts, config, path=path) for c in caches]
    return step


def operands(config: KdaConfig, layers: int, B: int, seed: int):
    """Stacked params and cache of B + SPARE slots and record rows, one step's inputs
    (requests at slots 1..B, record rows 0..B-1) and what `accept` takes after the
    record rows: (accepted counts [B] in 1..T, None), or with trees (counts, paths
    [B, T]), each request's path from the root to a random node."""
    kp, kc, ki = jax.random.split(jax.random.key(seed), 3)
    rng = np.random.default_rng(seed)
    slots = jnp.arange(1, B + 1, dtype=jnp.int32)
    inputs = random_inputs(ki, config, slots, slots - 1)
    if config.trees:
        inputs = dataclasses.replace(inputs, parents=random_parents(rng, B, config.tokens))
        accepted = random_path(rng, np.asarray(inputs.parents))
    else:
        accepted = (random_accepted(rng, slots, config.tokens), None)
    return jax.block_until_ready((
        random_params(kp, config, layers=layers),
        random_cache(kc, config, B + SPARE, B + SPARE, layers=layers), inputs, accepted))


def random_path(rng: np.random.Generator, parents: np.ndarray):
    """(counts [B], paths [B, T]): per request the path root -> a random node of its
    tree (`parents` [B, T]), padded with zeros past its count."""
    B, T = parents.shape
    paths = np.zeros((B, T), np.int32)
    counts = np.zeros(B, np.int32)
    for b in range(B):
        node, path = int(rng.integers(0, T)), []
        while node >= 0:
            path.append(node)
            node = int(parents[b, node])
        counts[b] = len(path)
        paths[b, :len(path)] = path[::-1]
    return jnp.asarray(counts), jnp.asarray(paths)


def check_slots(cache) -> int:
    """SLOTS_CHECK, or fewer where a cache of that many slots would take more than a
    quarter of the device's memory (the step's buffers and XLA's beside it)."""
    per_slot = sum(a.nbytes // a.shape[1] for a in (cache.state, cache.conv))
    limit = (jax.devices()[0].memory_stats() or {}).get("bytes_limit")
    if limit is None:
        return SLOTS_CHECK
    return max(cache.state.shape[1], min(SLOTS_CHECK, limit // 4 // per_slot))


@functools.partial(jax.jit, static_argnums=1)
def with_slots(cache, slots: int):
    """A stacked `cache` grown to `slots` slots (zeros past its own): the same live rows
    in a bigger cache."""
    grow = lambda a: jnp.pad(a, [(0, 0), (0, slots - a.shape[1])] + [(0, 0)] * (a.ndim - 2))
    return dataclasses.replace(cache, state=grow(cache.state), conv=grow(cache.conv))


def tp_step(form: str, config: KdaConfig, layers: int, backend: str, unroll, mesh, specs):
    """The scan form with the heads split over `mesh` (specs: of its operands), as
    tp_form `form` runs it (see the module's docstring)."""
    if form == "jit":
        return scan_step(config, layers, backend, unroll)
    local = local_config(config, mesh.shape[TP_AXIS])
    return jax.shard_map(scan_step(local, layers, backend, unroll), mesh=mesh,
                         in_specs=specs, out_specs=specs[1])


def tp_error(actual, expected) -> float:
    """The worst leaf's max |actual - expected| over its max |expected| and its dtype's
    TP_TOLERANCE: <= 1 passes."""
    worst = 0.0
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
        tolerance = TP_TOLERANCE[jnp.dtype(e.dtype).name]
        a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
        gap = np.max(np.abs(a - e), initial=0.0) / max(np.max(np.abs(e), initial=0.0), 1e-30)
        worst = max(worst, gap / tolerance if tolerance else float(np.inf if gap else 0.0))
    return worst


def tp_rows(args, config: KdaConfig, unroll, operands, base_us: float, common: dict) -> list:
    """The used scan at each tp > 1 of args.tp, in each tp_form: checked against the
    single-device step, then timed (speedup: base_us, the tp = 1 scan's blocked_us,
    over its own); rows with `skipped` where the devices or the heads do not allow it."""
    rows = []
    expected = jax.jit(scan_step(config, args.layers, args.backend, unroll))(*operands)
    for tp in (tp for tp in args.tp if tp > 1):
        if tp > jax.device_count() or config.heads % tp:
            rows.append(dict(common, form="scan", tp=tp, skipped=(
                f"needs {tp} devices ({jax.device_count()} here) and a divisor of "
                f"H = {config.heads}")))
            continue
        mesh = jax.make_mesh((tp,), (TP_AXIS,), axis_types=(AxisType.Auto,))
        specs = head_specs(operands, TP_AXIS)
        for form in TP_FORMS:
            split = jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)),
                                 operands, specs)
            step = tp_step(form, config, args.layers, args.backend, unroll, mesh, specs)
            error = tp_error(jax.jit(step)(*split), expected)
            if error > 1:
                raise AssertionError(f"tp={tp} {form}: the cache after one step differs from "
                                     f"the single-device step's ({error:.2f} x tolerance)")
            row, _ = measure_form(step, *split)
            rows.append(dict(common, form="scan", unroll=unroll, tp=tp, tp_form=form,
                             tp_error=error, speedup=base_us / row["blocked_us"], **row))
    return rows


def unstack(tree, layers: int) -> list:
    """A stacked pytree as a list of `layers` per-layer ones (copies)."""
    return [jax.tree.map(lambda a: a[i], tree) for i in range(layers)]


def next_batch(config: KdaConfig, B: int, backend: str):
    """The smallest B' > B that launches the same kernel as B (same split and launch
    shape, so no new CuTe DSL compile) and fits the cache, B + 1 for the XLA backend;
    None if there is none."""
    if backend != "cutedsl":
        return B + 1
    from jax_kda.ffi import kernel_split, solo_ctas

    def launch(batch):
        split = kernel_split(config, batch)
        return split, solo_ctas(config, batch, split)
    return next((b for b in range(B + 1, B + SPARE) if launch(b) == launch(B)), None)


def at_batch(tree, B: int):
    """Shapes of `tree` (inputs or accepted) with its leading batch axis set to B."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct((B,) + a.shape[1:], a.dtype), tree)


def gpu_steps(run, steps: int) -> dict:
    """`traced_steps` of the `steps` steps `run()` enqueues; where some activity is not
    in every step (its count not a multiple of `steps`), of the activities that are."""
    try:
        return traced_steps(run, steps)
    except ValueError:
        def per_step(kernels):
            counts = collections.Counter(k.name for k in kernels)
            kept = [k for k in kernels if counts[k.name] % steps == 0]
            size = len(kept) // steps
            return [kept[i * size:(i + 1) * size] for i in range(steps)]
        return traced_steps(run, split=per_step)


def measure_form(step, params, cache, inputs, accepted, new_batch=None):
    """Compiles and times `step` (see the module's docstring) with the cache donated:
    (row, the cache after the timed steps)."""
    jitted = jax.jit(step, donate_argnums=1)
    start = time.perf_counter()
    lowered = jitted.lower(params, cache, inputs, accepted)
    lowered_at = time.perf_counter()
    compiled = lowered.compile()
    row = {"lower_s": lowered_at - start, "compile_s": time.perf_counter() - lowered_at}
    if new_batch is not None:
        start = time.perf_counter()
        jitted.lower(params, cache, at_batch(inputs, new_batch),
                     at_batch(accepted, new_batch)).compile()
        row.update(new_batch=new_batch, new_batch_s=time.perf_counter() - start)
    live = [cache]

    def steps(n, block_each):
        for _ in range(n):
            live[0] = compiled(params, live[0], inputs, accepted)
            if block_each:
                jax.block_until_ready(live[0])
        jax.block_until_ready(live[0])

    rough = wall_times(lambda: steps(3, True), 1) / 3
    n = int(min(2000, max(5, STEP_SECONDS / max(rough, 1e-7))))
    row.update(steps=n, loop_us=1e6 * wall_times(lambda: steps(n, False), 3) / n,
               blocked_us=1e6 * wall_times(lambda: steps(n, True), 3) / n)
    if jax.default_backend() == "gpu":  # elsewhere the trace holds no device activity
        row["gpu"] = gpu_steps(lambda: steps(TRACED_STEPS, False), TRACED_STEPS)
    B, T = inputs.x.shape[:2]
    row["tokens_per_s"] = B * T / (row["blocked_us"] * 1e-6)
    return row, live[0]


def layer_chain(config: KdaConfig, layers: int, params, cache, inputs) -> dict:
    """The step's layers through the eager kernel on the step's own buffers (stacked
    params and cache, or lists of per-layer ones), one step per graph replay, the
    pending counts restored between replays: us per layer in one CUDA graph of
    launches (chain_us) and each launch a child graph of its own (chain_serial_us).
    {} where torch or the eager kernel cannot run here."""
    torch = peers.torch_or_none()
    if peers.kernel_eager_unavailable(torch) is not None:
        return {}
    if isinstance(cache, list):
        chain = peers.KernelEager.per_layer(torch, params, cache, [inputs] * layers, config)
    else:
        chain = peers.KernelEager.stacked(torch, params, cache, inputs, config, layers)
    try:
        return {"chain_us": 1e6 * measure.torch_graph_time(torch, chain, layers, layers, 10,
                                                           reset=chain.rearm),
                "chain_serial_us": 1e6 * measure.torch_child_graph_time(
                    torch, chain, layers, layers, 10, reset=chain.rearm)}
    finally:
        chain.rearm()
        del chain
        torch.cuda.empty_cache()


def choose(rows: list) -> dict:
    """The scan row whose unroll is used: the lowest GPU time per step (wall times swing
    with the host's load), and within 2% of it the cheapest new-batch compile; the
    lowest blocked wall time where no trace was read."""
    cost = lambda r: r.get("gpu", {}).get("step_us") or r["blocked_us"]
    best = min(cost(r) for r in rows)
    near = [r for r in rows if cost(r) <= 1.02 * best]
    return min(near, key=lambda r: r.get("new_batch_s") or 0.0)


def save(rows: list, path: str):
    """rows as JSON at `path`, replaced whole (a reader never sees half a file)."""
    part = pathlib.Path(path + ".part")
    part.write_text(json.dumps(rows))
    part.replace(path)


def run(args) -> list:
    """Every row of the section (see the module's docstring), written to args.json
    after each batch size."""
    config = KdaConfig(heads=args.heads, tokens=args.tokens, state_dtype=args.state_dtype,
                       trees=args.tree)
    L = args.layers
    budget = measure.Budget(args.budget_s, reserve_s=5.0)
    rows, unroll, cost = [], args.unroll, 0.0
    for B in args.batches:
        common = dict(B=B, T=args.tokens, heads=args.heads, layers=L, backend=args.backend,
                      state=args.state_dtype, tree=args.tree, S=B + SPARE)
        if not budget.allows(cost):
            rows.append(dict(common, skipped=f"budget ({budget.left():.0f} s left)"))
            continue
        start = time.perf_counter()
        params, cache, inputs, accepted = operands(config, L, B, seed=B)
        new = next_batch(config, B, args.backend)
        tried = []
        for u in UNROLLS if unroll is None else (unroll,):
            row, cache = measure_form(scan_step(config, L, args.backend, u), params, cache,
                                      inputs, accepted, new)
            tried.append(dict(common, form="scan", unroll=u, **row))
        used = choose(tried)
        unroll = used["unroll"]
        for row in tried:
            row["used"] = row is used
        rows += tried
        if B == args.batches[0]:  # the same step on a cache of many more slots
            S = check_slots(cache)
            row, _ = measure_form(scan_step(config, L, args.backend, unroll), params,
                                  with_slots(cache, S), inputs, accepted)
            rows.append(dict(common, form="scan", unroll=unroll, used=True, S=S,
                             check="slots", **row))
        used.update(layer_chain(config, L, params, cache, inputs))
        rows += tp_rows(args, config, unroll, (params, cache, inputs, accepted),
                        used["blocked_us"], common)
        params, cache = unstack(params, L), unstack(cache, L)
        row, cache = measure_form(list_step(config, args.backend), params, cache, inputs,
                                  accepted, new)
        row.update(layer_chain(config, L, params, cache, inputs))
        rows.append(dict(common, form="list", **row))
        save(rows, args.json)
        del params, cache
        cost = time.perf_counter() - start
        print(f"B={B} ({cost:.0f} s): " + "; ".join(
            f"{r['form']} unroll={r.get('unroll')} S={r['S']} tp={r.get('tp', 1)}"
            f"{' ' + r['tp_form'] if 'tp_form' in r else ''}: loop {r['loop_us']:.1f} us, "
            f"blocked {r['blocked_us']:.1f} us, gpu step {r.get('gpu', {}).get('step_us')} us"
            for r in rows if r["B"] == B and "loop_us" in r), flush=True)
    save(rows, args.json)
    return rows


def parse(argv):
    ints = lambda text: [int(v) for v in text.split(",") if v]
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", required=True, help="where the rows go (a JSON list)")
    parser.add_argument("--layers", type=int, default=measure.KIMI_LAYERS)
    parser.add_argument("--heads", type=int, default=measure.KIMI_HEADS)
    parser.add_argument("--tokens", type=int, default=4)
    parser.add_argument("--state-dtype", choices=("float32", "bfloat16"), default="float32",
                        help="the cache's state dtype (KdaConfig.state_dtype)")
    parser.add_argument("--tree", action="store_true",
                        help="a random token tree per request (KdaConfig.trees)")
    parser.add_argument("--batches", type=ints, default=[1, 16, 64],
                        help="batch sizes B (default 1,16,64)")
    parser.add_argument("--backend", default=None,
                        help="fused_verify's backend (default cutedsl where it runs, else jax)")
    parser.add_argument("--unroll", choices=("1", "True"), default=None,
                        help="the scan's unroll (default: try both at the first batch)")
    parser.add_argument("--tp", type=ints, default=[1, 2, 4],
                        help="devices the heads are split over (default 1,2,4: those "
                             "present)")
    parser.add_argument("--budget-s", type=float, default=600.0,
                        help="no new batch size is started past it")
    args = parser.parse_args(argv)
    args.backend = args.backend or ("cutedsl" if cutedsl_supported() else "jax")
    args.unroll = {None: None, "1": 1, "True": True}[args.unroll]
    return args


if __name__ == "__main__":
    run(parse(sys.argv[1:]))
