"""Driver for compute-sanitizer (memcheck, racecheck, synccheck): two steps of the fused
kernel through the eager DLPack path on torch tensors, for each split, with every edge
case in the batch (padding rows, no records, out-of-range slot and record row), then
two steps of the stacked-layer kernel on a stacked cache, one in range and one with
an out-of-range layer (every row padding). Each case of CASES is a configuration and
the checkpoint_every values it runs at (the record rows' kept counts spread over 0..RQ:
verifies that keep and ones that write): chains of 4 and 16, trees of 8 and 16 (random
trees, with out-of-range, non-topological and root parents in some rows) and a bf16
state. The data is built on the CPU, so that the only GPU work is the kernel and the
copies. Every step's outputs are checked against the XLA backend's on the CPU on the same
data and cache (`tests/compare.out_error`, the GPU tests' unit and tolerance): a NaN, a
stale output or a wrong one fails the run, naming the step and the rows. Without
compute-sanitizer the same command checks the kernels of every split in one process.

    JAX_PLATFORMS=cpu compute-sanitizer --tool memcheck python tools/kernel_lab/sanitize.py \
        [CASE [SPLIT ...]]    (default: chain at splits 1, 2, 4, 8)

With CUTE_DSL_LINEINFO=1 the kernels carry their Python lines: each report names them.
"""
import dataclasses
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import torch

import jax_kda
from jax_kda import KdaConfig
from jax_kda.backends import spilling_build
from jax_kda.ffi import eager_verify
from jax_kda.testing import random_cache, random_inputs, random_params, random_parents
import bench_path  # noqa: F401 - benchmarks/ on sys.path
from peers import cuda_to_host, host_to_cuda

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "tests"))
from compare import out_error  # noqa: E402 - the GPU tests' unit of outputs
from test_gpu import TOLERANCES  # noqa: E402

SLOTS, RECORDS, LAYERS = 9, 7, 2
SLOT_LIST = [3, 0, 5, SLOTS + 2, 1, 7]
ROW_LIST = [2, 4, -1, 1, RECORDS + 1, 0]
CASES = {  # name: (KdaConfig's values, checkpoint_every values)
    "chain": (dict(tokens=4), (1, 2, 4)),
    "chain16": (dict(tokens=16), (1,)),
    "tree8": (dict(tokens=8, trees=True), (1,)),
    "tree16": (dict(tokens=16, trees=True), (1,)),
    "bf16": (dict(tokens=4, state_dtype=jnp.bfloat16), (1, 2)),
}


def parents_of(config, step):
    """Random trees for the batch, with bad entries in two rows: out of range (past t,
    negative), a node 0 that is not -1; None for a chain."""
    if not config.trees:
        return None
    parents = np.array(random_parents(np.random.default_rng(step), len(SLOT_LIST),
                                      config.tokens))
    parents[0, 1], parents[0, -1], parents[4, 0] = config.tokens + 5, -7, 2
    return jnp.asarray(parents)


def steps(config, key, params, cache, layers):
    """One verify per entry of `layers` (None: unstacked) on the edge-case batch, by the
    kernel on `cache` (torch, on the GPU) and by the XLA backend on the CPU from the
    kernel's cache read back before it, as the GPU tests check a step (the records' bf16
    roundings do not compound). Between steps pending goes back to its first counts, as
    an accept of them would, so that the second step replays. Returns (kernel's, XLA's)
    outputs of each step, float32."""
    first = cache.pending.clone()
    on_gpu = host_to_cuda(torch, params)
    outs = []
    for step, layer in enumerate(layers):
        inputs = dataclasses.replace(
            random_inputs(jax.random.fold_in(key, 2 + step), config, SLOT_LIST, ROW_LIST),
            parents=parents_of(config, step))
        expected, _ = jax_kda.fused_verify(
            params, cuda_to_host(torch, cache), inputs, config, backend="jax",
            layer=None if layer is None else jnp.int32(layer))
        out = torch.full((len(SLOT_LIST), config.tokens, config.heads, 128), float("nan"),
                         dtype=torch.bfloat16, device="cuda")
        index = None if layer is None else torch.tensor([layer], dtype=torch.int32,
                                                        device="cuda")
        eager_verify(on_gpu, cache, host_to_cuda(torch, inputs), out, config, layer=index)
        torch.cuda.synchronize()
        cache.pending.copy_(first)
        outs.append((out.float().cpu().numpy(), np.asarray(expected, np.float32)))
    return outs


def cache_of(config, key, layers=None):
    """A random cache on the GPU, its record rows' pending counts spread over 0..RQ."""
    cache = host_to_cuda(torch, random_cache(jax.random.fold_in(key, 1), config, SLOTS,
                                             RECORDS, layers=layers))
    spread = torch.arange(RECORDS, device="cuda", dtype=torch.int32) * config.rq // (RECORDS - 1)
    cache.pending.copy_(spread[:, None].expand(cache.pending.shape[-2:]))
    return cache


def checked(name, outs):
    """Fails where a step's outputs hold a NaN or stray from the XLA backend's beyond
    the GPU tests' tolerance, naming the step and the rows."""
    for step, (out, expected) in enumerate(outs):
        rows = [b for b in range(len(out)) if not out_error(out[b], expected[b])
                <= TOLERANCES["out"]]
        assert not rows, (f"{name}, step {step}: rows {rows} off the XLA backend's outputs "
                          f"(NaN in {int(np.isnan(out).sum())} of {out.size})")


def main(case, splits):
    values, everies = CASES[case]
    for split, every in ((split, every) for split in splits for every in everies):
        config = KdaConfig(heads=2, split=split, checkpoint_every=every, **values)
        name = f"{case}, split {split}, checkpoint_every {every}"
        if spilling_build(config, split):
            print(f"{name}: not launched ({spilling_build(config, split)})", flush=True)
            continue
        key = jax.random.key(split)
        checked(name, steps(config, key, random_params(key, config), cache_of(config, key),
                            [None, None]))
        print(f"{name}: 2 steps ran, outputs match the XLA backend's", flush=True)
        (inside, _), (outside, _) = outs = steps(
            config, key, random_params(key, config, layers=LAYERS),
            cache_of(config, key, LAYERS), [LAYERS - 1, LAYERS + 3])
        checked(f"{name}, stacked", outs[:1])
        assert (outside == 0).all(), f"{name}: an out-of-range layer wrote outputs"
        print(f"{name}: stacked, layer {LAYERS - 1} and out-of-range layer {LAYERS + 3} ran",
              flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "chain",
         [int(s) for s in sys.argv[2:]] or [1, 2, 4, 8])
