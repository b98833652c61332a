"""Timing helpers for the tests that detect whole-buffer work by what it costs
(test_donation.py, test_stacked.py)."""
import functools
import time

import jax
import numpy as np


def median_times(calls, repeats=25, warm_up=3):
    """The median wall time of each call in `calls` (functions of no arguments that
    block until done), interleaved so that they share the machine's state."""
    times = [[] for _ in calls]
    for i in range(warm_up + repeats):
        for call, measured in zip(calls, times):
            start = time.perf_counter()
            call()
            if i >= warm_up:
                measured.append(time.perf_counter() - start)
    return [float(np.median(t)) for t in times]


@functools.cache
def yardstick_program():
    """One pass over a state: a donated `state + 1.0`, one read and one write."""
    return jax.jit(lambda state: state + 1.0, donate_argnums=0)


class Repeated:
    """Calls a jitted donating function of one buffer again and again on its result."""

    def __init__(self, function, buffer):
        self.function, self.buffer = function, buffer

    def __call__(self):
        self.buffer = jax.block_until_ready(self.function(self.buffer))


def least_of_attempts(measure, limit, attempts=3):
    """measure() -> (excess, message), repeated until excess < limit, at most
    `attempts` times; returns the last result. Other processes on the machine add
    time to some attempts only; whole-buffer work adds it to every one."""
    for _ in range(attempts):
        excess, message = measure()
        if excess < limit:
            break
    return excess, message


def growth(small, large, one_pass, windows=(), limit=float("inf")):
    """(excess, times): the large cache's step time over the small one's, less the
    same for `windows` (the small and the large cache's bf16 window round trip, XLA:CPU's
    known O(S) cost, timed on its own), as a fraction of one pass over the state; the
    least of `least_of_attempts`'s tries, with the times (ms) it was measured from."""

    def measure():
        small_time, large_time, pass_time, *window = median_times(
            [small, large, one_pass, *windows])
        window_small, window_large = window or (0.0, 0.0)
        excess = (large_time - small_time) - (window_large - window_small)
        times = dict(small=small_time, large=large_time, window_small=window_small,
                     window_large=window_large, one_pass=pass_time)
        return excess / pass_time, {k: round(v * 1e3, 3) for k, v in times.items()}

    return least_of_attempts(measure, limit)
