"""`cutedsl_chunk_states`: the prompt's scan over chunks (`jax_kda.kernels.chunk_states`)
as a custom call: a primitive whose CUDA lowering compiles the kernel once per chunk
size for symbolic B, H and chunk count (one binary for every prompt and batch, also
under `jax.export` on a machine without a GPU) and runs it through CuTe DSL's FFI
target; on any other platform the lowering raises a clear error."""
from __future__ import annotations

import functools

import jax
import jax.extend
import jax.numpy as jnp

from jax_kda.ffi.call import compile_symbolic, launch_compiled, register_cuda_lowering

chunk_states_p = jax.extend.core.Primitive("jax_kda_chunk_states")
chunk_states_p.multiple_results = True


def cutedsl_chunk_states(state, u_v, w_k, gq, tail, decay, bm):
    """(state after the chunks [B, H, K, K], o [B, H, N, C, K] FP32) from the chunk
    operands of `jax_kda.prompt_chunks.recurrence` (u_v, w_k, gq, tail [B, H, N, C, K],
    decay [B, H, N, K], bm [B, H, N, C, C]) and the starting state, all FP32: the twin
    of `jax_kda.prompt_chunks.scan_chunks`."""
    if 0 in w_k.shape[:3]:  # no request or no chunk: nothing to launch
        return state, jnp.zeros(w_k.shape, jnp.float32)
    o, state = chunk_states_p.bind(u_v, w_k, gq, tail, decay, bm, state)
    return state, o


@chunk_states_p.def_abstract_eval
def _abstract(u_v, w_k, gq, tail, decay, bm, state):
    return [w_k, state]  # o has w_k's type, the state after the chunks the state's


def _cuda_lowering(u_v, w_k, gq, tail, decay, bm, state):
    outputs = (jax.ShapeDtypeStruct(w_k.shape, jnp.float32),
               jax.ShapeDtypeStruct(state.shape, jnp.float32))
    return launch_compiled(_compiled(w_k.shape[3]), (u_v, w_k, gq, tail, decay, bm, state),
                           outputs, {})


register_cuda_lowering(chunk_states_p, _cuda_lowering, "prefill")


@functools.lru_cache(maxsize=None)
def _compiled(chunk):
    """ChunkStates(chunk) compiled for symbolic B, H and N."""
    from jax_kda.kernels.chunk_states import ChunkStates

    kernel = ChunkStates(chunk)
    inputs, outputs = (tuple(jax.ShapeDtypeStruct(shape, jnp.float32) for shape in shapes)
                       for shapes in kernel.shapes(*jax.export.symbolic_shape("B, H, N")))
    return compile_symbolic(kernel, inputs, outputs, (True,) * len(inputs), {},
                            compile_key=("chunk_states", chunk))
