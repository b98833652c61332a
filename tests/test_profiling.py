"""`jax_kda.profiling.copy_bandwidth`: the bytes it counts and the clock it reads."""
import jax

from jax_kda.profiling import copy_bandwidth


def test_copy_bandwidth_counts_read_and_write():
    copy = copy_bandwidth(1 << 20, 2)
    assert copy["bytes"] == 2 << 20 and copy["seconds"] > 0
    # the profiler's GPU time on a GPU, the wall clock elsewhere
    assert copy["how"].endswith("wall clock") == (jax.default_backend() != "gpu")
