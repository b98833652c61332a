"""CuTe DSL kernels for Hopper (sm_90a). Importing this package needs nvidia-cutlass-dsl.

The fused verify (`FusedVerify`, its shared memory and addresses in `fused_layout`) and
the prefill's three kernels: the prompt's convolution (`PromptConvolution`), the chunks'
operands (`ChunkOperands`) and the scan over chunks (`ChunkStates`). Each kernel object
is its compile key and gives its operands at symbolic sizes (`signature`: B, S, R, L for
the verify, B, P, H and N for the prefill's); `compiled(kernel)` compiles it once for
every size (`jax_kda.kernels.compile`), and `compile_verify` the verify of a
configuration, as the eager DLPack path and the compile table (`python -m
jax_kda.kernels`) run them. The custom calls compile the same signatures for XLA
(`jax_kda.ffi.lowering`).
"""
from __future__ import annotations

try:
    import cutlass  # noqa: F401
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError("jax_kda.kernels needs CuTe DSL: pip install 'nvidia-cutlass-dsl>=4.8,<4.9'"
                      ) from error

from jax_kda.config import KdaConfig
from jax_kda.kernels.chunk_operands import ChunkOperands
from jax_kda.kernels.chunk_states import ChunkStates
from jax_kda.kernels.compile import ARCH, compiled
from jax_kda.kernels.fused import STAMPS, FusedVerify
from jax_kda.kernels.fused_layout import FusedLayout
from jax_kda.kernels.prompt_conv import PromptConvolution

__all__ = ["ARCH", "STAMPS", "ChunkOperands", "ChunkStates", "FusedLayout", "FusedVerify",
           "PromptConvolution", "compile_verify", "compiled"]


def compile_verify(config: KdaConfig, split: int, has_bias: bool, conv_dtype: str,
                   norm_dtype: str, options: str = "", timeline: bool = False,
                   solo: bool = False, stacked: bool = False):
    """The verify kernel of these values (`FusedVerify`'s) compiled for symbolic B, S, R,
    L (one binary for every batch, cache and layer count): call it as (stream,
    *operands) in `jax_kda.kernel_abi`'s order (None for an operand the build takes not),
    then, for the timeline build, the [CTAs, STAMPS] int64 stamps."""
    return compiled(FusedVerify(config, split, has_bias, conv_dtype=conv_dtype,
                                norm_dtype=norm_dtype, timeline=timeline, solo=solo,
                                stacked=stacked), options)
