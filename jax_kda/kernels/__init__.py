"""CuTe DSL kernels for Hopper (sm_90a). Importing this package needs nvidia-cutlass-dsl.

`verify_kernel(config, split, has_bias)` is the kernel object of one configuration
(the custom call launches it under JAX, `jax_kda.ffi.call`); `compile_verify(...)`
compiles it ahead of time for any batch, slot, record and layer count (symbolic B, S,
R, L), as the eager DLPack path and the compile table (`python -m jax_kda.kernels`)
use it. `compile_prompt_conv()`, `compile_chunk_operands(lower_bound, scale)` and
`compile_chunk_states(chunk)` do the same for the prefill's three kernels: the prompt's
convolution (`jax_kda.kernels.prompt_conv`; symbolic B, prompt length and H), the
chunks' operands (`jax_kda.kernels.chunk_operands`; symbolic B, prompt length, H and
chunk count) and the scan over chunks (`jax_kda.kernels.chunk_states`; symbolic B, H
and chunk count).
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

from jax_kda import operands
from jax_kda.config import KdaConfig
from jax_kda.kernels.chunk_operands import ChunkOperands
from jax_kda.kernels.chunk_states import ChunkStates
from jax_kda.kernels.fused import STAMPS, FusedVerify
from jax_kda.kernels.prompt_conv import PromptConvolution

DTYPES = {"float32": cutlass.Float32, "bfloat16": cutlass.BFloat16, "int32": cutlass.Int32,
          "int64": cutlass.Int64}


@functools.lru_cache(maxsize=None)
def verify_kernel(config: KdaConfig, split: int, has_bias: bool, timeline: bool = False,
                  solo: bool = False, stacked: bool = False) -> FusedVerify:
    """The kernel of `config` with `split` CTAs per (request, head), one object per
    configuration (the custom call's compile key); timeline: the diagnostic build that
    stamps each CTA's phases; solo: each CTA on an SM of its own
    (`jax_kda.ffi.solo_ctas`); stacked: params and cache with a leading layer axis."""
    return FusedVerify(config, split, has_bias, timeline=timeline, solo=solo,
                       stacked=stacked)


@functools.lru_cache(maxsize=None)
def compile_verify(config: KdaConfig, split: int, has_bias: bool, conv_dtype: str,
                   norm_dtype: str, options: str = "", timeline: bool = False,
                   solo: bool = False, stacked: bool = False):
    """The kernel compiled for symbolic B, S, R, L (one binary for every batch, cache and
    layer count): call it as (stream, *operands) in `jax_kda.operands`' order (None for
    an absent conv_bias or layer), then, for the timeline build, the [CTAs, STAMPS] int64
    stamps. solo: as `verify_kernel`'s (a launch shape, so the caller picks it per batch)."""
    return compile_kernel(verify_kernel(config, split, has_bias, timeline, solo, stacked),
                          conv_dtype, norm_dtype, options)


def compile_kernel(kernel: FusedVerify, conv_dtype: str, norm_dtype: str, options: str = ""):
    """`compile_verify` for a given kernel object (another build of FusedVerify too)."""
    sizes = operands.sizes_of(kernel.config, *(cute.sym_int() for _ in range(4)))
    own = {"conv_weight": conv_dtype, "norm_weight": norm_dtype}
    fakes = []
    for op in operands.OPERANDS:
        absent = op.optional and not (kernel.has_bias if op.name == "conv_bias"
                                      else kernel.stacked)
        shape = operands.shape(op, sizes, kernel.stacked)
        fakes.append(None if absent else make_fake_compact_tensor(
            DTYPES[operands.dtype(op, own)], shape,
            stride_order=tuple(reversed(range(len(shape)))), assumed_align=16))
    if kernel.timeline:
        fakes.append(make_fake_compact_tensor(cutlass.Int64, (cute.sym_int(), STAMPS),
                                              stride_order=(1, 0), assumed_align=16))
    return cute.compile(kernel, make_fake_stream(), *fakes, options=options)


def compile_chunk_states(chunk: int, options: str = ""):
    """`ChunkStates(chunk)` compiled for symbolic B, H and N: call it as (stream, u_v,
    w_k, gq, tail, decay, bm, state, o, state_out) (`ChunkStates.shapes`)."""
    kernel = ChunkStates(chunk)
    inputs, outputs = kernel.shapes(*(cute.sym_int() for _ in range(3)))
    return compile_on_shapes(kernel, [(shape, "float32") for shape in inputs + outputs],
                             options)


def compile_chunk_operands(lower_bound: float, scale: float, options: str = ""):
    """`ChunkOperands(lower_bound, scale)` compiled for symbolic B, P, H and N: call it
    as (stream, y, raw_g, beta, lengths, a_log, dt_bias, u_v, w_k, gq, tail, decay, bm)
    (`ChunkOperands.shapes`)."""
    kernel = ChunkOperands(lower_bound, scale)
    inputs, outputs = kernel.shapes(*(cute.sym_int() for _ in range(4)))
    return compile_on_shapes(kernel, inputs + outputs, options)


def compile_prompt_conv(options: str = ""):
    """`PromptConvolution()` compiled for symbolic B, P and H: call it as (stream, x,
    history, weight, bias, y) (`PromptConvolution.shapes`)."""
    kernel = PromptConvolution()
    inputs, outputs = kernel.shapes(*(cute.sym_int() for _ in range(3)))
    return compile_on_shapes(kernel, inputs + outputs, options)


def compile_on_shapes(kernel, operands, options: str = ""):
    """`kernel` compiled on a stream and row-major tensors of (shape, dtype name)."""
    fakes = [make_fake_compact_tensor(DTYPES[dtype], shape,
                                      stride_order=tuple(reversed(range(len(shape)))),
                                      assumed_align=16) for shape, dtype in operands]
    return cute.compile(kernel, make_fake_stream(), *fakes, options=options)
