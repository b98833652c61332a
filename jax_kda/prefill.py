"""Prefill: the KDA layer over whole prompts or pieces of them, leaving each request's
cache exactly as its first verify expects (docs/spec.md, "Prefill": checkpoint, window
at positions 0..2, pending 0).

A prompt starts from a zero state and zero conv history; a later piece of it resumes
from the request's cache: the checkpoint with its kept records folded in, as a verify
replays them, and the window's history. The recurrence runs in chunks of dense matrix
products (`jax_kda.prompt_chunks`). Tokens past a piece's length are identities
(decay 1, beta 0, hence u = 0) and their outputs are zero.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jax_kda import chunked, prompt_chunks
from jax_kda.config import CONV_TAPS, K, KdaConfig
from jax_kda.layer import gate_projection, gated_rmsnorm
from jax_kda.partitioning import per_head
from jax_kda.pytrees import KdaCache, KdaParams, PrefillInputs
from jax_kda.rows import (Replay, convolved, layer_of, locate, normalized, pad_rows,
                          read_history, read_replay, read_state, two_rows, write,
                          write_pending)
from jax_kda.transforms import request_batched
from jax_kda.validate import (BF16, BOOL, check_cache, check_layer, check_params,
                              check_rows, expect, typed)
from jax_kda.verify import BACKENDS, kernel_available, on_cuda


def check_prefill(params: KdaParams, cache: KdaCache, inputs: PrefillInputs,
                  config: KdaConfig, layer=None):
    """Trace-time check of every argument of a prefill; returns the int32 layer of a
    stacked call (None otherwise)."""
    stacked = layer is not None
    _, _, L = check_cache(cache, config, stacked)
    check_params(params, config, L if stacked else False)
    typed("inputs", inputs, PrefillInputs)
    H = config.heads
    sizes = expect("x", inputs.x, [("B", None), ("P", None), (None, 3), ("H", H), (None, K)],
                   (BF16,))
    B, P = sizes["B"], sizes["P"]
    expect("f_a", inputs.f_a, [("B", B), ("P", P), (None, K)], (BF16,))
    expect("beta", inputs.beta, [("B", B), ("P", P), ("H", H)], (BF16,))
    expect("gate", inputs.gate, [("B", B), ("P", P), ("H", H), (None, K)], (BF16,))
    for name in ("lengths", "slots", "record_rows"):
        check_rows(name, getattr(inputs, name), B)
    if inputs.resume is not None:
        expect("resume", inputs.resume, [("B", B)], (BOOL,))
    return check_layer(layer, L) if stacked else None


class Prompt(NamedTuple):
    """A piece's tokens as the layer's pointwise part leaves them, token-major: y
    [B, P, 3, H, K] and raw_g [B, P, H, K] (`rows.convolved`: bf16 values), beta
    [B, P, H] (the logits as given), lengths [B] (clamped to [0, P])."""

    y: jax.Array
    raw_g: jax.Array
    beta: jax.Array
    lengths: jax.Array


def token_vectors(params: KdaParams, prompt: Prompt, config: KdaConfig):
    """(q, k, v, beta, d) of the prompt, [B, H, P, ...] (`rows.normalized`): identity
    tokens past each length, zeroed too so that any padding (even NaN) is inert."""
    tokens = normalized(params, prompt.y, prompt.raw_g, prompt.beta, config)
    B, P = prompt.beta.shape[:2]
    valid = jnp.arange(P)[None, :] < prompt.lengths[:, None]  # [B, P]
    mask = lambda a, fill: jnp.where(valid.reshape(B, 1, P, *(1,) * (a.ndim - 3)), a, fill)
    return (mask(tokens.q, 0.0), mask(tokens.k, 0.0), mask(tokens.v, 0.0),
            mask(tokens.beta, 0.0), mask(tokens.d, 1.0))


def run_prefill(params: KdaParams, cache: KdaCache, inputs: PrefillInputs,
                config: KdaConfig, layer, recurrence, convolution=convolved):
    """The prefill around a recurrence(state, replay, params, prompt, config) -> (final
    state [B, H, K, K], o [B, H, P, K] bf16 values) that folds `replay` (a
    `rows.Replay`) into `state`, then runs the `Prompt`; shared with
    `ref.stock_prefill`. convolution: `rows.convolved` or its twin of the same
    signature (`kernel_convolved`). Returns (out [B, P, H, K] bf16, cache)."""
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


def prompt_recurrence(state, replay: Replay, params: KdaParams, prompt: Prompt,
                      config: KdaConfig, *, backend: str):
    """The kept records folded in closed form, then the prompt in chunks of dense
    products (`prompt_chunks`): on "jax" all in XLA; on "cutedsl" the scan over chunks
    in its kernel, and the chunks' operands in theirs where the lower bound suits it
    (`prompt_chunks.operands_kernel_fits`), else in XLA."""
    state = chunked.replay(state, replay.u, replay.kn, replay.d)
    P = prompt.beta.shape[1]
    if backend == "cutedsl":  # the kernels' calls, imported lazily
        from jax_kda.ffi import cutedsl_chunk_operands, cutedsl_chunk_states

        scan = cutedsl_chunk_states
    else:
        scan = prompt_chunks.scan_chunks
    if backend == "cutedsl" and prompt_chunks.operands_kernel_fits(config.lower_bound):
        operands = cutedsl_chunk_operands(*prompt, params.a_log, params.dt_bias,
                                          lower_bound=config.lower_bound,
                                          scale=config.query_scale)
    else:
        operands = prompt_chunks.chunk_operands(*token_vectors(params, prompt, config),
                                                lower_bound=config.lower_bound)
    return prompt_chunks.recurrence(state, operands, P, scan=scan)


def kernel_convolved(params: KdaParams, x, f_a, history, config: KdaConfig):
    """`rows.convolved` in bf16 arrays for the operands kernel: the convolution by its
    kernel (`jax_kda.kernels.prompt_conv`); in gate_mode 0 the gate projection is the
    bf16 product's own output (FP32 sums in the GPU library's order, rounded once:
    docs/spec.md, "Which path sums how"), in gate_mode 1 `layer.gate_projection`."""
    from jax_kda.ffi import cutedsl_prompt_conv  # the kernel's call, imported lazily

    if config.gate_mode == 0:
        raw_g = jnp.einsum("btr,hfr->bthf", f_a, params.f_b,
                           preferred_element_type=jnp.bfloat16)
    else:
        raw_g = gate_projection(f_a, params.f_b, config.gate_mode).astype(jnp.bfloat16)
    return cutedsl_prompt_conv(x, history, params.conv_weight, params.conv_bias), raw_g


@functools.partial(jax.jit, static_argnames=("config", "backend"))
def _prefill(params, cache, inputs, layer, *, config, backend):
    recurrence = functools.partial(prompt_recurrence, backend=backend)
    kernels = backend == "cutedsl" and prompt_chunks.operands_kernel_fits(config.lower_bound)
    return run_prefill(params, cache, inputs, config, layer, recurrence,
                       kernel_convolved if kernels else convolved)


@functools.lru_cache(maxsize=None)
def _with_backend(backend: str):
    """`_prefill` with its backend bound ("auto": the kernels' on CUDA, XLA's elsewhere),
    one object per backend (a static key of `per_head`'s partitioning, which a new
    object each call would miss)."""
    if backend == "auto":
        return on_cuda(_with_backend("cutedsl"), _with_backend("jax"))
    return functools.partial(_prefill, backend=backend)


@functools.lru_cache(maxsize=None)
def _entry(config: KdaConfig, backend: str):
    """The backend's prefill, split by heads where they are sharded (`per_head`), as
    `transforms.request_batched` runs it: a mapped axis of the inputs folds into the
    batch under `jax.vmap`, differentiation raises."""

    def run(shared, requests):
        return per_head(_with_backend(backend), config, shared["params"], shared["cache"],
                        requests["inputs"], shared["layer"])

    return request_batched("prefill", run, instead="jax_kda.ref.stock_prefill (same signature)")


def _scan_kernel_fits(config: KdaConfig) -> bool:
    """Whether the chunk size suits the scan kernel (a multiple of 16 tokens)."""
    return prompt_chunks.chunk_size(config.lower_bound) % 16 == 0


def prefill(params: KdaParams, cache: KdaCache, inputs: PrefillInputs, config: KdaConfig,
            *, backend: str = "auto", layer=None):
    """Runs the KDA layer over a batch of prompts, or pieces of prompts, and writes each
    request's cache.

    Args:
      params: the layer's weights (`KdaParams`; stacked with `layer`).
      cache: the decode state (`KdaCache`; stacked with `layer`); only the rows of live
        requests change.
      inputs: the prompts (`PrefillInputs`: x [B, P, 3, H, K] bf16, ..., lengths [B],
        resume [B] for the rows that continue a prompt from the cache).
      config: the static `KdaConfig` (its tokens only size the cache's records).
      backend: where the prompt's convolution and chunks run: "cutedsl" (CuTe DSL
        kernels, CUDA GPUs of compute capability >= 9.0: the scan over chunks for chunks
        of a multiple of 16 tokens, and the convolution and the chunks' operands too at
        lower_bound >= about -5.2), "jax" (XLA, any device) or "auto": where the chunks
        suit the scan kernel and `kernel_available()`, the kernels on CUDA and XLA on
        every other platform, chosen when the program is lowered; else "jax". The gate
        projection and gated norm are XLA's either way.
      layer: for stacked params and cache, the layer to run (a Python int or an int32
        scalar, e.g. traced in `lax.scan`); None for one layer's.

    Returns:
      (out [B, P, H, K] bf16, cache): outputs past a prompt's length and of padding rows
      are zero. For each live request, state[slot] is the state after its piece,
      conv[slot][..., 0:3] the last three raw inputs of the prompt so far (zeros before
      a new prompt shorter than three) and pending[record_row] is 0 (the kept records
      folded in); records and the rest of the window are left as they were. A prompt
      prefilled in pieces equals it prefilled at once within FP32 rounding. Inside
      `jax.jit` with the cache donated, the buffers are updated in place. Head-sharded
      arrays: as `fused_verify`.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    layer = check_prefill(params, cache, inputs, config, layer)
    if backend == "auto" and not (kernel_available() and _scan_kernel_fits(config)):
        backend = "jax"
    elif backend == "cutedsl" and not _scan_kernel_fits(config):
        raise ValueError(f"backend='cutedsl': the prefill's chunks of "
                         f"{prompt_chunks.chunk_size(config.lower_bound)} tokens (lower_bound "
                         f"{config.lower_bound}) are not a multiple of 16; use backend='jax'")
    return _entry(config, backend)(dict(params=params, cache=cache, layer=layer),
                                   dict(inputs=inputs))
