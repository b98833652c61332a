"""Target for Nsight Compute: a few launches of the fused verify at one point (B, H, T,
split; `tree`: the tree build, each request a random tree), each on a cache of its own
so that the state comes from HBM and every launch replays its requests' pending tokens
(a verify leaves them awaiting an accept). The data is built on the CPU; the only
kernels are the verify's.

    JAX_PLATFORMS=cpu ncu --clock-control none --set full -k regex:kernel \
        --launch-skip 2 --launch-count 1 python tools/kernel_lab/ncu_target.py B T SPLIT [tree]
"""
import dataclasses
import sys

import jax
import numpy as np
import torch

from jax_kda import KdaConfig
from jax_kda.ffi import eager_verify
from jax_kda.testing import random_cache, random_inputs, random_params, random_parents
import bench_path  # noqa: F401 - benchmarks/ on sys.path
from peers import host_to_cuda

H, LAUNCHES = 32, 4


def main(B, T, split, trees=False):
    config = KdaConfig(heads=H, tokens=T, split=split, trees=trees)
    key = jax.random.key(B)
    params = host_to_cuda(torch, random_params(key, config))
    slots, rows = np.arange(1, B + 1), np.arange(B)
    caches = [host_to_cuda(torch, random_cache(jax.random.fold_in(key, 1 + i), config, B + 1, B))
              for i in range(LAUNCHES)]
    inputs = random_inputs(jax.random.fold_in(key, 99), config, slots, rows)
    if trees:
        inputs = dataclasses.replace(inputs, parents=random_parents(np.random.default_rng(B),
                                                                    B, T))
    inputs = host_to_cuda(torch, inputs)
    out = torch.empty((B, T, H, 128), dtype=torch.bfloat16, device="cuda")
    for cache in caches:
        eager_verify(params, cache, inputs, out, config)
    torch.cuda.synchronize()
    print(f"B={B} T={T} split={split}{' tree' * trees}: {LAUNCHES} launches", flush=True)


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:4]), trees=sys.argv[4:] == ["tree"])
