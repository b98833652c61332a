"""Kernel time of the fused verify with CUDA events (eager path in a CUDA graph), for
B x H x T configurations and each split (and split=None, the automatic choice). NSETS
cache sets are rotated so that the state is streamed from HBM, not L2; every request
has 1..T pending tokens, so the replay writes its checkpoint (the full traffic).

    JAX_PLATFORMS=cpu python tests/gpu_timing.py    # B = 64, 1, 8; H = 32, T = 4
"""
import sys

import jax
import numpy as np
import torch

from jax_kda import KdaConfig
from jax_kda.ffi import eager_verify, kernel_split
from jax_kda.testing import random_cache, random_inputs, random_params
from gpu_sanitize import to_torch

LAUNCHES, REPLAYS = 32, 10


def measure(B, H, T, split, nsets):
    """Mean kernel time (us) and the state traffic's rate (TB/s) of LAUNCHES launches
    captured in a CUDA graph (no host overhead) and replayed REPLAYS times."""
    config = KdaConfig(heads=H, tokens=T, split=split)
    key = jax.random.key(B)
    params = to_torch(random_params(key, config))
    slots, rows = np.arange(1, B + 1), np.arange(B)
    first = to_torch(random_cache(jax.random.fold_in(key, 1), config, B + 1, B))
    caches = [first] + [jax.tree.map(torch.clone, first) for _ in range(nsets - 1)]
    inputs = to_torch(random_inputs(jax.random.fold_in(key, 99), config, slots, rows))
    out = torch.empty((B, T, H, 128), dtype=torch.bfloat16, device="cuda")
    stream = torch.cuda.Stream()
    eager_verify(params, caches[0], inputs, out, config, stream=stream)  # the compile
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for i in range(max(LAUNCHES, nsets)):
            eager_verify(params, caches[i % nsets], inputs, out, config, stream=stream)
    graph.replay()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(REPLAYS):
        graph.replay()
    stop.record()
    torch.cuda.synchronize()
    micros = start.elapsed_time(stop) * 1e3 / (REPLAYS * max(LAUNCHES, nsets))
    traffic = B * H * 128 * 128 * 4 * 2  # the state read once and written once
    return micros, traffic / micros / 1e6


def main():
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{torch.cuda.get_device_name(0)}, {sms} SMs")
    print(f"{'B':>4} {'H':>3} {'T':>2} {'split':>6} {'us':>8} {'state TB/s':>10}")
    for B, H, T, splits in ((64, 32, 4, (None, 1, 2)), (1, 32, 4, (None, 1, 2, 4, 8)),
                            (8, 32, 4, (None, 1, 2))):
        nsets = max(2, -(-(128 << 20) // (B * H * 128 * 128 * 4)))  # 128 MB between reuses
        for split in splits:
            micros, tbps = measure(B, H, T, split, nsets)
            label = (f"auto={kernel_split(KdaConfig(heads=H, tokens=T), B, sms=sms)}"
                     if split is None else str(split))
            print(f"{B:>4} {H:>3} {T:>2} {label:>6} {micros:8.2f} {tbps:10.2f}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
