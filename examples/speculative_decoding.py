"""Greedy speculative decoding of a small KDA language model with jax-kda, checked token
for token against plain greedy decoding with the stock per-token recurrence.

The target model: token embeddings, `layers` blocks of (RMSNorm; the KDA layer's inputs
in one matmul and the output gate's low-rank up-projection, `jax_kda.projections`; the
KDA layer; output projection; residual; RMSNorm, SiLU MLP, residual), a final RMSNorm
and an unembedding, laid out as a trained Kimi-Linear layer converts
(`jax_kda.checkpoints`). Weights are bf16 (norms FP32), every matmul accumulates in
FP32, the residual stream is FP32. Weights are random from `--seed` (no downloads), so
the text is meaningless but every number is reproducible on one platform (the draws are
XLA's RngBitGenerator, whose bits a platform may choose).

The draft is the target's bigram: embedding -> final norm -> unembedding, no layers. It
is stateless and cheap, and it agrees with the target only where the layers do not
change the argmax, which gives realistic partial acceptance. `--draft tree` drafts a
token tree instead (`draft_tree`: the bigram's top-1 chain with its top-2 token beside
the chain's first T // 4 levels), verifies it in one step (`VerifyInputs.parents`) and
accepts the longest path whose tokens the target's argmax picks (`accept(...,
path=)`); `--draft both` runs the chain and the tree on the same prompts.

The KDA layers are stacked: their `KdaParams` have a leading [L] axis, and all layers
share one `KdaCache` of `init_cache(..., layers=L)`; each block's other weights are its
own arrays, so that XLA compiles and autotunes one matmul for all layers (a slice of
stacked weights is a program of its own in every layer: docs/performance.md, "Compile
time"). One decode step is a single `jax.jit` with that cache donated: draft T-1 tokens
after each request's last token; run the target on those T tokens, the blocks in a
straight line, each block's KDA layer `jax_kda.fused_verify(params, cache, ...,
layer=i)` on the whole stacked params and cache (i the layer index, nothing sliced or
copied); accept the longest prefix of drafts that the target's argmax agrees with plus
the target's next token; `jax_kda.accept` the count, once for all layers. Requests of
different prompt lengths share the batch; a finished request frees its slot and a
waiting one is prefilled into it (`jax_kda.prefill(..., layer=i)`): a prefill call is
one compiled block, the cache and the residual stream donated, called once a layer on
that layer's weights (its compile flat in L at every row count, no weight stacked or
copied), between the embedding's program and the first tokens'. Empty rows are
padding. A prefill call computes the admitted prompts alone: in a power of two of rows,
or a compiled prefill of up to PREFILL_PADDING times their rows (one compile per row
count, at most log2(batch) + 2), in pieces of at most PREFILL_PIECE tokens packed one
after another: R rows' call computes R * PREFILL_PIECE / PREFILL_PACK positions of the
model around the KDA layers, which take them in rows; a longer prompt, or one cut short
where the call's positions run out, resumes from the cache in the next call
(`PrefillInputs.resume`). `--layer-list` runs the same model the unstacked way for
comparison: per-layer `KdaParams` and a Python list of per-layer caches, one
`fused_verify` and one `accept` per layer.

Everything compiled is kept on disk (`jax_kda.enable_compile_cache`): a second run
compiles nothing and says it started warm; `--no-compile-cache` compiles afresh. On a GPU
the CuTe DSL kernels of the decode step and the prefill compile ahead, in parallel
processes (`jax_kda.compile_kernels`), while the decode step compiles, and so does every
prefill row count, in threads (`--compile-threads`: each runs once on padding rows
before the first call, and a call takes the fewest rows that hold its prompts).

The proof: every generated token must be the token plain greedy decoding picks after
the same prefix, with the whole model run over the sequence and every KDA layer the
stock per-token recurrence (`jax_kda.ref.stock_prefill`, layer by layer on per-layer
caches); by induction over the tokens, that is token-for-token equality with plain
greedy decoding from each prompt. Where greedy decoding's top two logits are within
TIE, the contract's freedom in FP32 summation order can break the tie either way; such
a token is reported as a tie, any other difference as a failure (exit status 1).
`--state-dtype bfloat16` keeps the KDA layers' states in bf16, rounded each time a step
writes them; the proof still scores against the FP32 stock, whose logits those roundings
move too, and counts as ties the tokens within BF16_STATE_TIE.

`--tp N` runs the model tensor-parallel over N devices, Megatron-style: each device
holds H / N heads of every KDA layer (its slices of `KdaParams` and of the cache,
`jax_kda.head_specs`) and the matching columns of the fused input projection (its
heads' q, k, v and beta, beside the gates' low-rank columns, which every device holds),
of the output gate's up-projection and of the MLP's up projection (column-parallel),
and rows of the output and down projections (row-parallel), whose partial sums are
all-reduced: one all-reduce per KDA block and one per MLP block. The prefill's block
and the decode step are one `jax.shard_map` each, the KDA layers called with the
per-device config (`jax_kda.local_config`); the embeddings, norms, the gates' low-rank
activations and the draft are whole on every device. On CPU, give XLA more than N
devices (2N, say): jaxlib's batched LAPACK kernels (the prefill's triangular solves)
wait inside XLA:CPU's thread pool, of a thread per device on a machine of fewer cores,
which N devices waiting at once stall; with N devices the example refuses to start.

The decode loop keeps the device busy: each step is enqueued from the step before's
newest tokens on the device, before the host reads that step's tokens (copied to the
host as soon as they are computed); the host's bookkeeping runs while the device
computes, and a request that ends costs one dropped row of the next step.

On a GPU the decode step is also timed on a full batch: its wall time per step in that
loop against the device's busy time per step from JAX's profiler trace
(`jax_kda.profiling`), the difference being the host's dispatch and waiting; that
batch's prefill is traced too, and both say how much of their GPU time jax-kda's own
kernels took. On every device the step's time is set against its roofline: the bytes of
weights one device reads per step (and the KDA states of a full batch, read and written)
over the copy bandwidth, measured in the same process by a device-to-device copy
(`jax_kda.profiling.copy_bandwidth`) or given by `--copy-bandwidth`.

    python examples/speculative_decoding.py                       # small, CPU, < 1 minute
    python examples/speculative_decoding.py --heads 32 --dim 2304 --batch 32  # Kimi-Linear-like
    XLA_FLAGS=--xla_force_host_platform_device_count=4 python examples/speculative_decoding.py --tp 2
"""
from __future__ import annotations

import argparse
import collections
import concurrent.futures
import dataclasses
import functools
import os
import re
import sys
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_kda
from jax_kda import K, KdaCache, KdaConfig, KdaParams, PrefillInputs, VerifyInputs
from jax_kda.profiling import copy_bandwidth, traced_steps
from jax_kda.projections import (KdaProjections, fuse_inputs, heads_of, input_parts,
                                 layer_inputs, layer_output, project)
from jax_kda.ref import stock_prefill
from jax_kda.testing import random_params

