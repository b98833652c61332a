"""Driver for compute-sanitizer (memcheck, racecheck, synccheck): two steps of the fused
kernel through the eager DLPack path on torch tensors, for each split, with every edge
case in the batch (padding rows, no records, out-of-range slot and record row), then
two steps of the stacked-layer kernel on a stacked cache, one in range and one with
an out-of-range layer (every row padding); each with checkpoint_every 1, 2 and 4 (the
record rows' kept counts spread over 0..RQ: verifies that keep and ones that write).
The data is built on the CPU, so that the only GPU work is the kernel and the copies.

    JAX_PLATFORMS=cpu compute-sanitizer --tool memcheck python tools/kernel_lab/sanitize.py [SPLIT ...]
"""
import sys

import jax
import torch

from jax_kda import KdaConfig
from jax_kda.ffi import eager_verify
from jax_kda.testing import random_cache, random_inputs, random_params
import bench_path  # noqa: F401 - benchmarks/ on sys.path
from peers import host_to_cuda

SLOTS, RECORDS, LAYERS = 9, 7, 2
SLOT_LIST = [3, 0, 5, SLOTS + 2, 1, 7]
ROW_LIST = [2, 4, -1, 1, RECORDS + 1, 0]


def steps(config, key, params, cache, layers):
    """One verify per entry of `layers` (None: unstacked) on the edge-case batch; returns
    the outputs. Between steps pending goes back to its first counts, as an accept of
    them would, so that the second step replays."""
    first = cache.pending.clone()
    outs = []
    for step, layer in enumerate(layers):
        inputs = host_to_cuda(torch, random_inputs(jax.random.fold_in(key, 2 + step), config,
                                                   SLOT_LIST, ROW_LIST))
        out = torch.full((len(SLOT_LIST), config.tokens, config.heads, 128), float("nan"),
                         dtype=torch.bfloat16, device="cuda")
        index = None if layer is None else torch.tensor([layer], dtype=torch.int32,
                                                        device="cuda")
        eager_verify(params, cache, inputs, out, config, layer=index)
        torch.cuda.synchronize()
        cache.pending.copy_(first)
        outs.append(out)
    return outs


def cache_of(config, key, layers=None):
    """A random cache on the GPU, its record rows' pending counts spread over 0..RQ."""
    cache = host_to_cuda(torch, random_cache(jax.random.fold_in(key, 1), config, SLOTS,
                                             RECORDS, layers=layers))
    spread = torch.arange(RECORDS, device="cuda", dtype=torch.int32) * config.rq // (RECORDS - 1)
    cache.pending.copy_(spread[:, None].expand(cache.pending.shape[-2:]))
    return cache


def main(splits):
    for split, every in ((split, every) for split in splits for every in (1, 2, 4)):
        config = KdaConfig(heads=2, tokens=4, split=split, checkpoint_every=every)
        name = f"split {split}, checkpoint_every {every}"
        key = jax.random.key(split)
        params = host_to_cuda(torch, random_params(key, config))
        for out in steps(config, key, params, cache_of(config, key), [None, None]):
            assert not torch.isnan(out).any(), f"{name}: an output was not written"
        print(f"{name}: 2 steps ran, outputs written", flush=True)
        params = host_to_cuda(torch, random_params(key, config, layers=LAYERS))
        inside, outside = steps(config, key, params, cache_of(config, key, LAYERS),
                                [LAYERS - 1, LAYERS + 3])
        assert not torch.isnan(inside).any(), f"{name}: a stacked output was not written"
        assert (outside == 0).all(), f"{name}: an out-of-range layer wrote outputs"
        print(f"{name}: stacked, layer {LAYERS - 1} and out-of-range layer {LAYERS + 3} ran",
              flush=True)


if __name__ == "__main__":
    main([int(s) for s in sys.argv[1:]] or [1, 2, 4, 8])
