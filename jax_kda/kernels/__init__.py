"""CuTe DSL kernels for Hopper (sm_90a). Importing this package needs nvidia-cutlass-dsl.

`verify_kernel(config, split, has_bias)` is the kernel object of one configuration
(cutlass_call launches it under JAX); `compile_verify(...)` compiles it ahead of time
for any batch, slot and record count (symbolic B, S, R), as the eager DLPack path and
the compile table (`python -m jax_kda.kernels`) use it.
"""
from __future__ import annotations

import functools
import os

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")  # without a GPU the DSL targets sm_100a

try:
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError("jax_kda.kernels needs CuTe DSL: pip install 'nvidia-cutlass-dsl>=4.8,<4.9'"
                      ) from error

from jax_kda.config import CONV_TAPS, K, KdaConfig
from jax_kda.kernels.fused import STAMPS, FusedVerify

SHARED_LIMIT = 227 * 1024  # dynamic shared memory one CTA may opt into on sm_90
DTYPES = {"float32": cutlass.Float32, "bfloat16": cutlass.BFloat16, "int32": cutlass.Int32,
          "int64": cutlass.Int64}


@functools.lru_cache(maxsize=None)
def verify_kernel(config: KdaConfig, split: int, has_bias: bool,
                  timeline: bool = False, solo: bool = False) -> FusedVerify:
    """The kernel of `config` with `split` CTAs per (request, head); timeline: the
    diagnostic build that stamps each CTA's phases (tests/gpu_timeline.py); solo: each
    CTA on an SM of its own (`jax_kda.ffi.solo_ctas`)."""
    return FusedVerify(config.heads, config.tokens, config.rq, config.gate_mode, has_bias,
                       split, float(config.lower_bound), config.query_scale,
                       float(config.eps), timeline=timeline, solo=solo)


def operand_shapes(config: KdaConfig, B, S, R):
    """Shapes of the kernel's operands in launch order (conv_bias included)."""
    H, T, RQ = config.heads, config.tokens, config.rq
    return [(B, T, 3, H, K), (B, T, K), (B, T, H), (B, T, H, K), (B,), (B,),
            (3, CONV_TAPS, H, K), (3, H, K), (H,), (H, K), (H, K, K), (K,),
            (S, H, K, K), (S, 3, H, K, RQ + CONV_TAPS - 2), (R, H, RQ, K),
            (R, H, RQ, 2, K), (R,), (B, T, H, K)]


def operand_dtypes(conv_dtype: str, norm_dtype: str):
    """Element types in launch order, by numpy dtype name."""
    return (["bfloat16"] * 4 + ["int32"] * 2 + [conv_dtype] * 2 + ["float32"] * 2
            + ["bfloat16", norm_dtype, "float32", "bfloat16", "float32", "bfloat16",
               "int32", "bfloat16"])


@functools.lru_cache(maxsize=None)
def compile_verify(config: KdaConfig, split: int, has_bias: bool, conv_dtype: str,
                   norm_dtype: str, options: str = "", timeline: bool = False,
                   solo: bool = False):
    """The kernel compiled for symbolic B, S, R (one binary for every batch and cache
    size): call it as (stream, *operands) with `operand_shapes`' order (conv_bias None
    when has_bias is False), then, for the timeline build, the [CTAs, STAMPS] int64
    stamps. solo: as `verify_kernel`'s (a launch shape, so the caller picks it per batch)."""
    return compile_kernel(verify_kernel(config, split, has_bias, timeline, solo), config,
                          has_bias, conv_dtype, norm_dtype, options, timeline)


def compile_kernel(kernel, config: KdaConfig, has_bias: bool, conv_dtype: str,
                   norm_dtype: str, options: str = "", timeline: bool = False):
    """`compile_verify` for a given kernel object (another build of FusedVerify, as
    tests/gpu_compare.py times against this one)."""
    B, S, R = (cute.sym_int() for _ in range(3))
    shapes = operand_shapes(config, B, S, R)
    dtypes = operand_dtypes(conv_dtype, norm_dtype)
    if timeline:
        shapes, dtypes = shapes + [(cute.sym_int(), STAMPS)], dtypes + ["int64"]
    fakes = [
        make_fake_compact_tensor(DTYPES[dtype], shape,
                                 stride_order=tuple(reversed(range(len(shape)))),
                                 assumed_align=16)
        for shape, dtype in zip(shapes, dtypes)
    ]
    if not has_bias:
        fakes[7] = None
    return cute.compile(kernel, make_fake_stream(), *fakes, options=options)