PROGRESS_SECONDS = 5.0  # a progress line at most this often
# Stock logits this close are a tie: the recurrences may order FP32 sums differently
# (docs/spec.md), bf16 roundings amplify that, and top logits (std ~1) were seen to
# differ by up to 2.2e-3 between them on CPU and H200.
TIE = 1e-2
# A bf16 state's roundings move the top logits further from the FP32 stock's than FP32
# rounding differences do (docs/performance.md, "A bf16 state's fidelity"): twice TIE.
BF16_STATE_TIE = 2e-2
TIMED_STEPS = 20  # full-batch decode steps timed on a GPU, in the loop and in the trace
TP_AXIS = "tp"  # the mesh axis of --tp
# JAX's events of a program loaded from its persistent compile cache, and of one compiled
CACHE_EVENTS = ("/jax/compilation_cache/cache_hits", "/jax/compilation_cache/cache_misses")
PREFILL_PIECE = 512  # a prompt's tokens per prefill call; a longer one resumes in the next
# a prefill call of R rows computes R * piece / PREFILL_PACK prompt tokens (a piece at
# least), packed: prompts of uniform lengths fill it on average, and a row cut short resumes
PREFILL_PACK = 2
# a compiled prefill takes as few as 1/4 of its rows in prompts: a compile costs seconds,
# padding rows of a small call milliseconds
PREFILL_PADDING = 4
# XLA compiles a program with Python's lock released, on a few cores: a host with cores to
# spare compiles every prefill row count beside the decode step, one thread per this many
CORES_PER_COMPILE = 4
# the copy bandwidth's copy: far past an accelerator's L2 (60 MB on an H200); smaller on a
# CPU, where it would be most of the example's decode time
COPY_BYTES, CPU_COPY_BYTES = 1 << 30, 1 << 26
COPY_REPS = 3


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Sizes of the toy model (static under jit).

    vocab: tokens in the vocabulary. dim: the residual width D. layers: KDA blocks.
    heads: H heads of K = 128 per KDA layer. tokens: T, tokens per verify (2..16).
    tree: draft a token tree (`draft_tree`) instead of a chain.
    state_dtype: the KDA layers' cached state, "float32" or "bfloat16" (half the bytes).
    residual_gain: scale of each block's output projections, i.e. how far the layers
    move the logits away from the bigram draft's (and so how often drafts are rejected).
    tp_axis: None on one device; inside `jax.shard_map`, the mesh axis whose devices
    hold this config's heads (and MLP columns) each: the row-parallel projections'
    partial sums are all-reduced over it (`shard_config`).
    """

    vocab: int = 512
    dim: int = 256
    layers: int = 2
    heads: int = 2
    tokens: int = 4
    residual_gain: float = 0.25
    tp_axis: str | None = None
    tree: bool = False
    state_dtype: str = "float32"

    @property
    def kda(self) -> KdaConfig:
        return KdaConfig(heads=self.heads, tokens=self.tokens, trees=self.tree,
                         state_dtype=jnp.dtype(self.state_dtype))


class Block(NamedTuple):
    """A block's weights: the KDA layer's projections (from and to the residual width D)
    and its `KdaParams`, then the MLP (width 2D). Stacked, every leaf has a leading
    [L]."""

    norm: jax.Array      # [D] f32
    projections: KdaProjections  # bf16, gate_bias f32
    kda: KdaParams
    mlp_norm: jax.Array  # [D] f32
    w_up: jax.Array      # [D, 2D] bf16
    w_down: jax.Array    # [2D, D] bf16


class Model(NamedTuple):
    """The target's weights; the draft uses embed, final_norm and unembed alone.
    blocks: a tuple of L per-layer `Block`s; kda: the L layers' `KdaParams` stacked, for
    a stacked cache (the blocks' kda None), or None where each block holds its own
    (`unstacked`)."""

    embed: jax.Array       # [V, D] bf16
    blocks: tuple
    final_norm: jax.Array  # [D] f32
    unembed: jax.Array     # [V, D] bf16
    kda: KdaParams | None


def init_model(seed: int, config: ModelConfig) -> Model:
    """Deterministic random weights, the KDA params stacked: projections scaled by
    fan-in, KDA weights from `jax_kda.testing.random_params` (spread like a trained
    layer's). One compiled program draws a block, called once a layer: its compile does
    not grow with the layers, as one program of them all did (docs/performance.md)."""
    key, *layers = jax.random.split(jax.random.key(seed, impl="rbg"), 1 + config.layers)
    blocks = [init_block(layer, config) for layer in layers]
    return init_ends(key, config)._replace(
        blocks=tuple(block._replace(kda=None) for block in blocks),
        kda=jax.tree.map(lambda *leaves: jnp.stack(leaves), *(block.kda for block in blocks)))


def dense(key, rows, *cols, gain=1.0):
    """[rows, *cols] bf16 weights, normal with variance gain^2 / rows (fan-in)."""
    return (gain * rows**-0.5 * jax.random.normal(key, (rows, *cols))).astype(jnp.bfloat16)


@functools.partial(jax.jit, static_argnums=1)
def init_block(key, config: ModelConfig) -> Block:
    """One block's random weights, its `KdaParams` in `kda`."""
    D, H = config.dim, config.heads
    keys = iter(jax.random.split(key, 10))
    return Block(
        norm=jnp.ones((D,), jnp.float32),
        projections=KdaProjections(
            w_in=fuse_inputs(dense(next(keys), D, 3, H, K), dense(next(keys), D, H),
                             dense(next(keys), D, K), dense(next(keys), D, K)),
            w_gate=dense(next(keys), K, H * K),
            gate_bias=jax.random.normal(next(keys), (H, K), jnp.float32),
            w_out=dense(next(keys), H * K, D, gain=config.residual_gain)),
        kda=random_params(next(keys), config.kda),
        mlp_norm=jnp.ones((D,), jnp.float32),
        w_up=dense(next(keys), D, 2 * D),
        w_down=dense(next(keys), 2 * D, D, gain=config.residual_gain))


@functools.partial(jax.jit, static_argnums=1)
def init_ends(key, config: ModelConfig) -> Model:
    """The embedding, final norm and unembedding; no blocks yet."""
    embed_key, unembed_key = jax.random.split(key)
    D, V = config.dim, config.vocab
    return Model(embed=jax.random.normal(embed_key, (V, D)).astype(jnp.bfloat16),
                 blocks=(), final_norm=jnp.ones((D,), jnp.float32),
                 unembed=dense(unembed_key, D, V).T, kda=None)


def unstacked(model: Model, config: ModelConfig) -> Model:
    """The model with each block holding its own layer's `KdaParams`."""
    return model._replace(kda=None, blocks=tuple(
        block._replace(kda=jax.tree.map(lambda a: a[i], model.kda))
        for i, block in enumerate(model.blocks)))


def shard_config(config: ModelConfig, tp: int) -> ModelConfig:
    """The config of one of `tp` devices on TP_AXIS: H / tp heads, its row-parallel
    partial sums all-reduced over the axis."""
    return dataclasses.replace(config, heads=config.heads // tp, tp_axis=TP_AXIS)


def model_specs(model: Model) -> Model:
    """The `PartitionSpec`s of a model with stacked KDA params split over TP_AXIS
    (`shard_model`): column-parallel projections split their columns, row-parallel ones
    their rows, the KDA weights and the output gate's bias their heads; the rest is
    whole on every device."""
    column, row = P(None, TP_AXIS), P(TP_AXIS, None)
    projections = KdaProjections(w_in=column, w_gate=column, gate_bias=row, w_out=row)
    block = Block(norm=P(), projections=projections, kda=None, mlp_norm=P(), w_up=column,
                  w_down=row)
    return Model(embed=P(), blocks=(block,) * len(model.blocks), final_norm=P(),
                 unembed=P(), kda=jax_kda.head_specs(model.kda, TP_AXIS))


def shard_model(model: Model, mesh) -> Model:
    """The model on `mesh`, split over TP_AXIS as `model_specs` says. The fused input
    projection's columns are regrouped device first: each device's are the projection
    of its heads alone (their q, k, v and beta, then the gates' low-rank columns, which
    every device holds); the others are head-major already (w_gate's columns and
    w_out's rows [H, K]) or split evenly (the MLP)."""
    tp = mesh.shape[TP_AXIS]

    def regrouped(block):
        projections = block.projections
        x, beta, f_a, g_a = input_parts(projections.w_in, heads_of(projections))
        h = x.shape[-2] // tp
        w_in = jnp.concatenate([fuse_inputs(x[..., d * h:(d + 1) * h, :],
                                            beta[..., d * h:(d + 1) * h], f_a, g_a)
                                for d in range(tp)], axis=-1)
        return block._replace(projections=dataclasses.replace(projections, w_in=w_in))

    model = model._replace(blocks=tuple(map(regrouped, model.blocks)))
    return place(model, model_specs(model), mesh)


def place(tree, specs, mesh):
    """`tree`'s arrays on `mesh`, split as `specs` says."""
    return jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), tree, specs)


def tensor_parallel(step, mesh, specs, inputs: int, outputs: int):
    """step(model, cache, *inputs) -> (cache, *outputs) under `jax.shard_map` on `mesh`:
    model and cache split as specs = (model's, cache's) say, the `inputs` other
    arguments and `outputs` other results whole on every device."""
    return jax.shard_map(step, mesh=mesh, in_specs=specs + (P(),) * inputs,
                         out_specs=(specs[1],) + (P(),) * outputs)


def rms_norm(h, weight):
    return h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + 1e-6) * weight


