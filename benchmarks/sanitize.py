"""Driver for compute-sanitizer (memcheck, racecheck, synccheck): two steps of the fused
kernel through the eager DLPack path on torch tensors, for each split, with every edge
case in the batch (padding rows, no records, out-of-range slot and record row). The
data is built on the CPU so that the only GPU work is the kernel and the copies.

    JAX_PLATFORMS=cpu compute-sanitizer --tool memcheck python tests/gpu_sanitize.py
"""
import sys

import jax
import jax.numpy as jnp
import numpy as np
import torch

from jax_kda import KdaConfig
from jax_kda.ffi import eager_verify
from jax_kda.testing import random_cache, random_inputs, random_params

SLOTS, RECORDS = 9, 7


def to_torch(tree):
    def move(a):
        a = np.asarray(a)
        if a.dtype == jnp.bfloat16:
            return torch.from_numpy(a.view(np.uint16).copy()).view(torch.bfloat16).cuda()
        return torch.from_numpy(a.copy()).cuda()
    return jax.tree.map(move, tree)


def main(splits):
    slots = [3, 0, 5, SLOTS + 2, 1, 7]
    rows = [2, 4, -1, 1, RECORDS + 1, 0]
    for split in splits:
        config = KdaConfig(heads=2, tokens=4, split=split)
        key = jax.random.key(split)
        params = to_torch(random_params(key, config))
        cache = to_torch(random_cache(jax.random.fold_in(key, 1), config, SLOTS, RECORDS))
        for step in range(2):
            inputs = to_torch(random_inputs(jax.random.fold_in(key, 2 + step), config, slots,
                                            rows))
            out = torch.full((len(slots), 4, 2, 128), float("nan"), dtype=torch.bfloat16,
                             device="cuda")
            eager_verify(params, cache, inputs, out, config)
            torch.cuda.synchronize()
            assert not torch.isnan(out).any(), f"split {split}: an output was not written"
        print(f"split {split}: 2 steps ran, outputs written", flush=True)


if __name__ == "__main__":
    main([int(s) for s in sys.argv[1:]] or [1, 2, 4, 8])
