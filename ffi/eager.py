"""`eager_verify`: the fused kernel on any DLPack arrays (cupy, torch, jax) on a given
stream, outside XLA: for kernel-level tests, compute-sanitizer runs and benchmarks.

The binary is the one `jax_kda.kernels.compile_verify` builds for symbolic B, S, R and
L: one compile per kernel configuration serves every batch and cache size. Each call
costs about half a millisecond of host work: capture it in a CUDA graph where speed
matters.
"""
from __future__ import annotations

import dataclasses

from jax_kda import kernel_abi
from jax_kda.backends import kernel_takes
from jax_kda.config import KdaConfig
from jax_kda.ffi.launch import kernel_split, solo_ctas
from jax_kda.pytrees import KdaCache, KdaParams, VerifyInputs


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
                 config: KdaConfig, *, stream=None, layer=None) -> None:
    """Runs the fused verify on device arrays that support DLPack, in place.

    params, cache, inputs: the usual pytree classes holding cupy / torch / jax GPU
    arrays (C-contiguous, 16-byte aligned). out: [B, T, H, K] bf16, written. The cache
    buffers are updated in place (jax arrays are immutable by contract: pass them only
    if nothing else reads them afterwards). layer: for stacked params and cache, a [1]
    int32 device array holding the layer to run; None for one layer's. stream: None
    (the default stream), an int CUstream handle, or a cupy/torch stream. With
    config.trees, inputs.parents and cache.nodes are required (a chain's parents:
    t - 1). Raises ValueError where the kernel does not run `config`
    (`backends.kernel_takes`).
    """
    from cutlass.cute.runtime import from_dlpack

    from jax_kda.kernels import compile_verify

    kernel_takes(config)
    handle = _stream_handle(stream)
    arrays = kernel_abi.values(params, cache, inputs, layer, out)
    named = dict(zip(kernel_abi.NAMES, arrays))
    stacked = layer is not None
    lead = 1 if stacked else 0
    B, S, R = (len(named["slots"]), named["state"].shape[lead],
               named["pending"].shape[lead])
    sizes = kernel_abi.sizes_of(config, B, S, R, named["state"].shape[0] if stacked else None)
    own = {name: _dtype_name(named[name]) for name in ("conv_weight", "norm_weight")}
    for name, dtype in own.items():
        if dtype not in ("float32", "bfloat16"):
            raise ValueError(f"{name}: expected float32 or bfloat16, got {dtype}")
    own["state"] = config.state_dtype.name  # the config's, which the state must have
    has_bias = named["conv_bias"] is not None
    for op, array in zip(kernel_abi.OPERANDS, arrays):
        if not kernel_abi.present(op, has_bias, stacked, config.trees):
            continue
        if array is None:
            raise ValueError(f"{op.name}: required (config.trees={config.trees}), got None; "
                             f"a tree build's chain is parents t - 1")
        shape, dtype = kernel_abi.shape(op, sizes, stacked), kernel_abi.dtype(op, own)
        if tuple(array.shape) != shape or _dtype_name(array) != dtype:
            raise ValueError(f"{op.name}: expected {list(shape)} {dtype}, "
                             f"got {list(array.shape)} {_dtype_name(array)}")
    split = kernel_split(config, B)
    compiled = compile_verify(dataclasses.replace(config, split=split), split,
                              has_bias, own["conv_weight"],
                              own["norm_weight"], solo=solo_ctas(config, B, split),
                              stacked=stacked)
    tensors = [None if a is None else
               from_dlpack(a, assumed_align=16).mark_layout_dynamic(leading_dim=a.ndim - 1)
               for a in arrays]
    compiled(handle, *tensors)