def embedding(model: Model, tokens):
    """[...] tokens -> [..., D] f32, the residual stream's start."""
    return model.embed[tokens].astype(jnp.float32)


def block_forward(block: Block, config: ModelConfig, h, kda_layer):
    """One block on h [B, N, D] f32: (h, cache). kda_layer(x, f_a, beta, gate) ->
    (out [B, N, H, K] bf16, cache) runs its KDA layer on the bf16 projections. With
    config.tp_axis the block holds a device's heads and MLP columns (`shard_model`)."""
    total = (lambda y: y) if config.tp_axis is None else functools.partial(
        jax.lax.psum, axis_name=config.tp_axis)  # the row-parallel partial sums
    out, cache = kda_layer(*layer_inputs(block.projections, rms_norm(h, block.norm)))
    h = h + total(layer_output(block.projections, out))
    mlp = jax.nn.silu(project(rms_norm(h, block.mlp_norm), block.w_up))
    h = h + total(project(mlp, block.w_down))
    return h, cache


def forward(model: Model, config: ModelConfig, cache, tokens, kda_layer):
    """The target on tokens [B, N]: (hidden [B, N, D] before the final norm, cache), the
    blocks in a straight line.

    kda_layer(params, cache, x, f_a, beta, gate, layer) -> (out [B, N, H, K] bf16,
    cache) runs one KDA layer (a verify or the stock reference). With stacked KDA params
    and a stacked `KdaCache`, kda_layer gets them whole and the layer index; with
    per-layer params and a list of caches, one call per layer with its own and layer
    None.
    """
    h = embedding(model, tokens)
    if isinstance(cache, KdaCache):
        for i, block in enumerate(model.blocks):
            h, cache = block_forward(block, config, h, functools.partial(
                kda_layer, model.kda, cache, layer=i))
        return h, cache
    caches = []
    for block, layer_cache in zip(model.blocks, cache):
        h, layer_cache = block_forward(block, config, h, functools.partial(
            kda_layer, block.kda, layer_cache, layer=None))
        caches.append(layer_cache)
    return h, caches


def logits_of(model: Model, h):
    """[..., D] hidden f32 -> [..., V] logits f32."""
    return project(rms_norm(h, model.final_norm), model.unembed.T)


def greedy(logits):
    """(argmax [...] int32, top-1 logit [...], top-1 minus top-2 margin [...])."""
    top, index = jax.lax.top_k(logits, 2)
    return index[..., 0].astype(jnp.int32), top[..., 0], top[..., 0] - top[..., 1]


def draft_next(model: Model, tokens):
    """The bigram draft's next token after each of tokens [...]: no layers, no state."""
    return greedy(logits_of(model, embedding(model, tokens)))[0]


def draft_tree(tokens: int):
    """(parents, rank) of the tree drafter's T nodes: the bigram's top-1 chain from the
    last token, and beside each of its first T // 4 levels the bigram's top-2 token (a
    sibling of the chain's node there). parents as `VerifyInputs.parents` takes them;
    rank: the place of each node's token among its parent's top continuations."""
    branches = tokens // 4
    depth = tokens - branches  # the chain's nodes, the last token among them
    return ((-1,) + tuple(range(depth - 1)) + tuple(range(branches)),
            (0,) * depth + (1,) * branches)


def draft(model: Model, last, config: ModelConfig):
    """[B, T]: the last token, then the drafts: a chain of the bigram's top-1 after each,
    or the tree of `draft_tree`."""
    drafts = [last]
    if not config.tree:
        for _ in range(config.tokens - 1):
            drafts.append(draft_next(model, drafts[-1]))
        return jnp.stack(drafts, axis=1)
    parents, rank = draft_tree(config.tokens)
    for t in range(1, config.tokens):
        _, choices = jax.lax.top_k(logits_of(model, embedding(model, drafts[parents[t]])), 2)
        drafts.append(choices[..., rank[t]].astype(jnp.int32))
    return jnp.stack(drafts, axis=1)


def longest_path(parents, tokens, target):
    """Greedy acceptance in a tree: (path [B, T], accepted [B]): from node 0, each next
    node the child whose token is the target's argmax after its parent, while there is
    one (siblings hold distinct tokens, so at most one is). parents: [T]; tokens,
    target: [B, T]."""
    parents = jnp.asarray(parents, jnp.int32)
    chosen = tokens == jnp.take(target, jnp.maximum(parents, 0), axis=1)
    node = jnp.zeros(tokens.shape[0], jnp.int32)
    path, going, accepted = [node], jnp.ones_like(node, bool), jnp.ones_like(node)
    for _ in range(tokens.shape[1] - 1):
        child = (parents[None, :] == node[:, None]) & chosen
        going = going & child.any(axis=1)
        node = jnp.where(going, jnp.argmax(child, axis=1), node).astype(jnp.int32)
        accepted = accepted + going
        path.append(node)
    return jnp.stack(path, axis=1), accepted


def decode_step(model: Model, cache, last, slots, record_rows, *, config: ModelConfig,
                backend: str):
    """One speculative step for the batch. last: [B] each request's newest token, not yet
    seen by the target; slots, record_rows: [B] (padding rows: slot 0, record row -1).

    Returns (cache, target [B, T], accepted [B], top [B, T], last [B]): target[b,
    :accepted[b]] are request b's new tokens (along the accepted path, with a tree), top
    the top-1 logits of those decisions, last the newest of them: the next step's `last`,
    on the device, so that a step can be enqueued before the host reads the one before.
    """
    tokens = draft(model, last, config)  # [B, T]
    parents = None
    if config.tree:
        parents = jnp.broadcast_to(jnp.asarray(draft_tree(config.tokens)[0], jnp.int32),
                                   tokens.shape)

    def verify(params, cache, x, f_a, beta, gate, layer):
        inputs = VerifyInputs(x, f_a, beta, gate, slots, record_rows, parents)
        return jax_kda.fused_verify(params, cache, inputs, config.kda, backend=backend,
                                    layer=layer)

    h, cache = forward(model, config, cache, tokens, verify)
    target, top, _ = greedy(logits_of(model, h))
    path = None
    if config.tree:
        path, accepted = longest_path(draft_tree(config.tokens)[0], tokens, target)
        target = jnp.take_along_axis(target, path, axis=1)
        top = jnp.take_along_axis(top, path, axis=1)
    else:
        # Draft i + 1 stands if the target's argmax after token i equals it, and so did
        # all before.
        agree = jnp.cumprod(tokens[:, 1:] == target[:, :-1], axis=1)
        accepted = 1 + jnp.sum(agree, axis=1, dtype=jnp.int32)
    accept = functools.partial(jax_kda.accept, record_rows=record_rows, accepted=accepted,
                               config=config.kda, path=path)
    cache = accept(cache) if isinstance(cache, KdaCache) else [accept(c) for c in cache]
    newest = jnp.take_along_axis(target, accepted[:, None] - 1, axis=1)[:, 0]
    return cache, target, accepted, top, newest


class Prefill(NamedTuple):
    """A prefill call's programs (or their arguments, or their compiled forms): `embed`
    starts the residual stream of the call's packed tokens, `block` runs one block and
    its KDA layer's prefill, once a layer on that layer's weights (one program for every
    layer: its compile is flat in L, and no weight is copied), `first` reads each
    piece's next token."""

    embed: object
    block: object
    first: object


def prefill_embed(ends: Model, tokens):
    """A prefill call's tokens [N] (the pieces packed one after another) -> h [1, N, D]
    f32. ends: the model without its blocks (`model_ends`)."""
    return embedding(ends, tokens[None])


