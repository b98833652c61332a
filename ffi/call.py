"""`cutedsl_verify`: the fused kernel as an XLA custom call, with the cache buffers it
writes aliased from inputs to outputs, so that a jitted step that donates the cache
updates them in place.

The call is a primitive of its own. Its CUDA lowering compiles the kernel once per
kernel configuration (`verify_kernel`'s object) for symbolic B, S, R and L: one binary
serves every batch, cache and layer count, and a new batch size lowers without a
compile. CuTe DSL compiles for sm_90a during lowering, also under `jax.export` on a
machine without a GPU. The binary runs through CuTe DSL's FFI target for JAX (the one
`cutlass.jax.cutlass_call` uses, which XLA may record in its command buffers). A
program lowered for no CUDA platform raises a clear error.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.extend
import jax.numpy as jnp
from jax.interpreters import mlir

from jax_kda import operands
from jax_kda.config import K, KdaConfig
from jax_kda.ffi.launch import kernel_split, solo_ctas
from jax_kda.pytrees import KdaCache, KdaParams, VerifyInputs

verify_p = jax.extend.core.Primitive("jax_kda_verify")
verify_p.multiple_results = True
GATE = [op.name for op in operands.INPUTS].index("gate")
OUT = [op.name for op in operands.OUTPUTS].index("out")


def cutedsl_verify(params: KdaParams, cache: KdaCache, inputs: VerifyInputs, layer=None, *,
                   config: KdaConfig):
    """The fused CuTe DSL verify on checked arguments (`fused_verify` checks them):
    (out [B, T, H, K] bf16, cache). layer: the int32 layer of stacked params and
    cache, or None. config.split None picks the split with `kernel_split`."""
    from jax_kda.kernels import verify_kernel

    B = inputs.slots.shape[0]
    split = kernel_split(config, B)
    kernel = verify_kernel(dataclasses.replace(config, split=split), split,
                           has_bias=params.conv_bias is not None,
                           solo=solo_ctas(config, B, split), stacked=layer is not None)
    layer = None if layer is None else jnp.reshape(layer, (1,))
    arrays = [a for a, op in zip(operands.values(params, cache, inputs, layer),
                                 operands.OPERANDS) if op.access != operands.WRITE]
    present = tuple(a is not None for a in arrays)
    out = jax.ShapeDtypeStruct((B, config.tokens, config.heads, K), jnp.bfloat16)
    outputs = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in operands.values(
        None, cache, None, None, out, only=operands.OUTPUTS))
    results = _call(*[a for a in arrays if a is not None], kernel=kernel, present=present,
                    outputs=outputs)
    return results[0], KdaCache(*results[1:])


@functools.partial(jax.jit, static_argnames=("kernel", "present", "outputs"))
def _call(*arrays, kernel, present, outputs):
    return verify_p.bind(*arrays, kernel=kernel, present=present, outputs=outputs)


@verify_p.def_abstract_eval
def _abstract(*arrays, kernel, present, outputs):
    # Each output has the type (sharding and shard_map's varying axes too) of an operand
    # of its shape and dtype: the cache that of the buffer it aliases, out [B, T, H, K]
    # bf16 that of gate.
    source = {o: i for i, o in _aliases(present).items()}
    source[OUT] = sum(present[:GATE])
    return [arrays[source[o]] for o in range(len(outputs))]


def _aliases(present):
    """ALIASES with positions among the present operands only."""
    position = {i: sum(present[:i]) for i in range(len(present)) if present[i]}
    return {position[i]: o for i, o in operands.ALIASES.items()}


def _cuda_lowering(*arrays, kernel, present, outputs):
    compiled = compiled_call(kernel, present, tuple(jnp.dtype(a.dtype).name for a in arrays))
    return launch_compiled(compiled, arrays, outputs, _aliases(present))


def launch_compiled(compiled, arrays, outputs, aliases):
    """The FFI call of a kernel that `get_or_compile_kernel` compiled, on `arrays`, with
    `outputs` (ShapeDtypeStructs) and {operand: output} aliases."""
    from cutlass.jax.ffi import _register_and_get_default_ffi_call_target

    call = jax.ffi.ffi_call(_register_and_get_default_ffi_call_target(True),
                            result_shape_dtypes=outputs, input_output_aliases=aliases)
    return call(*arrays, module=compiled.module, key=compiled.fingerprint)


def register_cuda_lowering(primitive, cuda_lowering, call):
    """`cuda_lowering` (a function of the operands and params, as `mlir.lower_fun` takes
    it) wherever the program is lowered for CUDA, beside other platforms too, and a
    ValueError that names `call` where it is lowered for no CUDA at all. In a program
    for several platforms `backend="auto"` reaches the call on CUDA only (its branch of
    `jax.lax.platform_dependent`); an explicit "cutedsl" fails to compile elsewhere."""
    lowered = mlir.lower_fun(cuda_lowering, multiple_results=True)

    def lowering(ctx, *arrays, **params):
        platforms = tuple(ctx.platforms or ctx.module_context.platforms)
        if "cuda" not in platforms:
            raise ValueError(
                f"{call} backend='cutedsl': the CuTe DSL kernel runs on CUDA GPUs of compute "
                f"capability >= 9.0, and this program is lowered for {platforms}; use "
                f"backend='auto' or backend='jax'")
        return lowered(ctx, *arrays, **params)

    mlir.register_lowering(primitive, lowering)


register_cuda_lowering(verify_p, _cuda_lowering, "fused_verify")


@functools.lru_cache(maxsize=None)
def compiled_call(kernel, present, dtypes):
    """The kernel compiled for the FFI call: B, S, R and L symbolic, so that one binary
    serves every batch, cache and layer count. present: which operands are there (the
    optional ones may not be); dtypes: the present operands' dtype names."""
    B, S, R, L = jax.export.symbolic_shape("B, S, R, L")
    sizes = operands.sizes_of(kernel.config, B, S, R, L)
    inputs = [op for op, there in zip(operands.INPUTS, present) if there]
    own = dict(zip((op.name for op in inputs), dtypes))
    shaped = ([jax.ShapeDtypeStruct(operands.shape(op, sizes, kernel.stacked), own[op.name])
               for op in inputs]
              + [jax.ShapeDtypeStruct(operands.shape(op, sizes, kernel.stacked),
                                      own.get(op.name, op.dtype)) for op in operands.OUTPUTS])
    return compile_symbolic(kernel, shaped[:len(inputs)], shaped[len(inputs):], present,
                            _aliases(present), compile_key=kernel)


