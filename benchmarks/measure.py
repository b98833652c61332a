"""What the benchmark measures with, and what it counts.

- `Budget`: the wall-clock allowance of a run.
- Byte models: the fewest bytes each implementation must move per call (each operand
  read once, each result written once), and the cache layout per request.
- Timers: CUDA events around single launches, CUDA-graph replay of many launches
  (torch; PDL overlaps them), the same with each launch a child graph of its own (as
  XLA's command buffers hold a custom call: no overlap), and wall clocks for anything
  under JAX. A verify leaves its record rows awaiting an accept (pending -1), so a
  repeated launch on the same operands would replay nothing: the torch timers take a
  `reset` that restores the pending counts outside the timed span, and each operand
  set is launched once between resets.
- The device-to-device copy bandwidth, the ceiling every fraction is taken against.

Sizes: B requests, T tokens, H heads, K = 128, RQ = T record tokens, W = T + 3 window
positions.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import time
import weakref

from jax_kda import profiling
from jax_kda.config import CONV_TAPS, K

F32, BF16, I32 = 4, 2, 4
ROTATE_BYTES = 512 << 20  # data touched per rotation cycle: 8x the H200's 60 MB L2
MAX_SETS = 64
MIN_LAUNCHES = 8  # fewest launches per graph replay: its own start-up, spread, stays small
KIMI_HEADS, KIMI_LAYERS = 32, 20  # a Kimi-Linear KDA layer, and the model's KDA layers


class Budget:
    """Seconds left of `total_s`; `allows(cost)` keeps `reserve_s` for writing results."""

    def __init__(self, total_s: float, reserve_s: float = 20.0):
        self.start, self.total_s, self.reserve_s = time.perf_counter(), total_s, reserve_s

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def left(self) -> float:
        return self.total_s - self.elapsed()

    def allows(self, cost_s: float) -> bool:
        return self.left() - self.reserve_s >= cost_s


def rotation_sets(bytes_per_call: int, least: int = 1) -> int:
    """How many disjoint operand sets to cycle through so a set is cold when it returns
    (and at least `least`)."""
    return max(least, min(MAX_SETS, -(-ROTATE_BYTES // max(bytes_per_call, 1))))


def param_bytes(H: int) -> int:
    """conv_weight + conv_bias (f32), a_log, dt_bias, f_b (bf16), norm_weight (f32)."""
    return (3 * CONV_TAPS * H * K + 3 * H * K + H + H * K) * F32 + H * K * K * BF16 + K * F32


def verify_bytes(H: int, T: int, B: int, n_total: int, state_writes: int,
                 state_bytes: int = F32) -> dict:
    """Bytes one fused verify must move: the state read once and written once per request
    with n > 0 (`state_writes` of them; `state_bytes` an entry: 2 for a bf16 state), the
    n accepted records read (`n_total` tokens over the batch, n per request), T records
    written, the conv history (3 positions) read and the window's T + 3 positions
    written, the token inputs, slots and record rows read, the per-head pending read and
    written, the output written and the weights read once."""
    state = H * K * K * state_bytes
    record = H * (K * F32 + 2 * K * BF16)  # one token's correction row and key + gate
    parts = {
        "state_read": B * state,
        "state_write": state_writes * state,
        "records_read": n_total * record,
        "records_write": B * T * record,
        "window": B * 3 * H * K * (3 + T + CONV_TAPS - 1) * BF16,
        "inputs": B * T * (3 * H * K + K + H + H * K) * BF16 + 2 * B * I32,
        "pending": 2 * B * H * I32,
        "output": B * T * H * K * BF16,
        "params": param_bytes(H),
    }
    parts["total"] = sum(parts.values())
    return parts


def fla_recurrence_bytes(H: int, T: int, B: int) -> dict:
    """Bytes fla's `fused_recurrent_kda` must move in the stock speculative layout: one
    state read, one state written per verify token, q, k, v and raw gate in, beta in,
    the bf16 output out, the per-token state indices and accepted counts."""
    state = H * K * K * F32
    parts = {
        "state_read": B * state,
        "state_write": B * T * state,
        "inputs": B * T * H * (4 * K + 1) * BF16 + B * (T + 1) * I32 + H * (K + 1) * F32,
        "output": B * T * H * K * BF16,
    }
    parts["total"] = sum(parts.values())
    return parts


def memory_per_request(H: int, T: int, RQ: int | None = None) -> dict:
    """Cache bytes per request: our layout (one checkpoint, the conv window of W = RQ + 3
    positions, one record row of RQ tokens, default T, pending per head) against the
    stock speculative layout (one FP32 state per verify token, a conv window of
    3 + T - 1 positions)."""
    RQ = T if RQ is None else RQ
    state = H * K * K * F32
    window = RQ + CONV_TAPS - 1
    ours = (state + 3 * H * K * window * BF16 + H * RQ * K * F32 + H * RQ * 2 * K * BF16
            + H * I32)
    stock = T * state + 3 * H * K * (3 + T - 1) * BF16
    return {"T": T, "RQ": RQ, "heads": H, "ours_bytes": ours, "stock_bytes": stock,
            "ours_over_stock": ours / stock}


LAZY_EVERY = (1, 2, 4, 8)  # checkpoint_every of the lazy section
LAZY_POINTS = [(B, 4, C) for B in (1, 64, 256) for C in LAZY_EVERY] + [
    (64, T, C) for T in (2, 8) for C in (1, 4)]  # its (B, T, C) points


def lazy_cycle(T: int, checkpoint_every: int) -> list:
    """The kept counts n a verify starts from in steady state when every token is
    accepted, RQ = checkpoint_every * T: T, 2T, .., RQ, the last one writing the state
    (with checkpoint_every 1: T, writing at every step)."""
    return [T * i for i in range(1, checkpoint_every + 1)]


def lazy_step_bytes(H: int, T: int, B: int, checkpoint_every: int) -> dict:
    """`verify_bytes` averaged over `lazy_cycle`: the state written once a cycle."""
    cycle = lazy_cycle(T, checkpoint_every)
    steps = [verify_bytes(H, T, B, B * n, B if n == cycle[-1] else 0) for n in cycle]
    return {part: sum(s[part] for s in steps) / len(steps) for part in steps[0]}


def median(values):
    return statistics.median(values) if values else None


def torch_event_times(torch, fn, sets: int, reps: int, warmup: int = 3, reset=None):
    """Seconds per call of `fn(i)` launched one by one, CUDA events around each launch;
    the median of `reps` calls cycling over `sets` operand sets. reset: run before each
    call, outside the events."""
    reset = reset or (lambda: None)
    for i in range(warmup):
        reset()
        fn(i % sets)
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(reps)]
    for i, (start, end) in enumerate(events):
        reset()
        start.record()
        fn(i % sets)
        end.record()
    torch.cuda.synchronize()
    return median([s.elapsed_time(e) * 1e-3 for s, e in events])


def torch_graph_time(torch, fn, sets: int, calls: int, replays: int, reset=None):
    """Seconds per call of `fn(i)` from replays of one CUDA graph of `calls` launches
    (cycling over `sets`), events around each replay; median over `replays`. reset:
    run before each replay, outside the events (then give calls <= sets)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up on a side stream, as torch's capture wants
        for i in range(min(sets, 3)):
            fn(i)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        for i in range(calls):
            fn(i % sets)
    seconds = replay_time(torch, graph.replay, replays, reset)
    del graph
    return seconds / calls