def prefill_block(params, cache, h, where, origin, lengths, resume, slots, record_rows,
                  layer, *, config: ModelConfig):
    """One block of a prefill call on h [1, N, D] f32, the call's packed positions: the
    model around the KDA layer computes the N positions alone; the KDA layer takes them in
    rows [B, P] (where [B, P]: each row position's index in the N, N for none; origin [N]:
    each position's row position b * P + p), row b holding lengths [B] tokens. A row with
    resume [B] True continues its prompt from the cache (`PrefillInputs.resume`), the
    others (every row where resume is None) start one; padding rows have slot 0.
    params: (the block's weights, the KDA params: the stacked ones with `layer` the int32
    layer index, or the block's own with layer None and its own cache).

    Returns (cache, h after the block)."""
    block, kda = params
    rows = lambda a: jnp.take(a[0], where, axis=0, mode="fill", fill_value=0)

    def kda_layer(x, f_a, beta, gate):
        inputs = PrefillInputs(*map(rows, (x, f_a, beta, gate)), lengths, slots,
                               record_rows, resume)
        out, prefilled = jax_kda.prefill(kda, cache, inputs, config.kda, layer=layer)
        return out.reshape(-1, *out.shape[2:])[origin][None], prefilled

    h, cache = block_forward(block, config, h, kda_layer)
    return cache, h


def prefill_first(ends: Model, h, where, lengths):
    """(first [B], top [B]): the target's argmax after each row's last position in h [1,
    N, D] (a request's first new token where the piece ends its prompt), and its logit."""
    last = jnp.take_along_axis(where, jnp.maximum(lengths - 1, 0)[:, None], axis=1)[:, 0]
    first, top, _ = greedy(logits_of(ends, h[0, jnp.minimum(last, h.shape[1] - 1)]))
    return first, top


def prefill_programs(config: ModelConfig) -> Prefill:
    """The prefill's programs, jitted: `block` donates the cache and h."""
    return Prefill(embed=jax.jit(prefill_embed),
                   block=jax.jit(functools.partial(prefill_block, config=config),
                                 donate_argnums=(1, 2)),
                   first=jax.jit(prefill_first))


def model_ends(model: Model) -> Model:
    """The model without its blocks: what the embedding and the logits read."""
    return model._replace(blocks=(), kda=None)


def layer_params(model: Model) -> list:
    """Each layer's (params, layer) for `prefill_block`: its block's weights with the
    stacked KDA params and its int32 index, or (unstacked) with its own and None."""
    if model.kda is None:
        return [((block._replace(kda=None), block.kda), None) for block in model.blocks]
    return [((block, model.kda), np.int32(i)) for i, block in enumerate(model.blocks)]


@functools.partial(jax.jit, static_argnames="config")
def stock_greedy(model: Model, sequences, lengths, *, config: ModelConfig):
    """Plain greedy decoding's view of sequences [N, P] (lengths [N]): the whole model
    with every KDA layer the stock per-token scan from a zero state, layer by layer on
    per-layer caches (no stacked indexing, no verify).

    Returns, per position p, for greedy decoding's choice after sequences[:, :p + 1]:
    (top [N, P], its logit; margin [N, P], top-1 minus top-2 logit; gap [N, P], top
    minus the logit of the token the sequence holds at p + 1).
    """
    N = sequences.shape[0]
    slots = jnp.arange(1, N + 1, dtype=jnp.int32)
    caches = [jax_kda.init_cache(config.kda, N + 1, N) for _ in range(config.layers)]

    def layer(params, cache, x, f_a, beta, gate, layer):
        inputs = PrefillInputs(x, f_a, beta, gate, lengths, slots, slots - 1)
        return stock_prefill(params, cache, inputs, config.kda, layer=layer)

    h, _ = forward(unstacked(model, config), config, caches, sequences, layer)
    logits = logits_of(model, h)
    following = jnp.roll(sequences, -1, axis=1)[..., None]
    _, top, margin = greedy(logits)
    return top, margin, top - jnp.take_along_axis(logits, following, axis=-1)[..., 0]


def padded(rows, width):
    """Token lists -> [len(rows), width] int32, zero-padded on the right."""
    out = np.zeros((len(rows), width), np.int32)
    for i, row in enumerate(rows):
        out[i, :len(row)] = row
    return out


def pack(pieces, rows: int, width: int, tokens: int):
    """Pieces (token lists: at most `rows`, each at most `width` tokens, `tokens` in all
    at most) -> a prefill call's (tokens [tokens] for `prefill_embed`; where [rows, width],
    origin [tokens], lengths [rows] for `prefill_block`) int32: the pieces one after
    another, zeros after them."""
    packed, origin = np.zeros(tokens, np.int32), np.zeros(tokens, np.int32)
    where = np.full((rows, width), tokens, np.int32)
    lengths, start = np.zeros(rows, np.int32), 0
    for row, piece in enumerate(pieces):
        n = len(piece)
        packed[start:start + n], lengths[row] = piece, n
        where[row, :n] = np.arange(start, start + n)
        origin[start:start + n] = row * width + np.arange(n)
        start += n
    return packed, where, origin, lengths


