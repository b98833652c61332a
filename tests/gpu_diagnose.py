"""Element-level look at the kernel's largest differences from `chunked_verify` (run on
the CPU) on one verify step: the corrections whose difference is one bf16 rounding of v
(ratio to beta ulp(v) near +-1), the largest output differences, and how often XLA's
bf16-rounded v and k differ between the GPU and the CPU (XLA on the GPU elides
f32 -> bf16 -> f32 round trips: openxla/xla#41605).

    python tests/gpu_diagnose.py [seed tokens gate_mode split]     (default 814 8 1 4)
"""
import functools
import sys

import jax
import numpy as np

from jax_kda import KdaConfig, fused_verify
from jax_kda.operands import locate, prepare_tokens, read_history
from jax_kda.reference import chunked_verify
from test_gpu import NUM_RECORDS, NUM_SLOTS, batch, copy, poison
from jax_kda.testing import random_cache, random_inputs, random_params


def main(seed=814, tokens=8, gate_mode=1, split=4):
    config = KdaConfig(heads=3, tokens=tokens, gate_mode=gate_mode, split=split)
    key = jax.random.key(seed)
    params = random_params(jax.random.fold_in(key, 0), config)
    cache = poison(random_cache(jax.random.fold_in(key, 1), config, NUM_SLOTS, NUM_RECORDS),
                   config)
    slots, rows = batch(np.random.default_rng(seed), edge_cases=True)
    inputs = random_inputs(jax.random.fold_in(key, 10), config, slots, rows)
    cpu = jax.devices("cpu")[0]
    out_ref, cache_ref = chunked_verify(*jax.device_put((params, cache, inputs), cpu), config)
    step = jax.jit(functools.partial(fused_verify, config=config, backend="cutedsl"))
    out, cache_k = step(params, copy(cache), inputs)

    where = locate(cache, inputs.slots, inputs.record_rows, config.rq)
    history = read_history(cache, where)
    tokens_gpu = prepare_tokens(params, inputs.x, inputs.f_a, inputs.beta, history, config)
    with jax.default_device(cpu):
        tokens_cpu = prepare_tokens(*jax.device_put(
            (params, inputs.x, inputs.f_a, inputs.beta, history), cpu), config)
    v = np.asarray(tokens_cpu.v)  # [B, H, T, K]
    beta = np.asarray(tokens_cpu.beta)  # [B, H, T]
    for name in ("v", "key"):
        a, b = np.asarray(getattr(tokens_gpu, name)), np.asarray(getattr(tokens_cpu, name))
        print(f"XLA GPU vs CPU bf16 {name}: {np.mean(a != b):.2e} of the values differ")

    du = np.asarray(cache_k.corrections) - np.asarray(cache_ref.corrections)
    du = np.nan_to_num(du)
    reference = np.abs(np.nan_to_num(np.asarray(cache_ref.corrections)))
    off = np.abs(du) > 1e-5 * reference.max()
    print(f"corrections off by more than 1e-5 of their maximum: {int(off.sum())} of "
          f"{du.size} (a few: rounding flips; many: a systematic difference)")
    print("largest |u_kernel - u_ref| (rec, h, t, row): diff, diff / (beta ulp(v)) of the "
          "request")
    rec_of = {int(r): b for b, r in enumerate(np.asarray(rows))}
    for flat in np.argsort(-np.abs(du), axis=None)[:8]:
        r, h, t, row = np.unravel_index(flat, du.shape)
        b = rec_of.get(int(r))
        ratio = float("nan")
        if b is not None:
            ulp = np.abs(v[b, h, t, row]) * 2.0**-8
            ratio = du[r, h, t, row] / (beta[b, h, t] * ulp + 1e-30)
        print(f"  ({r}, {h}, {t}, {row}): {du[r, h, t, row]:+.3e}, ratio {ratio:+.2f}")
    a, e = np.asarray(out, np.float32), np.asarray(out_ref, np.float32)
    scale = np.abs(e) + np.mean(np.abs(e), -1, keepdims=True) + 1e-30
    err = np.abs(a - e) / scale
    print("largest out errors (b, t, h, row): error, kernel, reference, rows of that "
          "(b, t, h) over 4 * 2^-8")
    for flat in np.argsort(-err, axis=None)[:8]:
        b, t, h, row = np.unravel_index(flat, err.shape)
        print(f"  ({b}, {t}, {h}, {row}): {err[b, t, h, row]:.4f}, {a[b, t, h, row]:+.4f}, "
              f"{e[b, t, h, row]:+.4f}, {int(np.sum(err[b, t, h] > 4 * 2**-8))}")


if __name__ == "__main__":
    main(*map(int, sys.argv[1:]))
