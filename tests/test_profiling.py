"""`jax_kda.profiling`: copy_bandwidth's bytes and clock; traced_steps' times per step on
a made-up GPU trace, jax_kda's own kernels apart."""
import jax
import pytest

from jax_kda import profiling
from jax_kda.profiling import copy_bandwidth


def test_copy_bandwidth_counts_read_and_write():
    copy = copy_bandwidth(1 << 20, 2)
    assert copy["bytes"] == 2 << 20 and copy["seconds"] > 0
    # the profiler's GPU time on a GPU, the wall clock elsewhere
    assert copy["how"].endswith("wall clock") == (jax.default_backend() != "gpu")


def trace(steps, period_ns=100_000):
    """A made-up GPU trace of `steps` equal steps: an XLA fusion, one of jax_kda's kernels,
    a fusion whose name holds "kda_" but does not begin with it, another fusion."""
    one = [("fusion_1", 0, 10_000), ("kda_verify_t4_split1_0123abcd_0", 12_000, 40_000),
           ("loop_kda_fusion", 41_000, 45_000), ("fusion_2", 44_000, 50_000)]
    return [profiling.Kernel(name, start + i * period_ns, end + i * period_ns)
            for i in range(steps) for name, start, end in one]


def test_traced_steps_times_each_step_and_ours(monkeypatch):
    """Per step: the span, the busy time (overlaps once), the gaps, and jax_kda's own
    kernels (named kda_...) apart from the rest."""
    monkeypatch.setattr(profiling, "traced_kernels", lambda run: trace(3))
    got = profiling.traced_steps(lambda: None, 3)
    assert got["steps"] == 3 and got["kernels"] == 4 and got["ours"] == 1
    assert got["step_us"] == 50.0 and got["busy_us"] == 10 + 28 + 9
    assert got["ours_us"] == 28.0 and got["kernel_us"] == (6 + 10) / 2  # of 4, 6, 10, 28
    assert got["gap_us"] == 1.0  # 2, 1 and -1 (overlapped) us
    by_name = profiling.traced_steps(lambda: None, split=lambda kernels: [
        [k for k in kernels if k.name.startswith("kda_")]])
    assert by_name["steps"] == 1 and by_name["ours"] == 3 and by_name["ours_us"] == 3 * 28.0


def test_traced_steps_refuses_uneven_steps(monkeypatch):
    monkeypatch.setattr(profiling, "traced_kernels", lambda run: trace(3))
    with pytest.raises(ValueError, match="do not divide"):
        profiling.traced_steps(lambda: None, 5)
    with pytest.raises(ValueError, match="exactly one of steps and split"):
        profiling.traced_steps(lambda: None)