def prefill_tokens(rows: int, piece: int) -> int:
    """The prompt tokens a prefill call of `rows` rows computes, in pieces of `piece`."""
    return max(piece, rows * piece // PREFILL_PACK)


def prefill_resumes(batch: int, max_prompt: int, piece: int) -> bool:
    """Whether a batch's prefill calls may resume a prompt: one longer than its piece, or
    one cut short where a call's tokens run out."""
    return max_prompt > piece or prefill_tokens(batch, piece) < batch * piece


def prefill_args(model: Model, cache, rows: int, piece: int, resumes: bool) -> Prefill:
    """The prefill programs' arguments for a call of `rows` rows (padding), as they
    compile (the block's of the first layer)."""
    tokens, where, origin, lengths = pack([], rows, piece, prefill_tokens(rows, piece))
    ends, (params, layer) = model_ends(model), layer_params(model)[0]
    h = jax.ShapeDtypeStruct((1, len(tokens), model.embed.shape[1]), jnp.float32)
    return Prefill(embed=(ends, tokens),
                   block=(params, cache[0] if isinstance(cache, list) else cache, h, where,
                          origin, lengths, np.zeros(rows, bool) if resumes else None,
                          *indices(np.full(rows, -1)), layer),
                   first=(ends, h, where, lengths))


def compile_threads(requested: int | None) -> int:
    """The threads compiling the prefill's row counts ahead: `requested`, or by default one
    per CORES_PER_COMPILE host cores beside an accelerator, none on the CPU (its cores
    run the model)."""
    if requested is not None:
        return requested
    return 0 if jax.default_backend() == "cpu" else (os.cpu_count() or 1) // CORES_PER_COMPILE


def round_up(n, multiple=16):
    return -(-n // multiple) * multiple


def indices(rows):
    """Batch rows [N] (-1: padding) -> (slots, record_rows) [N] int32: batch row b uses
    slot b + 1 and record row b; padding slot 0 and record row -1."""
    rows = np.asarray(rows, np.int32)
    return np.where(rows >= 0, rows + 1, 0).astype(np.int32), rows


def prefill_rows(prompts: int, batch: int, compiled=()) -> int:
    """Rows of the prefill call that takes `prompts` prompts: the fewest of the
    `compiled` prefills' row counts that hold them at most PREFILL_PADDING times over,
    else the next power of two, at most the batch (to compile): a batch of B rows
    compiles at most floor(log2(B)) + 2 prefills."""
    fits = [rows for rows in compiled if prompts <= rows <= PREFILL_PADDING * prompts]
    return min(fits) if fits else min(1 << (prompts - 1).bit_length(), batch)


class Engine:
    """The compiled prefill and decode step of a batch of `batch` rows and the cache they
    donate: one stacked `KdaCache` (layers=L), or with `layer_list` a list of L
    per-layer ones beside per-layer `KdaParams`. Prompts hold up to `max_prompt` tokens.
    tp > 1: the model and the stacked cache split over `tp` devices (`shard_model`),
    each step a `jax.shard_map` (`tensor_parallel`).

    A prefill call takes the admitted prompts only, in `prefill_rows` rows, in pieces of
    at most `piece` tokens (rounded up to 16), packed: a call of R rows computes
    `tokens(R)` positions, and a prompt longer than its piece, or cut short where the
    call's tokens run out, resumes from the cache in the next call (where none can,
    the prefill is compiled without `resume`). The prefill compiles once per row count
    (at most `len(self.prefill_shapes)`): with `compile_threads` > 0 every row count
    compiles ahead, in that many threads beside the decode step (a full batch's first),
    and the first call waits for them all and runs each once on padding rows; else each
    compiles at its first use. `prefill_compile_s` is what the calls waited for them,
    and the counters say what the calls computed. Where the kernels run, the decode
    step's and the prefill's kernels compile in parallel processes
    (`jax_kda.compile_kernels`, not waited for: the decode step's lowering waits for its
    own kernel, then XLA compiles the step while the prefill's compile), from the decode
    step's trace and the prefill's at a full batch's rows, which its compile then lowers."""

    def __init__(self, model: Model, config: ModelConfig, batch: int, max_prompt: int,
                 backend: str = "auto", layer_list: bool = False, tp: int = 1,
                 piece: int = PREFILL_PIECE, compile_threads: int = 0):
        self.config, self.batch = config, batch
        self.piece = round_up(min(max_prompt, piece))
        self.resumes = prefill_resumes(batch, max_prompt, self.piece)
        self.prefill_shapes = sorted({prefill_rows(n, batch) for n in range(1, batch + 1)})
        self.prefill_calls = self.prefill_positions = 0
        self.prefill_compile_s = 0.0
        L, kda = config.layers, config.kda
        if layer_list:
            self.model = unstacked(model, config)
            self.cache = [jax_kda.init_cache(kda, batch + 1, batch) for _ in range(L)]
        else:
            self.model, self.cache = model, jax_kda.init_cache(kda, batch + 1, batch, layers=L)
        local = config if tp == 1 else shard_config(config, tp)
        self._prefill, self.prefills = prefill_programs(local), {}
        decode = functools.partial(decode_step, config=local, backend=backend)
        if tp > 1:
            mesh = jax.make_mesh((tp,), (TP_AXIS,))
            self.model = shard_model(self.model, mesh)
            specs = model_specs(self.model), jax_kda.head_specs(self.cache, TP_AXIS)
            self.cache = place(self.cache, specs[1], mesh)
            block = tensor_parallel(functools.partial(prefill_block, config=local), mesh,
                                    ((specs[0].blocks[0], specs[0].kda), specs[1]),
                                    inputs=8, outputs=1)
            self._prefill = self._prefill._replace(block=jax.jit(block, donate_argnums=(1, 2)))
            decode = tensor_parallel(decode, mesh, specs, inputs=3, outputs=4)
        self._ends, self._layers = model_ends(self.model), layer_params(self.model)
        # the prefill is traced while calls donate the cache: its shapes, not its buffers
        self._cache_spec = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), self.cache)
        tick = time.perf_counter()
        decode = jax.jit(decode, donate_argnums=1).trace(
            self.model, self.cache, np.zeros(batch, np.int32), *indices(np.full(batch, -1)))
        self.kernels, self._traced = 0, {}
        if backend != "jax" and jax_kda.cutedsl_supported():
            # the step's and the prefill's kernels, in parallel processes; the prefill's
            # block traced at the rows of a full batch's admission, its first call
            rows = prefill_rows(batch, batch)
            self._traced[rows] = self._prefill.block.trace(*self._prefill_args(rows).block)
            self.kernels = jax_kda.compile_kernels(decode, self._traced[rows], wait=False)
        self.compile_threads, self._ahead = compile_threads, {}
        if compile_threads:
            pool = concurrent.futures.ThreadPoolExecutor(compile_threads)
            self._ahead = {rows: pool.submit(self._compile_prefill, rows)
                           for rows in sorted(self.prefill_shapes, reverse=True)}
            pool.shutdown(wait=False)  # its threads end after their last compile
        self._decode = decode.lower().compile()
        self.decode_compile_s = time.perf_counter() - tick
        self._decode_rows = self._decode.input_shardings[0][3:]
        self._rows = (None, None)  # (live, its slots and record rows on the device)

    def all_reduces(self) -> int:
        """All-reduces in the compiled decode step (per step)."""
        return len(re.findall(r" all-reduce(?:-start)?\(", self._decode.as_text()))

    def tokens(self, rows: int) -> int:
        """The prompt tokens a prefill call of `rows` rows computes."""
        return prefill_tokens(rows, self.piece)

    def prefill(self, texts):
        """Prefills the batch rows whose token list in texts (one per row) is not empty;
        the others are left as they are. Returns (first [B] int32, top [B] f32) as
        NumPy arrays: each prefilled row's first new token and its logit (0 elsewhere).
        The calls are enqueued one after another, their results read after the last."""
        first, top = np.zeros(self.batch, np.int32), np.zeros(self.batch, np.float32)
        done = {row: 0 for row, text in enumerate(texts) if text}  # row: tokens prefilled
        ended = []  # (row, its place in a call, that call's results on the device)
        while done:
            size = prefill_rows(len(done), self.batch, {*self.prefills, *self._ahead})
            rows, pieces, room = [], [], self.tokens(size)
            for row in list(done)[:size]:  # a row cut short goes first in the next call
                pieces.append(texts[row][done[row]:done[row] + min(self.piece, room)])
                if not pieces[-1]:
                    pieces.pop()
                    break
                rows.append(row)
                room -= len(pieces[-1])
            padding = size - len(rows)
            resume = [done[row] > 0 for row in rows] + [False] * padding
            results = self._prefill_call(
                self._compiled_prefill(size), *pack(pieces, size, self.piece, self.tokens(size)),
                np.array(resume) if self.resumes else None, *indices(rows + [-1] * padding))
            self.prefill_calls += 1
            self.prefill_positions += self.tokens(size)
            for result in results:
                result.copy_to_host_async()
            for i, (row, piece) in enumerate(zip(rows, pieces)):
                done[row] += len(piece)
                if done[row] == len(texts[row]):
                    del done[row]
                    ended.append((row, i, results))
        for row, i, results in ended:
            first[row], top[row] = (np.asarray(result)[i] for result in results)
        return first, top

    def _prefill_call(self, programs: Prefill, tokens, *rows):
        """One prefill call (rows: `prefill_block`'s where .. record_rows), its programs
        enqueued: the blocks one after another on the cache. Returns (first, top) on the
        device."""
        where, _, lengths, *_ = rows = [  # on the device once, not once a layer
            a if a is None else jax.device_put(a, sharding)
            for a, sharding in zip(rows, programs.block.input_shardings[0][3:9])]
        h = programs.embed(self._ends, tokens)
        for i, (params, layer) in enumerate(self._layers):
            if isinstance(self.cache, list):
                self.cache[i], h = programs.block(params, self.cache[i], h, *rows, layer)
            else:
                self.cache, h = programs.block(params, self.cache, h, *rows, layer)
        return programs.first(self._ends, h, where, lengths)

    def _compiled_prefill(self, rows: int) -> Prefill:
        """The prefill's programs at `rows` rows, compiled at their first use; or, where
        every row count compiles ahead, all of them waited for at the first call, each
        run once on padding rows, so that a first execution's setup (XLA's and the
        GPU's) falls before the run's calls, not in one of them."""
        if rows not in self.prefills:
            tick = time.perf_counter()
            if self._ahead:
                for size, job in self._ahead.items():
                    self.prefills[size] = job.result()
                    jax.block_until_ready(self._prefill_call(
                        self.prefills[size], *pack([], size, self.piece, self.tokens(size)),
                        np.zeros(size, bool) if self.resumes else None,
                        *indices(np.full(size, -1))))
                self._ahead = {}
            else:
                self.prefills[rows] = self._compile_prefill(rows)
            self.prefill_compile_s += time.perf_counter() - tick
        return self.prefills[rows]

    def _compile_prefill(self, rows: int) -> Prefill:
        """The prefill's programs at `rows` rows, compiled."""
        args, block = self._prefill_args(rows), self._traced.pop(rows, None)
        traced = Prefill(self._prefill.embed.trace(*args.embed),
                         block or self._prefill.block.trace(*args.block),
                         self._prefill.first.trace(*args.first))
        return Prefill(*(t.lower().compile() for t in traced))

    def _prefill_args(self, rows: int):
        """The prefill's arguments at `rows` rows, as it is compiled."""
        return prefill_args(self.model, self._cache_spec, rows, self.piece, self.resumes)

    def decode(self, last, live):
        """Enqueues one decode step of last [B] (NumPy, or the step before's `last` on the
        device; live [B] bool, other rows are padding) and returns at once: (target [B,
        T], accepted [B], top [B, T], last [B]) as `decode_step`, on the device, the first
        three already on their way to the host."""
        if self._rows[0] != tuple(live):  # the rows' slots change at admissions only
            rows = np.where(live, np.arange(self.batch), -1)
            self._rows = tuple(live), jax.device_put(indices(rows), self._decode_rows)
        self.cache, *results = self._decode(self.model, self.cache, last, *self._rows[1])
        for result in results[:3]:
            result.copy_to_host_async()
        return results


