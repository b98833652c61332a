"""The kernels' custom calls compiled and emitted: the one module that uses CuTe DSL's
private JAX internals (`cutlass.jax.compile`, `cutlass.jax.types`, `cutlass.jax.ffi`) and
its runtime arch.

The public `cutlass.jax.cutlass_call` is not enough, for three reasons:
- it compiles at lowering for the shapes it is lowered at (one binary per batch, cache,
  layer count and prompt); `for_xla` compiles a kernel's signature for symbolic sizes
  (B, S, R, L; B, P, H, N), so one binary serves them all, also under `jax.export`;
- its abstract evaluation returns plain shapes, so its outputs lose their operands'
  types (sharding, `shard_map`'s varying axes); each primitive here types its outputs
  as operands of theirs (a cache buffer as the one it aliases);
- its lowering is registered for the CUDA platform alone; `register_cuda_lowering` lowers
  the call wherever CUDA is among a program's platforms (an export for ["cuda", "cpu"]
  too) and raises an error naming the entry point where it is not.
The aliases (cache buffers written in place) come from the kernel's signature, counted
among the operands that are there (an absent optional operand takes no buffer). With
`jax_kda.enable_compile_cache` on, a kernel's binary is read back from disk where an
earlier process built it (`binary_key`). `kernels_called` names the kernels a traced
program launches, and `binary` compiles one without the cache: `jax_kda.compile_kernels`
compiles a program's kernels in parallel processes with them.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib

import jax
import jax.extend
from jax.interpreters import mlir

from jax_kda import compile_cache


def among_present(aliases, present) -> dict:
    """{input: output} aliases with the inputs counted among the present ones only."""
    position = {i: sum(present[:i]) for i in range(len(present)) if present[i]}
    return {position[i]: o for i, o in aliases}


def for_xla(kernel, arch: str, options: str):
    """The binding of `jax_kda.kernels.compile.compiled` for the custom call: `kernel`
    compiled for `arch` (which `options` names) and XLA's FFI (CuTe DSL's call target),
    on its signature at symbolic sizes, row-major buffers: its object file, read from
    the compile cache where it holds one (`binary_key`)."""
    from cutlass.jax.compile import CompileResult

    spec = _function_spec(kernel, options)
    module = compile_cache.stored(binary_key(kernel, arch, options),
                                  lambda: _object_file(kernel, spec, arch))
    return CompileResult(module=module, fingerprint=hashlib.sha256(module).digest(), spec=spec)


def binary(kernel, arch: str, options: str) -> tuple[str, bytes]:
    """The binding that compiles `for_xla`'s object file without the compile cache:
    (its `binary_key`, its bytes), as `jax_kda.compile_kernels`' processes return it."""
    return (binary_key(kernel, arch, options),
            _object_file(kernel, _function_spec(kernel, options), arch))


def binary_key(kernel, arch: str, options: str) -> str:
    """What a kernel's binary depends on: its class and compile-time values
    (`Kernel.key`), the compile options (the arch among them), the DSL's version and
    compile-affecting settings (the GPU arch and the CUDA libraries among them) and
    jax_kda's source."""
    import cutlass

    kind = type(kernel)
    with _compiling_for(arch) as envar:
        settings = envar.cache_key_str()
    return repr((f"{kind.__module__}.{kind.__qualname__}", kernel.key(), options,
                 cutlass.__version__, settings, compile_cache.source_digest()))


