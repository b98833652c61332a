"""`cutedsl_verify`: the fused kernel as an XLA custom call, with the cache buffers it
writes aliased from inputs to outputs, so that a jitted step that donates the cache
updates them in place.

The call is a primitive of its own. Its CUDA lowering compiles the kernel once per
kernel configuration (a `FusedVerify`, the compile key) for symbolic B, S, R and L:
one binary serves every batch, cache and layer count, and a new batch size lowers
without a compile (`jax_kda.ffi.lowering`). CuTe DSL compiles for sm_90a during
lowering, also under `jax.export` on a machine without a GPU. The binary runs through
CuTe DSL's FFI target for JAX (the one `cutlass.jax.cutlass_call` uses, which XLA may
record in its command buffers). A program lowered for no CUDA platform raises a clear
error.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.extend
import jax.numpy as jnp

from jax_kda import kernel_abi
from jax_kda.config import K, KdaConfig
from jax_kda.ffi import lowering
from jax_kda.pytrees import KdaCache, KdaParams, VerifyInputs
from jax_kda.tree import node_parents

verify_p = jax.extend.core.Primitive("jax_kda_verify")
verify_p.multiple_results = True
GATE = [op.name for op in kernel_abi.INPUTS].index("gate")
OUT = [op.name for op in kernel_abi.OUTPUTS].index("out")


def cutedsl_verify(params: KdaParams, cache: KdaCache, inputs: VerifyInputs, layer=None, *,
                   config: KdaConfig, split: int, solo: bool):
    """The fused CuTe DSL verify on checked arguments (`fused_verify` checks them):
    (out [B, T, H, K] bf16, cache). layer: the int32 layer of stacked params and
    cache, or None. split, solo: the launch the plan chose (`jax_kda.backends`): CTAs
    per (request, head), and whether each CTA takes an SM of its own."""
    from jax_kda.kernels import FusedVerify

    B = inputs.slots.shape[0]
    if config.trees and inputs.parents is None:  # the chain, as a tree build reads it
        chain = jnp.broadcast_to(node_parents(None, config.tokens), (B, config.tokens))
        inputs = dataclasses.replace(inputs, parents=chain)
    kernel = FusedVerify(dataclasses.replace(config, split=split), split,
                         has_bias=params.conv_bias is not None,
                         conv_dtype=jnp.dtype(params.conv_weight.dtype).name,
                         norm_dtype=jnp.dtype(params.norm_weight.dtype).name, solo=solo,
                         stacked=layer is not None)
    layer = None if layer is None else jnp.reshape(layer, (1,))
    arrays = [a for a, op in zip(kernel_abi.values(params, cache, inputs, layer),
                                 kernel_abi.OPERANDS) if op.access != kernel_abi.WRITE]
    out = jax.ShapeDtypeStruct((B, config.tokens, config.heads, K), jnp.bfloat16)
    outputs = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in kernel_abi.values(
        None, cache, None, None, out, only=kernel_abi.OUTPUTS) if a is not None)
    results = _call(*[a for a in arrays if a is not None], kernel=kernel, outputs=outputs)
    return results[0], KdaCache(*results[1:])


@functools.partial(jax.jit, static_argnames=("kernel", "outputs"))
def _call(*arrays, kernel, outputs):
    return verify_p.bind(*arrays, kernel=kernel, outputs=outputs)


@verify_p.def_abstract_eval
def _abstract(*arrays, kernel, outputs):
    # Each output has the type (sharding and shard_map's varying axes too) of an operand
    # of its shape and dtype: the cache that of the buffer it aliases, out [B, T, H, K]
    # bf16 that of gate.
    present = [kernel_abi.present(op, kernel.has_bias, kernel.stacked, kernel.trees)
               for op in kernel_abi.INPUTS]
    aliases = kernel_abi.aliases(kernel.has_bias, kernel.stacked, kernel.trees)
    source = {o: i for i, o in lowering.among_present(aliases.items(), present).items()}
    source[OUT] = sum(present[:GATE])
    return [arrays[source[o]] for o in range(len(outputs))]


lowering.register_cuda_lowering(verify_p, lambda *arrays, kernel, outputs: kernel,
                                lambda *arrays, kernel, outputs: list(outputs),
                                "fused_verify")