def replay_time(torch, replay, replays: int, reset=None):
    """Median seconds of `replay()` (a graph launch) on the current stream over `replays`
    calls, CUDA events around each, after two warm-up calls; reset: run before each
    call, outside the events."""
    reset = reset or (lambda: None)
    for _ in range(2):
        reset()
        replay()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(replays)]
    for start, end in events:
        reset()
        start.record()
        replay()
        end.record()
    torch.cuda.synchronize()
    return median([s.elapsed_time(e) * 1e-3 for s, e in events])


def child_graph_chain(stream, launches):
    """A CUDA graph whose nodes are child graphs of one launch each (stream capture of
    each callable in `launches` on `stream`, a CUstream), in a chain: the shape XLA's
    command buffers give a custom call, which PDL's programmatic edge does not cross, so
    each launch starts once the previous one has ended. Returns a callable that launches
    the graph on `stream`; the graph is destroyed with it."""
    import cuda.bindings.driver as cuda

    def check(result):
        if result[0] != cuda.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"CUDA driver: {result[0]}")
        return result[1] if len(result) > 1 else None

    parent = check(cuda.cuGraphCreate(0))
    node = None
    for launch in launches:
        check(cuda.cuStreamBeginCapture(
            stream, cuda.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL))
        launch()
        child = check(cuda.cuStreamEndCapture(stream))
        node = check(cuda.cuGraphAddChildGraphNode(
            parent, [node] if node is not None else None, int(node is not None), child))
        check(cuda.cuGraphDestroy(child))  # the node holds a clone
    executable = check(cuda.cuGraphInstantiate(parent, 0))
    check(cuda.cuGraphDestroy(parent))

    def replay():
        check(cuda.cuGraphLaunch(executable, stream))
    weakref.finalize(replay, cuda.cuGraphExecDestroy, executable)
    return replay


def torch_child_graph_time(torch, fn, sets: int, calls: int, replays: int, reset=None):
    """Seconds per call of `fn(i)` as `torch_graph_time`, each launch in a child graph of
    its own (`child_graph_chain`): the launches do not overlap, as under XLA."""
    import cuda.bindings.driver as cuda

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        launches = [lambda i=i: fn(i % sets) for i in range(calls)]
        replay = child_graph_chain(cuda.CUstream(side.cuda_stream), launches)
        return replay_time(torch, replay, replays, reset) / calls


def copy_bandwidth(torch=None, nbytes: int = 1 << 30, reps: int = 20) -> dict:
    """Device-to-device copy of `nbytes` (bytes read + bytes written over the median
    time): through torch where CUDA is there, else `jax_kda.profiling.copy_bandwidth`
    (dry runs)."""
    if torch is not None and torch.cuda.is_available():
        src = torch.randn(nbytes // 4, device="cuda")
        dst = torch.empty_like(src)
        seconds = torch_event_times(torch, lambda i: dst.copy_(src), 1, reps)
        how = "torch dst.copy_(src), CUDA events"
        del src, dst
    else:
        copy = profiling.copy_bandwidth(nbytes, reps)
        seconds, how = copy["seconds"], copy["how"]
    return {"bytes": 2 * nbytes, "seconds": seconds, "tbps": 2 * nbytes / seconds / 1e12,
            "how": how}


def section_parser(doc: str) -> argparse.ArgumentParser:
    """The command line of a section script that bench.py runs: --json FILE, its rows."""
    parser = argparse.ArgumentParser(description=doc,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", required=True, help="where the rows go (a JSON list)")
    return parser


def points(text: str) -> list:
    """"AxB,CxD" -> [(A, B), (C, D)]: a section's points on its command line."""
    return [tuple(int(v) for v in p.split("x")) for p in text.split(",") if p]


def emit(rows: list, row: dict, path) -> None:
    """Appends `row` to `rows`, prints it and rewrites the JSON list at `path`, so that
    a section stopped midway leaves the rows it had."""
    rows.append(row)
    print(json.dumps(row), flush=True)
    pathlib.Path(path).write_text(json.dumps(rows))