def _function_spec(kernel, options: str):
    """CuTe DSL's spec of the custom call of `kernel`'s signature at symbolic sizes:
    the present inputs, the outputs, the aliases (cache buffers written in place)."""
    from cutlass.jax.compile import Arg, FunctionSpec
    from cutlass.jax.types import default_tensor_spec

    signature = kernel.signature(*jax.export.symbolic_shape(", ".join(kernel.dims)))
    present = tuple(operand is not None for operand in signature.inputs)
    args = [Arg(i, shape, dtype, default_tensor_spec(shape))
            for i, (shape, dtype) in enumerate(
                [operand for operand in signature.inputs if operand is not None]
                + list(signature.outputs))]
    in_args, out_args = tuple(args[:sum(present)]), tuple(args[sum(present):])
    out_args = tuple(dataclasses.replace(a, idx=j) for j, a in enumerate(out_args))
    aliases = among_present(signature.aliases, present)
    kernel_outputs = [j for j in range(len(out_args)) if j not in aliases.values()]
    return FunctionSpec(
        in_args=in_args,
        input_tree=jax.tree.structure(tuple(0 if there else None for there in present)),
        out_args=out_args,
        output_tree=jax.tree.structure(tuple(kernel_outputs)),
        input_output_aliases=tuple(sorted(aliases.items())),
        input_spec=tuple(a.spec for a in in_args),
        output_spec=tuple(a.spec for a in out_args),
        compile_options=options, use_static_tensors=False, kwargs=())


def _object_file(kernel, spec, arch: str) -> bytes:
    from cutlass.jax.compile import get_or_compile_kernel

    with _compiling_for(arch):
        return get_or_compile_kernel(kernel, spec, compile_key=kernel).module


@contextlib.contextmanager
def _compiling_for(arch: str):
    """CuTe DSL's settings with `arch` as the arch it takes itself to run on: it dumps
    the object file only for that arch (sm_100a on a host without a GPU)."""
    from cutlass.cutlass_dsl.cutlass import CuTeDSL

    envar = CuTeDSL._get_dsl().envar
    runtime = envar._arch
    envar.arch = arch
    try:
        yield envar
    finally:
        envar._arch = runtime


_KERNELS = {}  # primitive: kernel_of, the kernel its custom call launches


def launch(kernel, arrays, outputs):
    """The FFI call of `kernel` (compiled once by `for_xla`) on the present input
    `arrays`, with `outputs` (ShapeDtypeStructs); the aliased outputs are written in
    place of their inputs."""
    from cutlass.jax.ffi import _register_and_get_default_ffi_call_target

    from jax_kda.kernels import compiled

    binary = compiled(kernel, binding=for_xla)
    call = jax.ffi.ffi_call(_register_and_get_default_ffi_call_target(True),
                            result_shape_dtypes=outputs,
                            input_output_aliases=dict(binary.spec.input_output_aliases))
    return call(*arrays, module=binary.module, key=binary.fingerprint)


def register_cuda_lowering(primitive, kernel_of, outputs_of, call):
    """Lowers `primitive` to the custom call of kernel_of(*operands, **params) with the
    outputs outputs_of(*operands, **params) (ShapeDtypeStructs), wherever the program is
    lowered for CUDA, beside other platforms too, and to a ValueError that names `call`
    where it is lowered for no CUDA at all. In a program for several platforms
    `backend="auto"` reaches the call on CUDA only (its branch of
    `jax.lax.platform_dependent`); an explicit "cutedsl" fails to compile elsewhere.
    `kernels_called` finds the call's kernel by the same kernel_of."""
    _KERNELS[primitive] = kernel_of

    def cuda_lowering(*arrays, **params):
        return launch(kernel_of(*arrays, **params), arrays, outputs_of(*arrays, **params))

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


def kernels_called(program) -> set:
    """The kernels that the custom calls of `program` (a jaxpr, closed or not) launch,
    in the jaxprs inside its equations too (jit, scan, cond, shard_map, ...): every
    platform's branch."""
    found = set()
    for jaxpr in _jaxprs(program):
        for eqn in jaxpr.eqns:
            if eqn.primitive in _KERNELS:
                found.add(_KERNELS[eqn.primitive](*(v.aval for v in eqn.invars),
                                                  **eqn.params))
            for value in eqn.params.values():
                found |= kernels_called(value)
    return found


def _jaxprs(value):
    """The jaxprs in a parameter's value: itself, or those in a tuple or list."""
    if isinstance(value, jax.extend.core.ClosedJaxpr):
        yield value.jaxpr
    elif isinstance(value, jax.extend.core.Jaxpr):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _jaxprs(item)
