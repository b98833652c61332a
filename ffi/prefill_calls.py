"""The prefill's three kernels as custom calls: `cutedsl_prompt_conv` (the
convolution and SiLU, `jax_kda.kernels.prompt_conv`), `cutedsl_chunk_operands` (the
chunks' operands, `jax_kda.kernels.chunk_operands`) and `cutedsl_chunk_states` (the
scan over chunks, `jax_kda.kernels.chunk_states`). Each is a primitive whose CUDA
lowering compiles its kernel once per configuration for symbolic sizes (one binary for
every prompt and batch, also under `jax.export` on a machine without a GPU) and runs it
through CuTe DSL's FFI target (`jax_kda.ffi.lowering`); on any other platform the
lowering raises a clear error."""
from __future__ import annotations

import jax
import jax.extend
import jax.numpy as jnp

from jax_kda.config import K
from jax_kda.ffi import lowering
from jax_kda.prompt_chunks import CHUNK, Operands

prompt_conv_p = jax.extend.core.Primitive("jax_kda_prompt_conv")
prompt_conv_p.multiple_results = True
chunk_operands_p = jax.extend.core.Primitive("jax_kda_chunk_operands")
chunk_operands_p.multiple_results = True
chunk_states_p = jax.extend.core.Primitive("jax_kda_chunk_states")
chunk_states_p.multiple_results = True


def cutedsl_prompt_conv(x, history, weight, bias):
    """`jax_kda.layer.convolve` of a prompt in one pass: x [B, P, 3, H, K] bf16 (the raw
    q, k, v), history [B, 3, 3, H, K] bf16 values (part, position: `rows.read_history`),
    a layer's conv weight [3, 4, H, K] and bias [3, H, K] or None; returns y
    [B, P, 3, H, K] bf16."""
    B, P = x.shape[:2]
    if 0 in (B, P):  # nothing to launch
        return jnp.zeros(x.shape, jnp.bfloat16)
    bias = jnp.zeros(weight.shape[:1] + weight.shape[2:]) if bias is None else bias
    (y,) = prompt_conv_p.bind(
        x.astype(jnp.bfloat16), jnp.moveaxis(history, 2, 1).astype(jnp.bfloat16),
        jnp.swapaxes(weight, 0, 1).astype(jnp.float32), bias.astype(jnp.float32))
    return y


@prompt_conv_p.def_abstract_eval
def _conv_abstract(x, history, weight, bias):
    return [x]  # y has x's shape, dtype and type


def _conv_kernel(*operands):
    from jax_kda.kernels import PromptConvolution

    return PromptConvolution()


lowering.register_cuda_lowering(
    prompt_conv_p, _conv_kernel,
    lambda x, *_: [jax.ShapeDtypeStruct(x.shape, jnp.bfloat16)], "prefill")


def cutedsl_chunk_operands(y, raw_g, beta, lengths, a_log, dt_bias, *, lower_bound: float,
                           scale: float) -> Operands:
    """The chunk operands of `jax_kda.prompt_chunks.chunk_operands` (chunks of CHUNK
    tokens, identities past each length), straight from the layer's token-major
    tensors: y [B, P, 3, H, K] (`layer.convolve`) and raw_g [B, P, H, K]
    (`layer.gate_projection`), bf16 values, beta [B, P, H] bf16 logits, lengths [B]
    int32 (clamped to [0, P]), a layer's a_log [H] and dt_bias [H, K] (FP32);
    lower_bound and scale: the config's (its query scale)."""
    B, P, _, H, _ = y.shape
    N = -(-P // CHUNK)
    outputs = _operand_outputs(B, H, N)
    if 0 in (B, N):  # nothing to launch: identities
        return Operands(*(jnp.full(o.shape, 1.0 if i == 4 else 0.0, jnp.float32)
                          for i, o in enumerate(outputs)))
    return Operands(*chunk_operands_p.bind(
        y.astype(jnp.bfloat16), raw_g.astype(jnp.bfloat16), beta.astype(jnp.bfloat16),
        lengths.astype(jnp.int32), a_log.astype(jnp.float32), dt_bias.astype(jnp.float32),
        lower_bound=float(lower_bound), scale=float(scale)))


def _operand_outputs(B, H, N):
    tokens = (B, H, N, CHUNK, K)
    return [jax.ShapeDtypeStruct(shape, jnp.float32) for shape in
            (tokens,) * 4 + ((B, H, N, K), (B, H, N, CHUNK, CHUNK))]


@chunk_operands_p.def_abstract_eval
def _operands_abstract(y, *inputs, lower_bound, scale):
    B, P, _, H, _ = y.shape  # the outputs vary over the mesh axes as y does
    return [y.update(shape=o.shape, dtype=o.dtype) for o in
            _operand_outputs(B, H, -(-P // CHUNK))]


def _operands_kernel(*operands, lower_bound, scale):
    from jax_kda.kernels import ChunkOperands

    return ChunkOperands(lower_bound, scale)


def _operands_outputs(y, *inputs, lower_bound, scale):
    B, P, _, H, _ = y.shape
    return _operand_outputs(B, H, -(-P // CHUNK))


lowering.register_cuda_lowering(chunk_operands_p, _operands_kernel, _operands_outputs,
                                "prefill")


def cutedsl_chunk_states(state, u_v, w_k, gq, tail, decay, bm, lengths=None):
    """(state after the chunks [B, H, K, K], o [B, H, N, C, K] FP32) from the chunk
    operands of `jax_kda.prompt_chunks.recurrence` (u_v, w_k, gq, tail [B, H, N, C, K],
    decay [B, H, N, K], bm [B, H, N, C, C]) and the starting state, all FP32, and
    lengths [B] int32 (each request's tokens: its chunks from ceil(length / C) on are
    neither read nor written, o there undefined; None: every chunk): the twin of
    `jax_kda.prompt_chunks.scan_chunks`."""
    B, _, N, C, _ = w_k.shape
    if 0 in (B, N, w_k.shape[1]):  # no request or no chunk: nothing to launch
        return state, jnp.zeros(w_k.shape, jnp.float32)
    lengths = jnp.full((B,), N * C) if lengths is None else lengths
    o, state = chunk_states_p.bind(u_v, w_k, gq, tail, decay, bm, state,
                                   lengths.astype(jnp.int32))
    return state, o


@chunk_states_p.def_abstract_eval
def _states_abstract(u_v, w_k, gq, tail, decay, bm, state, lengths):
    return [w_k, state]  # o has w_k's type, the state after the chunks the state's


def _states_kernel(u_v, w_k, *operands):
    from jax_kda.kernels import ChunkStates

    return ChunkStates(w_k.shape[3])


def _states_outputs(u_v, w_k, gq, tail, decay, bm, state, lengths):
    return (jax.ShapeDtypeStruct(w_k.shape, jnp.float32),
            jax.ShapeDtypeStruct(state.shape, jnp.float32))


lowering.register_cuda_lowering(chunk_states_p, _states_kernel, _states_outputs, "prefill")
