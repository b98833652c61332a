"""The lazy checkpoint section of the benchmark: the fused kernel at checkpoint_every
C = 1, 2, 4, 8 (record_tokens C T), H = 32, in steady state with every token accepted.
A verify then starts from n = T, 2T, .., C T kept tokens (`measure.lazy_cycle`), and the
last of them writes the state: the time per step is the mean over that cycle of each
n's graph time (`graphs.Point`: one cache set per launch, the pending counts held at
n). Each row also gives the bytes a step must move (the cycle's mean of
`measure.verify_bytes`) over the measured copy bandwidth, and the cache per request.

Correctness first: one step of each C (n spread over 0..RQ, so that some heads keep and
some write) through the eager kernel against the XLA backend on the CPU.

Each row: B, T, C, split, us per n, step_us, copy_fraction, bytes, or error. Run alone:

    JAX_PLATFORMS=cpu python benchmarks/lazy.py --json lazy.json [--points 64x4x4,...]
"""
from __future__ import annotations

import dataclasses
import statistics
import sys

import jax
import jax.numpy as jnp
import numpy as np
import torch

import measure  # benchmarks/, on sys.path as the script's folder
from jax_kda import KdaConfig, fused_verify
from jax_kda.ffi import eager_verify, kernel_split
from jax_kda.kernels import compile_verify
from jax_kda.testing import random_cache, random_inputs, random_params
from peers import host_to_cuda
from graphs import H, Point

def check(T, C, heads=4, B=4):
    """Worst errors of one eager step against the XLA backend on the CPU: out in bf16
    units of its row's scale, state and corrections against their largest value,
    window and pending as differing elements."""
    config = KdaConfig(heads=heads, tokens=T, checkpoint_every=C)
    key = jax.random.key(C)
    params = random_params(key, config)
    cache = random_cache(jax.random.fold_in(key, 1), config, B + 1, B)
    spread = (np.arange(B)[:, None] * config.rq) // (B - 1)  # 0 .. RQ: keeps and writes
    cache = dataclasses.replace(cache, pending=jnp.broadcast_to(
        jnp.asarray(spread, jnp.int32), cache.pending.shape))
    inputs = random_inputs(jax.random.fold_in(key, 2), config, np.arange(1, B + 1),
                           np.arange(B))
    out_ref, cache_ref = fused_verify(params, cache, inputs, config, backend="jax")
    gpu = lambda tree: host_to_cuda(torch, tree)
    on_gpu = gpu(cache)
    out = torch.full((B, T, heads, 128), float("nan"), dtype=torch.bfloat16, device="cuda")
    eager_verify(gpu(params), on_gpu, gpu(inputs), out, config)
    torch.cuda.synchronize()
    f64 = lambda a: np.asarray(a.float().cpu() if torch.is_tensor(a) else a, np.float64)
    e = f64(out_ref)
    scale = np.abs(e).mean(-1, keepdims=True) + 1e-30
    worst = lambda a, b: float(np.nan_to_num(np.abs(f64(a) - f64(b)), nan=np.inf).max()
                               / np.abs(f64(b)).max())
    same = lambda a, b: int(np.sum(f64(a) != f64(b)))
    return {"out_bf16_units": float(np.nan_to_num(np.abs(f64(out) - e) / scale, nan=np.inf)
                                    .max() / 2**-8),
            "state": worst(on_gpu.state, cache_ref.state),
            "corrections": worst(on_gpu.corrections, cache_ref.corrections),
            "window": same(on_gpu.conv, cache_ref.conv),
            "pending": same(on_gpu.pending, cache_ref.pending)}


def time_point(B, T, C, copy_tbs):
    config = KdaConfig(heads=H, tokens=T, checkpoint_every=C)
    split = kernel_split(config, B)
    point = Point(B, T, split, checkpoint_every=C)
    compiled = compile_verify(point.config, split, True, "float32", "float32",
                              solo=point.solo)
    us = {}
    for n in measure.lazy_cycle(T, C):
        point.hold(n)
        us[n] = point.graph_time(compiled)
    step_us = statistics.mean(us.values())
    moved = measure.lazy_step_bytes(H, T, B, C)
    del point
    torch.cuda.empty_cache()
    return dict(split=split, us_per_n=us, step_us=step_us, bytes=moved["total"],
                state_bytes=moved["state_read"] + moved["state_write"],
                copy_fraction=moved["total"] / (step_us * 1e-6) / (copy_tbs * 1e12),
                cache_bytes=measure.memory_per_request(H, T, C * T)["ours_bytes"])


def run(args) -> list:
    rows = []
    for C in measure.LAZY_EVERY:
        measure.emit(rows, dict(kind="check", T=4, C=C, **check(4, C)), args.json)
    copy_tbs = measure.copy_bandwidth(torch)["tbps"]
    measure.emit(rows, dict(kind="copy", tbs=copy_tbs), args.json)
    for B, T, C in args.points:
        row = dict(kind="time", B=B, T=T, C=C)
        try:
            row.update(time_point(B, T, C, copy_tbs))
        except Exception as error:  # noqa: BLE001 - out of memory, a config that fits no split
            row["error"] = f"{type(error).__name__}: {str(error)[:300]}"
        measure.emit(rows, row, args.json)
    return rows


def parse(argv):
    parser = measure.section_parser(__doc__)
    parser.add_argument("--points", type=measure.points, default=measure.LAZY_POINTS,
                        help="BxTxC points (default: T = 4 at B = 1, 64, 256 and C = 1, 2, "
                             "4, 8; T = 2, 8 at B = 64 and C = 1, 4)")
    return parser.parse_args(argv)


if __name__ == "__main__":
    run(parse(sys.argv[1:]))
