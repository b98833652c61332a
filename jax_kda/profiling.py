"""Device-side time of the steps a program enqueues, from JAX's profiler trace of the GPU:
what the device was busy with per step, with no host dispatch or waiting in it; and the
device's copy bandwidth, the ceiling a memory-bound step is set against."""
from __future__ import annotations

import collections
import glob
import statistics
import tempfile
import time
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

HOST_COPIES = ("MemcpyH2D", "MemcpyD2H")  # the trace's names of host <-> device copies
OURS = "kda_"  # how jax_kda's kernels' names begin (`jax_kda.kernels.Kernel.symbol`)


class Kernel(NamedTuple):
    """One activity on a GPU stream (a kernel, a device-side copy or memset), times in ns."""

    name: str
    start_ns: int
    end_ns: int


def traced_steps(run: Callable[[], object], steps: int | None = None, *,
                 split: Callable[[list[Kernel]], list[list[Kernel]]] | None = None) -> dict:
    """Runs `run()` (which must block until its device work is done) under
    `jax.profiler` and times, per step, the GPU activity it traced.

    Give exactly one of:
      steps: how many steps `run()` enqueued, each the same work: the activities, in
        start order, are cut into `steps` consecutive groups of equal count (a count
        that does not divide raises ValueError: pass `split`).
      split: the caller's grouping, from all activities in start order ([Kernel]) to
        the steps' ([[Kernel]]), e.g. only the kernels of one name, so many a step.

    Returns a dict of medians over the steps, in microseconds: step_us, the span from
    the step's first start to its last end; busy_us, the time some activity of the
    step ran (the span less its idle gaps); kernel_us, an activity's duration; gap_us,
    the gap from one activity's end to the next one's start (negative where they
    overlapped); ours_us, the summed durations of jax_kda's own kernels in the step
    (named `OURS`...), the library's share of it; besides steps (how many), kernels and
    ours (activities per step, all and jax_kda's) and names (the four commonest activity
    names and their counts). Without GPU activity (e.g. on a CPU): {"steps": 0,
    "names": {}}.
    """
    if (steps is None) == (split is None):
        raise ValueError(f"traced_steps: give exactly one of steps and split, got {steps=}, "
                         f"split={split!r}")
    if steps is not None and (not isinstance(steps, int) or steps < 1):
        raise ValueError(f"steps: expected an int >= 1, got {steps!r}")
    kernels = traced_kernels(run)
    if not kernels:
        return {"steps": 0, "names": {}}
    if split is None:
        if len(kernels) % steps:
            raise ValueError(f"traced_steps: {len(kernels)} GPU activities do not divide "
                             f"into {steps=} of equal count: pass split")
        size = len(kernels) // steps
        groups = [kernels[i:i + size] for i in range(0, len(kernels), size)]
    else:
        groups = [sorted(group, key=lambda k: k.start_ns) for group in split(kernels) if group]
    us = lambda ns: ns * 1e-3
    gaps = [us(b.start_ns - a.end_ns) for group in groups for a, b in zip(group, group[1:])]
    return {
        "steps": len(groups),
        "step_us": _median([us(max(k.end_ns for k in g) - g[0].start_ns) for g in groups]),
        "busy_us": _median([us(_busy_ns(g)) for g in groups]),
        "kernel_us": _median([us(k.end_ns - k.start_ns) for g in groups for k in g]),
        "gap_us": _median(gaps),
        "ours_us": _median([us(sum(k.end_ns - k.start_ns for k in g if k.name.startswith(OURS)))
                            for g in groups]),
        "kernels": _median([len(g) for g in groups]),
        "ours": _median([sum(k.name.startswith(OURS) for k in g) for g in groups]),
        "names": dict(collections.Counter(k.name for k in kernels).most_common(4)),
    }


def copy_bandwidth(nbytes: int, reps: int) -> dict:
    """A device-to-device copy on JAX's default device: a jitted `a + 1.0` over `nbytes`
    of FP32 (each byte read once and written once), `reps` times after a warm-up.

    Returns {"bytes": 2 * nbytes (read + written), "seconds": one copy's, the median
    of reps (GPU time from the profiler trace on a GPU, else wall clock), "how"}.
    """
    src = jnp.zeros(nbytes // 4, jnp.float32)
    copy = jax.jit(lambda a: a + 1.0)
    copy(src).block_until_ready()

    def run():
        for _ in range(reps):
            out = copy(src)
        out.block_until_ready()

    traced = {"steps": 0}
    if jax.default_backend() == "gpu":
        traced = traced_steps(run, split=lambda kernels: [[k] for k in kernels])
    if traced["steps"]:
        seconds, how = 1e-6 * traced["kernel_us"], "jax jit(a + 1.0), profiler trace"
    else:
        seconds = wall_times(lambda: copy(src).block_until_ready(), reps)
        how = "jax jit(a + 1.0), wall clock"
    return {"bytes": 2 * nbytes, "seconds": seconds, "how": how}


def wall_times(fn, reps: int) -> float:
    """Seconds of `fn()` (which must block until its work is done), median of reps."""
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def traced_kernels(run) -> list[Kernel]:
    """The GPU stream activities of `run()`, in start order. Left out: the XLA and
    TensorFlow lines of a GPU plane (they repeat the streams' events as ops) and copies
    between host and device (when they run follows the host, not the device)."""
    with tempfile.TemporaryDirectory() as folder:
        jax.profiler.start_trace(folder)
        try:
            run()
        finally:
            jax.profiler.stop_trace()
        paths = glob.glob(f"{folder}/**/*.xplane.pb", recursive=True)
        if not paths:
            return []
        data = jax.profiler.ProfileData.from_file(paths[0])
        kernels = [Kernel(event.name, event.start_ns, event.start_ns + event.duration_ns)
                   for plane in data.planes if plane.name.startswith("/device:GPU")
                   for line in plane.lines if not line.name.startswith(("XLA", "TensorFlow"))
                   for event in line.events
                   if event.duration_ns > 0 and event.name not in HOST_COPIES]
    return sorted(kernels, key=lambda k: (k.start_ns, k.end_ns))


def _busy_ns(group: list[Kernel]) -> int:
    """The length of the union of the activities' intervals (overlaps counted once)."""
    total, reach = 0, None
    for kernel in sorted(group, key=lambda k: k.start_ns):
        if reach is None or kernel.start_ns >= reach:
            total += kernel.end_ns - kernel.start_ns
            reach = kernel.end_ns
        elif kernel.end_ns > reach:
            total += kernel.end_ns - reach
            reach = kernel.end_ns
    return total


def _median(values):
    return statistics.median(values) if values else None
