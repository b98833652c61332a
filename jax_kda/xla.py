"""The XLA backend (`backend="jax"`): the recurrences in WY form that the step drivers
(`jax_kda.steps`) run on any device: the verify's closed-form replay and chunked verify
(`jax_kda.wy`), and the prompt's chunks (`jax_kda.prompt_chunks`), whose two stages the
prefill's kernels can take over (`jax_kda.backends`)."""
from __future__ import annotations

import functools

import jax

from jax_kda import prompt_chunks, wy
from jax_kda.cache_rows import Replay
from jax_kda.config import KdaConfig
from jax_kda.layer import Prompt, token_vectors
from jax_kda.pytrees import KdaCache, KdaParams, VerifyInputs
from jax_kda.steps import verify_step


def verify_recurrence(state, replay: Replay, tokens):
    """Closed-form replay, then the chunked verify from S_n: (S_n, u, o)."""
    state_n = wy.replay(state, *replay)
    u, o = wy.verify(state_n, tokens.q, tokens.k, tokens.v, tokens.beta, tokens.d,
                     tokens.parents)
    return state_n, u, o


@functools.partial(jax.jit, static_argnames="config")
def xla_verify(params: KdaParams, cache: KdaCache, inputs: VerifyInputs, layer=None, *,
               config: KdaConfig):
    """`fused_verify`'s "jax" backend on checked arguments: (out [B, T, H, K] bf16,
    cache). layer: the int32 layer of stacked params and cache, or None."""
    return verify_step(params, cache, inputs, config, layer, verify_recurrence)


def chunk_operands(params: KdaParams, prompt: Prompt, config: KdaConfig):
    """The prompt's chunk operands in XLA (`prompt_chunks.chunk_operands`)."""
    return prompt_chunks.chunk_operands(*token_vectors(params, prompt, config),
                                        lower_bound=config.lower_bound)


def prompt_recurrence(state, replay: Replay, params: KdaParams, prompt: Prompt,
                      config: KdaConfig, *, operands=chunk_operands,
                      scan=prompt_chunks.scan_chunks):
    """The kept records folded in closed form, then the prompt in chunks of dense
    products: (state after it, o [B, H, P, K] bf16 values). operands(params, prompt,
    config) and scan: the two stages, XLA's or their kernels'."""
    state = wy.replay(state, replay.u, replay.kn, replay.d)
    P = prompt.beta.shape[1]
    return prompt_chunks.through_chunks(state, operands(params, prompt, config), prompt.lengths,
                                        P, scan=scan)
