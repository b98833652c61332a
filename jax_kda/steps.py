"""The two drivers every JAX path runs around its recurrence: the verify step (docs/spec.md,
steps 0-9) and the prompt step ("Prefill"). Each reads a batch's rows of the cache
(`cache_rows`), prepares its tokens (`layer`), runs the recurrence it is given, applies
the gated RMSNorm and writes the results back. The XLA backend (`jax_kda.xla`) and the
stock reference (`jax_kda.ref`) differ only in the recurrence they plug in; the prefill's
kernels replace stages of it (`jax_kda.backends`). The arguments are checked by the
callers.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jax_kda.cache_rows import (keeps, layer_of, locate, pad_rows, read_history,
                                read_replay, read_state, two_rows, write, write_pending,
                                write_state, write_step)
from jax_kda.config import CONV_TAPS, KdaConfig
from jax_kda.layer import Prompt, convolved, gated_rmsnorm, prepare_tokens
from jax_kda.pytrees import KdaCache, KdaParams, PrefillInputs, VerifyInputs
from jax_kda.tree import node_parents


def verify_step(params: KdaParams, cache: KdaCache, inputs: VerifyInputs, config: KdaConfig,
                layer, recurrence):
    """One verify around `recurrence(S_0, replay, tokens) -> (S_n, u, o)`, o in bf16
    values, each [B, H, ...] (replay: a `cache_rows.Replay`, tokens: a `layer.Tokens`,
    with the tree's parents where inputs.parents is given).
    layer: the int32 layer of stacked params and cache, or None. Returns (out
    [B, T, H, K] bf16, cache)."""
    B = inputs.slots.shape[0]
    inputs = two_rows(inputs)
    rows = locate(cache, inputs.slots, inputs.record_rows, config, layer)
    params = layer_of(params, rows.layer)
    history = read_history(cache, rows)
    parents = None if inputs.parents is None else node_parents(inputs.parents, config.tokens)
    tokens = prepare_tokens(params, inputs.x, inputs.f_a, inputs.beta, history, config,
                            parents)
    state_0 = read_state(cache, rows)
    state_n, u, o = recurrence(state_0, read_replay(params, cache, rows, config), tokens)
    out = gated_rmsnorm(jnp.swapaxes(o, 1, 2), inputs.gate, params.norm_weight, config.eps)
    out = jnp.where(rows.live[:, None, None, None], out, jnp.zeros_like(out))
    keep = keeps(rows, config)
    cache = write_step(cache, rows, inputs.x, history, tokens, u, keep, config)
    return out[:B], dataclasses.replace(
        cache, state=write_state(cache, rows, state_0, state_n, (rows.n > 0) & ~keep))


def prompt_step(params: KdaParams, cache: KdaCache, inputs: PrefillInputs,
                config: KdaConfig, layer, recurrence, convolution=convolved):
    """The prefill around a recurrence(state, replay, params, prompt, config) -> (final
    state [B, H, K, K], o [B, H, P, K] bf16 values) that folds `replay` (a
    `cache_rows.Replay`) into `state`, then runs the `layer.Prompt`. convolution:
    `layer.convolved` or a twin of the same signature (the kernels'). Returns (out
    [B, P, H, K] bf16, cache)."""
    B, P = inputs.x.shape[:2]
    if inputs.resume is None:
        inputs = dataclasses.replace(inputs, resume=jnp.zeros((B,), bool))
    # The cache's rows: a request alone as two (`two_rows`); its prompt is not doubled.
    slots, record_rows, resume = two_rows((inputs.slots, inputs.record_rows, inputs.resume))
    rows = locate(cache, slots, record_rows, config, layer)
    resume = resume & rows.live
    rows = rows._replace(n=jnp.where(resume[:, None], rows.n, 0))  # a new prompt: none
    params = layer_of(params, rows.layer)
    fresh = lambda a: jnp.where(resume.reshape((-1,) + (1,) * (a.ndim - 1)), a, 0.0)[:B]
    history = fresh(read_history(cache, rows))
    lengths = jnp.clip(inputs.lengths, 0, P)
    prompt = Prompt(*convolution(params, inputs.x, inputs.f_a, history, config), inputs.beta,
                    lengths)
    replay = jax.tree.map(lambda a: a[:B], read_replay(params, cache, rows, config))
    state, o = recurrence(fresh(read_state(cache, rows)), replay, params, prompt, config)

    out = gated_rmsnorm(jnp.swapaxes(o, 1, 2), inputs.gate, params.norm_weight, config.eps)
    keep = (jnp.arange(P)[None, :] < lengths[:, None]) & rows.live[:B, None]
    out = jnp.where(keep[:, :, None, None], out, jnp.zeros_like(out))
    # The last three inputs of [history, x]: positions length .. length + 2.
    history_x = jnp.moveaxis(history, 2, 1).astype(inputs.x.dtype)  # [B, 3, 3, H, K]
    padded = jnp.concatenate([history_x, inputs.x], axis=1)
    at = (lengths[:, None] + jnp.arange(CONV_TAPS - 1))[:, :, None, None, None]
    window = jnp.transpose(jnp.take_along_axis(padded, at, axis=1), (0, 2, 3, 4, 1))
    rows_of = lambda a: pad_rows(a, rows.slot.shape[0])
    return out, dataclasses.replace(
        cache,
        state=write(cache.state, rows.layer, rows.slot, rows_of(state)),
        conv=write(cache.conv, rows.layer, (rows.slot, ..., slice(0, CONV_TAPS - 1)),
                   rows_of(window)),
        pending=write_pending(cache, rows, 0),
    )
