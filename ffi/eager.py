"""`eager_verify`: the fused kernel on any DLPack arrays (cupy, torch, jax) on a given
stream, outside XLA: for kernel-level tests, compute-sanitizer runs and benchmarks.

The binary is the one `jax_kda.kernels.compile_verify` builds for symbolic B, S, R:
one compile per configuration serves every batch and cache size.
"""
from __future__ import annotations

import dataclasses

from jax_kda.config import KdaConfig
from jax_kda.ffi.call import kernel_split, solo_ctas
from jax_kda.pytrees import KdaCache, KdaParams, VerifyInputs

FIELDS = ("x", "f_a", "beta", "gate", "slots", "record_rows", "conv_weight", "conv_bias",
          "a_log", "dt_bias", "f_b", "norm_weight", "state", "conv", "corrections",
          "key_gates", "pending", "out")


def _stream_handle(stream):
    """A CUstream from None (the default stream), an int handle, or a cupy / torch
    stream object."""
    import cuda.bindings.driver as cuda

    if stream is None:
        return cuda.CUstream(0)
    for attribute in ("cuda_stream", "ptr"):  # torch.cuda.Stream, cupy.cuda.Stream
        if hasattr(stream, attribute):
            return cuda.CUstream(int(getattr(stream, attribute)))
    if isinstance(stream, int):
        return cuda.CUstream(stream)
    raise TypeError(f"stream: expected None, an int handle or a cupy/torch stream, "
                    f"got {type(stream).__name__}")


def _dtype_name(array):
    """numpy-style dtype name of a cupy, torch or jax array."""
    return str(array.dtype).removeprefix("torch.")


def eager_verify(params: KdaParams, cache: KdaCache, inputs: VerifyInputs, out,
                 config: KdaConfig, *, stream=None) -> None:
    """Runs the fused verify on device arrays that support DLPack, in place.

    params, cache, inputs: the usual pytree classes holding cupy / torch / jax GPU
    arrays (C-contiguous, 16-byte aligned). out: [B, T, H, K] bf16, written. The cache
    buffers state, conv, corrections and key_gates are updated in place (jax arrays are
    immutable by contract: pass them only if nothing else reads them afterwards).
    stream: None (the default stream), an int CUstream handle, or a cupy/torch stream.
    """
    from cutlass.cute.runtime import from_dlpack

    from jax_kda.kernels import compile_verify, operand_dtypes, operand_shapes

    handle = _stream_handle(stream)
    arrays = dict(vars(inputs), **vars(params), **vars(cache), out=out)
    has_bias = params.conv_bias is not None
    B, S, R = (len(arrays[name]) for name in ("slots", "state", "pending"))
    conv_dtype, norm_dtype = (_dtype_name(arrays[n]) for n in ("conv_weight", "norm_weight"))
    for name, shape, dtype in zip(FIELDS, operand_shapes(config, B, S, R),
                                  operand_dtypes(conv_dtype, norm_dtype)):
        array = arrays[name]
        if array is None and name == "conv_bias":
            continue
        if tuple(array.shape) != shape or _dtype_name(array) != dtype:
            raise ValueError(f"{name}: expected {list(shape)} {dtype}, "
                             f"got {list(array.shape)} {_dtype_name(array)}")
    if conv_dtype not in ("float32", "bfloat16") or norm_dtype not in ("float32", "bfloat16"):
        raise ValueError(f"conv_weight, norm_weight: expected float32 or bfloat16, got "
                         f"{conv_dtype}, {norm_dtype}")
    split = kernel_split(config, B, has_bias)
    compiled = compile_verify(dataclasses.replace(config, split=split), split, has_bias,
                              conv_dtype, norm_dtype, solo=solo_ctas(config, B, split))
    tensors = [None if arrays[name] is None else
               from_dlpack(arrays[name], assumed_align=16).mark_layout_dynamic(
                   leading_dim=len(arrays[name].shape) - 1)
               for name in FIELDS]
    compiled(handle, *tensors)
