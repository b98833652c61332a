"""`cutedsl_verify`: the fused kernel as an XLA custom call (cutlass.jax.cutlass_call),
with the cache buffers it writes (state, conv, corrections, key_gates) aliased from
inputs to outputs, so that a jitted step with the cache donated updates them in place.

cutlass_call compiles during lowering (also under `jax.export` for platforms=["cuda"]
on a machine with no GPU) and caches the binary per kernel, operand shapes and specs:
one compile per configuration and (B, S, R); JAX's own jit cache sits above it. The
kernel object (one per static configuration, `verify_kernel`) is its compile key, so a
lookup does not trace the kernel again: lowering a 20-layer step takes 3.6 s instead of
5.3-6.1, and 0.09 s instead of 1.7 once its kernel is compiled (CPU, H = 32, T = 4).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jax_kda.config import K, KdaConfig
from jax_kda.pytrees import KdaCache, KdaParams, VerifyInputs
from jax_kda.validate import check_verify

SPLITS = (1, 2, 4, 8)
DEFAULT_SMS = 132  # H100 SXM and H200
CACHE_WRITES = ("state", "conv", "corrections", "key_gates")  # aliased to outputs 1..4
FIRST_WRITE = 12  # operand position of cache.state


def sm_count(device=None) -> int:
    """Streaming multiprocessors of `device` (the default device), 132 if unknown."""
    device = jax.devices()[0] if device is None else device
    return int(getattr(device, "core_count", 0) or DEFAULT_SMS)


def choose_split(items: int, sms: int) -> int:
    """CTAs per (request, head) for `items` = B x H on `sms` SMs: the smallest split at
    which the grid puts a CTA on a quarter of the SMs, and at least 2 while the split-2
    grid still fits the SMs one CTA each. A large batch streams each state with one CTA
    (the per-token operands computed once per item); a small one spreads its rows over
    SMs that would otherwise stay idle (H = 32 on 132 SMs: split 2 for B <= 2). Measured
    on the H200 (us, H = 32, split 1 / 2; launched back to back as the benchmark does and,
    in parentheses, one at a time as under XLA; benchmarks/RESULTS.md of 2026-12-01 04:49
    and tests/GPU_RESULTS.md 08:41-08:45): B = 1, T = 4: 6.2 / 5.4 (7.17 / 6.36; split 4
    6.1, 6.86); B = 2, T = 2, 4, 8: 6.10 / 5.46, 6.98 / 6.01, 11.64 / 9.18 (6.69 / 5.92,
    7.85 / 6.98, 11.67 / 9.40); B = 3: 6.86 / 7.26, 7.42 / 8.22, 12.11 / 12.24 (7.64 /
    7.86, 8.01 / 8.42, 12.39 / 12.77); B = 4, T = 4: 8.1 / 8.0 (9.12 / 9.27), T = 8:
    12.8 / 12.1 (12.36 / 12.50: under XLA split 1 wins; at B = 3-8, T = 5, 6 and 8 it is
    ahead or within 0.7%, 10:06-10:11); B = 64: 88.9 / 119.4."""
    for split in SPLITS:
        if items * split >= sms // 4 and (split > 1 or 2 * items > sms):
            return split
    return SPLITS[-1]


def solo_ctas(config: KdaConfig, batch: int, split: int, sms: int | None = None) -> bool:
    """Whether the launch gives each CTA an SM of its own (`FusedVerify`'s solo): where
    its batch x heads x split CTAs fit the SMs one each, at split 1 or 2. With two CTAs
    allowed per SM, back-to-back launches put beside each CTA one of the next launch,
    parked in griddepcontrol.wait (PDL), and a grid may even land two to an SM on half
    the SMs (seen at split 4). Measured on the H200 against two CTAs allowed (H = 32,
    tests/GPU_RESULTS.md 20:05-20:30): B = 3 and 4 at split 1 -3..-8% (T = 2, 4, 8),
    B = 2 at split 2 -4%, level on grids of at most 64 CTAs; solo CTAs at splits 4 and 8
    (clusters of four SMs and more) were 49-58% slower, and above one CTA per SM they
    take a second wave (B = 8: +17%)."""
    sms = sm_count() if sms is None else sms
    return split <= 2 and batch * config.heads * split <= sms


def kernel_split(config: KdaConfig, batch: int, has_bias: bool = True,
                 sms: int | None = None) -> int:
    """The split the kernel runs `config` with at `batch` requests: config.split, or
    `choose_split`'s raised to the smallest whose CTA fits Hopper's shared memory (long
    records need more). Raises ValueError, naming the need, where none fits."""
    from jax_kda.kernels import SHARED_LIMIT, verify_kernel

    if config.split is None:
        first = choose_split(batch * config.heads, sm_count() if sms is None else sms)
        candidates = [s for s in SPLITS if s >= first]
    else:
        candidates = [config.split]
    for split in candidates:
        need = verify_kernel(config, split, has_bias).shared_bytes()
        if need <= SHARED_LIMIT:
            return split
    raise ValueError(
        f"config: tokens={config.tokens}, record_tokens={config.rq}, split={split} needs "
        f"{need / 1024:.0f} KiB of shared memory per CTA, more than the "
        f"{SHARED_LIMIT // 1024} KiB of a Hopper SM; use a larger split (or split=None), "
        f"fewer record_tokens, or backend='jax'")


def cutedsl_verify(params: KdaParams, cache: KdaCache, inputs: VerifyInputs,
                   config: KdaConfig):
    """The fused CuTe DSL verify (SPEC.md sections 3-4) as a custom call.

    Same contract as `jax_kda.reference.chunked_verify`: returns (out [B, T, H, K]
    bf16, cache). config.split None picks the split with `kernel_split`.
    """
    import cutlass.jax as cjax

    from jax_kda.kernels import verify_kernel

    B = check_verify(params, cache, inputs, config)
    has_bias = params.conv_bias is not None
    # one compiled kernel per split, chosen or given
    config = dataclasses.replace(config, split=kernel_split(config, B, has_bias))
    # one object per static configuration: cutlass_call's compile key
    kernel = verify_kernel(config, config.split, has_bias,
                           solo=solo_ctas(config, B, config.split))
    operands = (inputs.x, inputs.f_a, inputs.beta, inputs.gate, inputs.slots,
                inputs.record_rows, params.conv_weight, params.conv_bias, params.a_log,
                params.dt_bias, params.f_b, params.norm_weight, cache.state, cache.conv,
                cache.corrections, cache.key_gates, cache.pending)
    out_shape = jax.ShapeDtypeStruct((B, config.tokens, config.heads, K), jnp.bfloat16)
    shapes = (out_shape,) + tuple(getattr(cache, name) for name in CACHE_WRITES)
    results = cjax.cutlass_call(
        kernel, output_shape_dtype=shapes,
        input_output_aliases={FIRST_WRITE + i: 1 + i for i in range(len(CACHE_WRITES))},
        compile_key=kernel,
    )(*operands)
    out, state, conv, corrections, key_gates = results
    return out, KdaCache(state, conv, corrections, key_gates, cache.pending)