def compile_symbolic(kernel, inputs, outputs, present, aliases, compile_key):
    """`kernel` (a CuTe DSL callable (stream, *inputs, *outputs)) compiled once for the
    ShapeDtypeStructs `inputs` and `outputs`, whose shapes may be symbolic
    (`jax.export.symbolic_shape`): one binary for every size of those dimensions.
    present: which of the call's inputs are there (None-able ones may not be); aliases:
    {input position among the present: output}, outputs written in place."""
    from cutlass.jax.compile import Arg, FunctionSpec, get_or_compile_kernel
    from cutlass.jax.types import default_tensor_spec

    args = [Arg(i, s.shape, s.dtype, default_tensor_spec(s))
            for i, s in enumerate(list(inputs) + list(outputs))]
    in_args, out_args = tuple(args[:len(inputs)]), tuple(args[len(inputs):])
    out_args = tuple(dataclasses.replace(a, idx=j) for j, a in enumerate(out_args))
    kernel_outputs = [j for j in range(len(out_args)) if j not in aliases.values()]
    spec = FunctionSpec(
        in_args=in_args,
        input_tree=jax.tree.structure(tuple(0 if there else None for there in present)),
        out_args=out_args,
        output_tree=jax.tree.structure(tuple(kernel_outputs)),
        input_output_aliases=tuple(sorted(aliases.items())),
        input_spec=tuple(a.spec for a in in_args),
        output_spec=tuple(a.spec for a in out_args),
        compile_options=None, use_static_tensors=False, kwargs=())
    return get_or_compile_kernel(kernel, spec, compile_key=compile_key)