@dataclasses.dataclass
class Run:
    """What a decoding run produced: per request its new tokens, and per token the
    top-1 logit of the decision that chose it; plus the bookkeeping (seconds without
    compiles)."""

    tokens: list
    tops: list
    steps: int = 0
    row_steps: int = 0
    accepted: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0


def speculative_decode(engine: Engine, prompts, new_tokens: int, progress=None) -> Run:
    """Greedy speculative decoding of every prompt (token lists) to new_tokens tokens,
    `engine.batch` requests at a time; progress(run) is called now and then if given.

    The steps overlap the host: step n + 1 is enqueued (from step n's `last`, on the
    device) before the host reads step n's tokens, so the host's reading and bookkeeping
    run while the device computes. A request that ends at step n is still a row of step
    n + 1, whose tokens for it are dropped; a freed row is refilled (a prefill, from the
    tokens on the host) once the step in flight is read."""
    batch = engine.batch
    run = Run(tokens=[[] for _ in prompts], tops=[[] for _ in prompts])
    waiting = list(range(len(prompts)))[::-1]
    row_request = [None] * batch  # request in each batch row (slot row + 1, record row)
    last = np.zeros(batch, np.int32)  # each row's newest token, once the steps are read
    shown = time.perf_counter()

    def take(row, tokens, tops):
        """Appends a row's new tokens; frees the row when its request is done."""
        request = row_request[row]
        room = new_tokens - len(run.tokens[request])
        run.tokens[request] += [int(t) for t in tokens[:room]]
        run.tops[request] += [float(t) for t in tops[:room]]
        last[row] = tokens[-1]
        if len(run.tokens[request]) == new_tokens:
            row_request[row] = None

    def read(step):
        """Takes the tokens of an enqueued step ((results, live)) for its rows' requests
        that are still decoding."""
        (target, accepted, top, _), live = step
        target, accepted, top = np.asarray(target), np.asarray(accepted), np.asarray(top)
        rows = [row for row in np.flatnonzero(live) if row_request[row] is not None]
        run.steps += bool(rows)
        run.row_steps += len(rows)
        for row in rows:
            n = accepted[row]
            run.accepted += int(n)
            take(row, target[row, :n], top[row, :n])

    flight = None  # the step enqueued and not yet read
    while waiting or any(r is not None for r in row_request):
        admitted = [row for row in range(batch) if row_request[row] is None][:len(waiting)]
        if admitted and flight is None:
            for row in admitted:
                row_request[row] = waiting.pop()
            compiled, tick = engine.prefill_compile_s, time.perf_counter()
            first, top = engine.prefill([prompts[row_request[row]] if row in admitted else []
                                         for row in range(batch)])
            run.prefill_s += time.perf_counter() - tick - (engine.prefill_compile_s - compiled)
            for row in admitted:
                take(row, first[row:row + 1], top[row:row + 1])
            continue  # admit again if a one-token request finished already
        tick = time.perf_counter()
        if admitted:  # a row is free for a waiting request: read the last step first
            read(flight)
            flight = None
        else:
            live = np.array([r is not None for r in row_request])
            results = engine.decode(last if flight is None else flight[0][3], live)
            if flight is not None:
                read(flight)
            flight = results, live
        run.decode_s += time.perf_counter() - tick
        if progress is not None and time.perf_counter() - shown > PROGRESS_SECONDS:
            shown = time.perf_counter()
            progress(run)
    if flight is not None:  # its rows all ended at the step before; the device is done
        jax.block_until_ready(flight[0])
    return run


def time_decode(engine: Engine, prompts, steps: int):
    """The decode step on a full batch (rows prefilled with prompts, cycled) as
    `speculative_decode` runs it, each step enqueued before the one before is read:
    `steps` steps timed, then `steps` more under JAX's profiler; the full batch's
    prefill under the profiler too.

    Returns (wall seconds per step, their mean; `traced_steps`' dict of the device's
    times per step; its dict of the prefill's calls as one step, with the calls, the
    positions they computed and the prompt tokens among them).
    """
    live = np.ones(engine.batch, bool)
    texts = [prompts[row % len(prompts)] for row in range(engine.batch)]
    calls, positions = engine.prefill_calls, engine.prefill_positions
    first = None

    def prefill():
        nonlocal first
        first, _ = engine.prefill(texts)

    prefilled = traced_steps(prefill, 1)
    prefilled.update(calls=engine.prefill_calls - calls, tokens=sum(map(len, texts)),
                     positions=engine.prefill_positions - positions)

    def decode():
        flight = engine.decode(first, live)
        for _ in range(steps - 1):
            results = engine.decode(flight[3], live)
            jax.tree.map(np.asarray, flight[:3])
            flight = results
        jax.tree.map(np.asarray, flight[:3])

    decode()  # the loop's own first dispatches
    tick = time.perf_counter()
    decode()
    wall = (time.perf_counter() - tick) / steps
    return wall, traced_steps(decode, steps), prefilled


def step_bytes(engine: Engine) -> tuple[int, int]:
    """Bytes one device moves in a decode step of a full batch: (the weights it reads:
    every block weight and the final norm once, the unembedding T times, for the draft's
    T - 1 argmaxes and the target's logits, the embedding's gathered rows left out; the
    KDA states of the batch's requests, each read and written once)."""
    local = lambda a: a.addressable_shards[0].data.nbytes  # one device's part
    model = engine.model
    weights = (sum(map(local, jax.tree.leaves((model.blocks, model.kda))))
               + local(model.final_norm)
               + engine.config.tokens * local(model.unembed))
    caches = engine.cache if isinstance(engine.cache, list) else [engine.cache]
    per_request = sum(local(c.state) // c.state.shape[-4] for c in caches)  # S slots
    return weights, 2 * engine.batch * per_request


def roofline(engine: Engine, step_s: float, timed: str, gbps: float | None) -> str:
    """The summary's line on the decode step (step_s seconds, measured as `timed` says)
    against the time its bytes take at the copy bandwidth: gbps GB/s, or None to
    measure it (`copy_bandwidth`)."""
    weights, states = step_bytes(engine)
    if gbps is None:
        nbytes = CPU_COPY_BYTES if jax.default_backend() == "cpu" else COPY_BYTES
        copy = copy_bandwidth(nbytes, COPY_REPS)
        bandwidth = copy["bytes"] / copy["seconds"]
        how = f"a {nbytes >> 20} MiB device copy, read + write, {copy['how']}"
    else:
        bandwidth, how = 1e9 * gbps, "--copy-bandwidth"
    stream = weights / bandwidth
    return (f"roofline: {weights / 1e6:.1f} MB of weights read per step and device, "
            f"{1e3 * stream:.3f} ms at {bandwidth / 1e9:.1f} GB/s ({how}); with the KDA "
            f"states of a full batch read and written ({states / 1e6:.1f} MB) "
            f"{1e3 * (weights + states) / bandwidth:.3f} ms; the step ({timed}) "
            f"{1e3 * step_s:.3f} ms, {step_s / stream:.1f}x the weights' time")


class Verdict(NamedTuple):
    """Per new token of a run (requests in order): where [M, 2] (request, index), gap [M]
    (how far below the stock top-1 logit the chosen token's stock logit is: 0 where the
    run chose plain greedy decoding's token), margin [M] (the stock top-1 minus top-2
    logit) and drift [M] (how far the run's own top-1 logit is from the stock one)."""

    where: np.ndarray
    gap: np.ndarray
    margin: np.ndarray
    drift: np.ndarray


def check(model: Model, config: ModelConfig, prompts, run: Run) -> Verdict:
    """Scores every new token of `run` against plain greedy decoding with the stock
    per-token recurrence after the same prefix (one pass over the whole sequences). If
    every gap is 0, every token is greedy decoding's choice after the tokens before it,
    so by induction the run equals plain greedy decoding from each prompt, token for
    token. model: the one `init_model` returns."""
    sequences = [p + t for p, t in zip(prompts, run.tokens)]
    lengths = np.array([len(s) for s in sequences], np.int32)
    # one compile for chains and trees alike: the stock model has no drafts
    top, margin, gap = map(np.asarray, stock_greedy(
        model, padded(sequences, round_up(lengths.max())), lengths,
        config=dataclasses.replace(config, tree=False, state_dtype="float32")))
    where, picked = [], []
    for request, (prompt, tokens) in enumerate(zip(prompts, run.tokens)):
        at = np.arange(len(prompt) - 1, len(prompt) - 1 + len(tokens))
        where += [(request, index) for index in range(len(tokens))]
        picked.append((np.full(len(at), request), at))
    rows, at = map(np.concatenate, zip(*picked))
    return Verdict(np.array(where), gap[rows, at], margin[rows, at],
                   np.abs(top[rows, at] - np.concatenate(run.tops)))


def random_prompts(seed: int, count: int, max_length: int, vocab: int):
    """count prompts of random lengths in 1..max_length."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, max_length + 1, size=count)
    return [rng.integers(0, vocab, size=n).tolist() for n in lengths]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--layers", type=int, default=2, help="KDA blocks in the target")
    parser.add_argument("--heads", type=int, default=2, help="KDA heads of 128 per layer")
    parser.add_argument("--dim", type=int, default=256, help="residual width")
    parser.add_argument("--vocab", type=int, default=512, help="vocabulary size")
    parser.add_argument("--tokens", type=int, default=4,
                        help="T, tokens per verify: the last token and T-1 drafts (2..16)")
    parser.add_argument("--draft", choices=("chain", "tree", "both"), default="chain",
                        help="the drafts: a chain of the bigram's top-1, a tree with its "
                             "top-2 beside the chain's first T // 4 levels, or both in "
                             "turn on the same prompts")
    parser.add_argument("--state-dtype", choices=("float32", "bfloat16"), default="float32",
                        help="the KDA layers' cached state: FP32, or bf16 (half the bytes, "
                             "FP32 arithmetic, rounded where the state is written)")
    parser.add_argument("--batch", type=int, default=4, help="requests decoded together")
    parser.add_argument("--requests", type=int, default=10, help="requests in all")
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens per request")
    parser.add_argument("--max-prompt", type=int, default=40,
                        help="prompt lengths are random in 1..max-prompt")
    parser.add_argument("--backend", choices=jax_kda.BACKENDS, default="auto",
                        help="fused_verify's backend: auto = the CuTe DSL kernel on "
                             "H100/H200, else pure JAX")
    parser.add_argument("--layer-list", action="store_true",
                        help="run the KDA layers unstacked, for comparison: per-layer "
                             "params and a Python list of caches, one fused_verify each")
    parser.add_argument("--tp", type=int, default=1,
                        help="devices the heads and projections are split over "
                             "(Megatron-style tensor parallelism)")
    parser.add_argument("--seed", type=int, default=0, help="weights and prompts")
    parser.add_argument("--copy-bandwidth", type=float, default=None, metavar="GB/S",
                        help="the device's copy bandwidth (read + write) for the step's "
                             "roofline; default: measured by a device-to-device copy")
    parser.add_argument("--compile-threads", type=int, default=None, metavar="N",
                        help="threads that compile every prefill row count ahead, beside "
                             "the decode step (0: each at its first use); default: one per "
                             f"{CORES_PER_COMPILE} host cores on an accelerator, 0 on the "
                             "CPU, whose cores run the model")
    parser.add_argument("--prefill-piece", type=int, default=PREFILL_PIECE,
                        help="a prompt's tokens per prefill call (rounded up to 16): a "
                             "longer prompt resumes from the cache in the next call")
    parser.add_argument("--no-check", action="store_true",
                        help="skip the check against stock greedy decoding")
    parser.add_argument("--compile-cache", default=None, metavar="DIR",
                        help="the persistent compile cache's directory (default: "
                             "$XDG_CACHE_HOME/jax_kda or ~/.cache/jax_kda)")
    parser.add_argument("--no-compile-cache", action="store_true",
                        help="compile everything afresh, caching nothing on disk")
    args = parser.parse_args(argv)
    for name in ("layers", "heads", "dim", "batch", "requests", "new_tokens", "max_prompt",
                 "tp", "prefill_piece"):
        value = getattr(args, name)
        if value < 1:
            parser.error(f"--{name.replace('_', '-')}: expected >= 1, got {value}")
    if args.copy_bandwidth is not None and not args.copy_bandwidth > 0:
        parser.error(f"--copy-bandwidth: expected > 0, got {args.copy_bandwidth}")
    if args.vocab < 2:
        parser.error(f"--vocab: expected >= 2, got {args.vocab}")
    if not 2 <= args.tokens <= 16:
        parser.error(f"--tokens: expected 2..16, got {args.tokens}")
    if args.draft != "chain" and args.tokens < 4:
        parser.error(f"--draft {args.draft}: a tree needs --tokens >= 4, got {args.tokens}")
    if args.tp > 1:
        if args.heads % args.tp or 2 * args.dim % args.tp:
            parser.error(f"--tp: expected a divisor of --heads ({args.heads}) and of the MLP "
                         f"width 2 x --dim ({2 * args.dim}), got {args.tp}")
        if args.layer_list:
            parser.error("--tp: runs the stacked KDA layers, not --layer-list")
        # on CPU, one device more than the mesh's: see the module's docstring
        spare = int(jax.default_backend() == "cpu")
        if jax.device_count() < args.tp + spare:
            parser.error(f"--tp: expected at most {jax.device_count() - spare} with the "
                         f"{jax.device_count()} {jax.default_backend()} devices present, got "
                         f"{args.tp} (on CPU: XLA_FLAGS="
                         f"--xla_force_host_platform_device_count={2 * args.tp})")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    cache_events = collections.Counter()
    jax.monitoring.register_event_listener(lambda event, **_: cache_events.update([event]))
    if not args.no_compile_cache:
        print(f"compile cache: {jax_kda.enable_compile_cache(args.compile_cache)}")
    drafts = ("chain", "tree") if args.draft == "both" else (args.draft,)
    configs = {name: ModelConfig(vocab=args.vocab, dim=args.dim, layers=args.layers,
                                 heads=args.heads, tokens=args.tokens, tree=name == "tree",
                                 state_dtype=args.state_dtype)
               for name in drafts}
    config = configs[drafts[0]]
    resolved = args.backend
    if resolved == "auto":
        resolved = "cutedsl" if jax_kda.cutedsl_supported() else "jax"
    form = ("per-layer KDA params and a list of caches" if args.layer_list else
            "KDA params and cache stacked, the blocks' weights per layer")
    print(f"target: {config.layers} KDA layers of {config.heads} heads x {K}, dim "
          f"{config.dim}, vocab {config.vocab}, {form}, {config.state_dtype} states; draft: "
          f"the target's bigram (no layers)")
    print(f"decode: T={config.tokens}, batch {args.batch}, {args.requests} requests of "
          f"{args.new_tokens} new tokens, prompts of 1..{args.max_prompt}; fused_verify "
          f"backend {resolved} ({args.backend}) on {args.tp} x {jax.devices()[0].device_kind}")
    tick = time.perf_counter()
    model = jax.block_until_ready(init_model(args.seed, config))
    print(f"weights: {sum(a.nbytes for a in jax.tree.leaves(model)) / 1e6:.1f} MB drawn "
          f"at random in {time.perf_counter() - tick:.1f} s")
    prompts = random_prompts(args.seed, args.requests, args.max_prompt, config.vocab)
    status, means = 0, {}
    for name in drafts:
        if name == "tree":
            parents, branches = draft_tree(args.tokens)[0], args.tokens // 4
            print(f"draft tree: parents {list(parents)} (a chain of "
                  f"{args.tokens - branches} with the top-2 token beside its first "
                  f"{branches} levels)")
        else:
            print(f"draft chain: the last token and {args.tokens - 1} drafts")
        result, means[name] = decode_and_check(args, configs[name], model, prompts,
                                               cache_events)
        status = max(status, result)
    if len(means) > 1:
        print("mean accepted tokens per request per step: " + ", ".join(
            f"{name} {mean:.2f}" for name, mean in means.items()) + f" (T={args.tokens})")
    return status


def decode_and_check(args, config: ModelConfig, model: Model, prompts, cache_events):
    """Decodes every prompt with `config`'s drafts, reports, and checks the tokens
    against plain greedy decoding. cache_events: counts of JAX's compile cache events
    (`CACHE_EVENTS`). Returns (exit status, mean accepted tokens per request per
    step)."""
    def progress(run):
        made = sum(map(len, run.tokens))
        done = sum(len(tokens) == args.new_tokens for tokens in run.tokens)
        print(f"  step {run.steps}: {done}/{args.requests} requests done, {made} tokens, "
              f"{run.accepted / max(run.row_steps, 1):.2f} accepted per request-step, "
              f"{made / (run.prefill_s + run.decode_s):.0f} tokens/s", flush=True)

    cached = dict(cache_events)
    engine = Engine(model, config, args.batch, args.max_prompt, args.backend, args.layer_list,
                    args.tp, args.prefill_piece, compile_threads(args.compile_threads))
    kernels = (f", {engine.kernels} CuTe DSL kernels of both compiled ahead in parallel"
               if engine.kernels else "")
    ahead = (f"each row count on {engine.compile_threads} threads beside it"
             if engine.compile_threads else "at its first use of each row count")
    print(f"compile: decode step {engine.decode_compile_s:.1f} s{kernels} (the prefill "
          f"compiles {ahead})", flush=True)
    if args.tp > 1:
        state = engine.cache.state
        print(f"tensor parallel: {config.heads // args.tp} of {config.heads} heads on each of "
              f"{len(state.sharding.device_set)} devices (cache state {state.shape} split "
              f"{state.sharding.spec}); the decode step's all-reduces: "
              f"{engine.all_reduces()} (one per KDA block and per MLP block, "
              f"{config.layers} layers)", flush=True)
    run = speculative_decode(engine, prompts, args.new_tokens, progress)
    made, prompt_tokens = sum(map(len, run.tokens)), sum(map(len, prompts))
    total = run.prefill_s + run.decode_s
    loaded, compiled = (cache_events[event] - cached.get(event, 0) for event in CACHE_EVENTS)
    start = ("compile cache off" if args.no_compile_cache else
             f"{'warm' if not compiled else 'cold' if not loaded else 'partly warm'} start: "
             f"{loaded} of {loaded + compiled} XLA programs from the compile cache")
    shapes = len(engine.prefill_shapes)
    prefill = (f"prefill waited {engine.prefill_compile_s:.1f} s (its {shapes} shapes compiled "
               f"ahead on {engine.compile_threads} threads, each run once"
               if engine.compile_threads else f"prefill {engine.prefill_compile_s:.1f} s "
               f"({len(engine.prefills)} of its {shapes} shapes compiled")
    print(f"compile: decode step {engine.decode_compile_s:.1f} s, {prefill}: " + ", ".join(
              f"{rows} x {engine.piece} ({engine.tokens(rows)} tokens)"
              for rows in engine.prefill_shapes) + f"); {start}")
    print(f"prefill: {prompt_tokens} prompt tokens of {len(prompts)} requests in "
          f"{engine.prefill_calls} calls, {run.prefill_s:.2f} s "
          f"({100 * run.prefill_s / total:.0f}%, {prompt_tokens / max(run.prefill_s, 1e-9):.0f} "
          f"prompt tokens/s), each request's first new token; the calls computed "
          f"{engine.prefill_positions} token positions, "
          f"{100 * prompt_tokens / engine.prefill_positions:.0f}% of them prompt tokens")
    decoded = made - len(prompts)
    print(f"decode: {run.steps} steps, {decoded} new tokens in {run.decode_s:.2f} s "
          f"({100 * run.decode_s / total:.0f}%, {1e3 * run.decode_s / run.steps:.2f} ms per "
          f"step), {decoded / max(run.decode_s, 1e-9):.0f} tokens/s; mean accepted tokens "
          f"per request per step {run.accepted / max(run.row_steps, 1):.2f} "
          f"(of T={config.tokens})")
    print(f"throughput: {made} new tokens in {total:.2f} s, {made / total:.0f} tokens/s")
    step_s, timed = run.decode_s / run.steps, "the run's mean"
    if jax.default_backend() == "gpu":
        wall, traced, prefilled = time_decode(engine, prompts, TIMED_STEPS)
        if prefilled["steps"]:
            print(f"prefill, full batch: {prefilled['tokens']} prompt tokens "
                  f"({prefilled['positions']} positions) in {prefilled['calls']} calls, GPU "
                  f"busy {1e-3 * prefilled['busy_us']:.1f} ms, of which jax-kda's "
                  f"{prefilled['ours']:.0f} kernels {1e-3 * prefilled['ours_us']:.1f} ms "
                  f"(the KDA layers' gate projection and norm are XLA's, outside them)")
        if traced["steps"]:
            print(f"decode step, full batch of {args.batch}: wall {1e3 * wall:.3f} ms per step "
                  f"(the decode loop, mean of {TIMED_STEPS}), GPU {1e-3 * traced['step_us']:.3f} "
                  f"ms (profiler trace, first activity's start to last one's end, median; "
                  f"busy {1e-3 * traced['busy_us']:.3f} ms in {traced['kernels']:.0f} kernels and "
                  f"device copies, of which jax-kda's {traced['ours']:.0f} kernels "
                  f"{1e-3 * traced['ours_us']:.3f} ms)")
            step_s, timed = 1e-6 * traced["step_us"], "GPU time, full batch"
        else:
            print("decode step GPU time: the profiler trace held no GPU activity")
    else:
        print(f"decode step GPU time: not available on {jax.default_backend()} (it comes "
              f"from JAX's profiler trace of a GPU)")
    print(roofline(engine, step_s, timed, args.copy_bandwidth), flush=True)
    if args.no_check:
        return 0, run.accepted / max(run.row_steps, 1)
    tick = time.perf_counter()
    verdict = check(model, config, prompts, run)
    took = time.perf_counter() - tick
    off = np.flatnonzero(verdict.gap > 0)
    tie = TIE if config.state_dtype == "float32" else BF16_STATE_TIE
    for i in off[:10]:
        kind = "tie" if verdict.gap[i] <= tie else "MISMATCH"
        print(f"{kind}: request {verdict.where[i][0]}, new token {verdict.where[i][1]}: the "
              f"stock logit of the chosen token is {verdict.gap[i]:.1e} below the top")
    wrong = int(np.sum(verdict.gap > tie))
    if wrong:
        print(f"check: FAILED, {wrong} of {made} tokens are not plain greedy decoding's "
              f"choice with the stock per-token recurrence ({took:.1f} s)")
        return 1, run.accepted / max(run.row_steps, 1)
    if len(off):
        rounded = "" if config.state_dtype == "float32" else " and the bf16 state's roundings"
        print(f"check: OK up to ties, {made - len(off)} of {made} tokens are plain greedy "
              f"decoding's choice with the stock per-token recurrence after the same prefix; "
              f"the other {len(off)} within {tie} of it, ties that the two recurrences' "
              f"allowed FP32 rounding differences{rounded} break either way ({took:.1f} s)")
    else:
        print(f"check: OK, all {made} tokens equal plain greedy decoding with the stock "
              f"per-token recurrence, token for token ({took:.1f} s)")
    kept = verdict.gap == 0
    tight = np.flatnonzero(kept)[np.argmin(verdict.margin[kept])]
    loose = np.argmax(verdict.drift)
    print(f"margins: smallest top-1/top-2 logit margin {verdict.margin[tight]:.1e} (the two "
          f"runs' top logits differ there by {verdict.drift[tight]:.1e}); largest difference "
          f"{verdict.drift[loose]:.1e} (margin there {verdict.margin[loose]:.1e})")
    return 0, run.accepted / max(run.row_steps, 1)


if __name__ == "__main__":
    sys.exit(main())
