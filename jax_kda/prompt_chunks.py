"""The recurrence over a long prompt in chunks of C tokens (WY form), as dense matrix
products: what `jax_kda.prefill` runs.

With P(s, t) = prod_{s<r<=t} d_r, Gamma_t = P(-1, t) and Gamma_C the whole chunk's
decays, the stock recurrence over a chunk from its starting state S is
(`jax_kda.wy`):

    A_ts = sum_c k_s,c k_t,c P(s, t)_c  (s < t),  Bm_ts = the same with q_t (s <= t)
    (I + diag(beta) A) u = diag(beta) (v - (Gamma * k) S^T)
    o = (Gamma * q) S^T + Bm u,   S' = S diag(Gamma_C) + u^T (k * P(t, C))

Everything but S is known before the chunks run (`chunk_operands`, or its CuTe DSL
twin): the solve's two right-hand sides (v and Gamma * k) are solved for every chunk at
once, by each chunk's explicit inverse (`unit_lower_inverse`: matrix products rather
than a batched triangular solve, see docs/performance.md), and the scan over chunks
carries only S through three products: u from S, o's inter-chunk part, the next S
(`scan_chunks`, or its CuTe DSL twin).

P(s, t) is split around a reference token m as P(m, t) P(s, m), so that A and Bm are
matrix products too: for t in a block and s before it, m is the token before the block;
inside a block, m is the token before it as well, P(s, t) = (prod_{m<r<=t} d_r) /
(prod_{m<r<=s} d_r), the blocks short enough that both factors stay within 2^+-60
(`pair_block`). Every factor is a product of decays, as the stock loop applies them (a
difference of cumulative log decays would lose their low bits), and reads only decays
up to its later token: a non-finite value in token j reaches no pair, solve row or
output of a token before j (`jax_kda.triangular`). Shapes: per-token vectors
[B, H, P, K], beta [B, H, P], S [B, H, K, K] (value row, key column), as in
`jax_kda.wy`.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jax_kda.layer import HIGHEST, round_bf16
from jax_kda.triangular import lower_mask, lower_product, unit_lower_inverse

CHUNK = 64  # tokens per chunk: the scan's steps are P / CHUNK
SUBCHUNK = 16  # the operands kernel's sub-chunk, fewer where the decays are steep
EXPONENT_LIMIT = 60.0 * math.log(2.0)  # largest |log| of one factor of a pair's


def subchunk(lower_bound: float | None) -> int:
    """The sub-chunk size c (a power of two <= SUBCHUNK): c / 2 tokens of decays at the
    bound make one factor of a pair at most 2^60 (both factors stay far from FP32's
    range, and their product is the pair's), around a sub-chunk's middle token as the
    operands kernel splits them. 1 for the softplus gate (None), whose decays have no
    bound."""
    if lower_bound is None:
        return 1
    c = SUBCHUNK
    while c > 1 and (c / 2) * -lower_bound > EXPONENT_LIMIT:
        c //= 2
    return c


def mm(spec, *arrays):
    return jnp.einsum(spec, *arrays, precision=HIGHEST)


def suffix_products(d):
    """prod_{r>t} d_r along the chunk's tokens (1 at the last), as products, never
    quotients (a prefix product may underflow)."""
    from_t = jax.lax.cumprod(d, axis=d.ndim - 2, reverse=True)
    return jnp.concatenate([from_t[..., 1:, :], jnp.ones_like(d[..., :1, :])], axis=-2)


def pair_block(lower_bound: float | None) -> int:
    """Tokens per block of `block_pair_products` (a power of two <= SUBCHUNK / 2): the decays of
    a block at the bound multiply to at least 2^-60, so a pair's factors, measured from
    the token before its block, stay within 2^+-60. One token where a single decay may
    fall below that: its only pair inside the block is itself."""
    return max(1, subchunk(lower_bound) // 2)


def block_pair_products(q, k, d, block):
    """A [.., C, C] (A[t, s], s < t) and Bm [.., C, C] (Bm[t, s], s <= t) of each chunk.

    q, k, d: [.., C, K]. A pair's factor prod_{s<r<=t} d_r is split around the token m
    before t's block as (prod_{m<r<=t} d_r) (prod_{s<r<=m} d_r), or, s in the block too,
    (prod_{m<r<=t} d_r) / (prod_{m<r<=s} d_r), each factor within 2^+-60 (`pair_block`)."""
    C = k.shape[-2]
    A = jnp.zeros(k.shape[:-1] + (C,), jnp.float32)
    Bm = jnp.zeros_like(A)
    for start in range(0, C, block):
        rows = slice(start, start + block)
        local = jax.lax.cumprod(d[..., rows, :], axis=d.ndim - 2)  # prod_{start<=r<=t} d_r
        if block == 1:  # the pair (t, t): no decay between
            right, left = jnp.ones_like(local), k[..., rows, :]
        else:
            right, left = local, k[..., rows, :] / local
        A = A.at[..., rows, rows].set(mm("...tc,...sc->...ts", k[..., rows, :] * right, left))
        Bm = Bm.at[..., rows, rows].set(mm("...tc,...sc->...ts", q[..., rows, :] * right,
                                           left))
        if start:  # the pairs with every earlier token, around the last one before
            before = k[..., :start, :] * suffix_products(d[..., :start, :])
            A = A.at[..., rows, :start].set(mm("...tc,...sc->...ts", k[..., rows, :] * local,
                                               before))
            Bm = Bm.at[..., rows, :start].set(mm("...tc,...sc->...ts",
                                                 q[..., rows, :] * local, before))
    return (jnp.where(lower_mask(C, strict=True), A, 0.0),
            jnp.where(lower_mask(C), Bm, 0.0))


def live_chunks(lengths, chunk: int):
    """Each request's chunks that hold its tokens, ceil(lengths / chunk) [B] (lengths
    clamped below at 0): the chunks after them are identities, which the scans skip."""
    return (jnp.maximum(lengths, 0) + chunk - 1) // chunk


def scan_chunks(state, u_v, w_k, gq, tail, decay, bm, lengths=None, *, unroll: int = 4):
    """The chunks in order from `state`, in XLA: (state after them [B, H, K, K],
    o [B, H, N, C, K] FP32) from u_v, w_k, gq, tail [B, H, N, C, K], decay [B, H, N, K]
    and bm [B, H, N, C, C] (`through_chunks`; the CuTe DSL kernel
    `jax_kda.ffi.cutedsl_chunk_states` is its twin). lengths [B] int32: each request's
    tokens; its chunks past them do not reach its state, whatever they hold (o there is
    undefined); None: every chunk counts. unroll: scan steps per loop trip (a GPU's
    while loop returns to the host every trip)."""
    B, _, N, C, _ = w_k.shape
    live = jnp.full((B,), N) if lengths is None else live_chunks(lengths, C)

    def step(S, operands):
        u_v, w_k, gq, tail, decay, n = operands
        u = u_v - mm("...tc,...rc->...tr", w_k, S)
        inter = mm("...tc,...rc->...tr", gq, S)
        advanced = S * decay[..., None, :] + mm("...tr,...tc->...rc", u, tail)
        S = jnp.where((n < live)[:, None, None, None], advanced, S)
        return S, (u, inter)

    per_chunk = lambda a: jnp.moveaxis(a, 2, 0)  # the scan's leading axis
    state, (u, inter) = jax.lax.scan(
        step, state, tuple(map(per_chunk, (u_v, w_k, gq, tail, decay))) + (jnp.arange(N),),
        unroll=max(1, min(unroll, N)))
    u, inter = jnp.moveaxis(u, 0, 2), jnp.moveaxis(inter, 0, 2)
    return state, inter + lower_product(bm, u, SUBCHUNK)


class Operands(NamedTuple):
    """A prompt's chunk operands, FP32: u_v, w_k (the solve's two sides), gq (Gamma q),
    tail (k_t prod_{r>t} d_r) [B, H, N, C, K], decay (Gamma_C) [B, H, N, K], bm (Bm)
    [B, H, N, C, C]."""

    u_v: jax.Array
    w_k: jax.Array
    gq: jax.Array
    tail: jax.Array
    decay: jax.Array
    bm: jax.Array


def chunk_operands(q, k, v, beta, d, *, lower_bound: float | None, chunk: int | None = None
                   ) -> Operands:
    """The chunks' operands of a prompt (in XLA; `jax_kda.ffi.cutedsl_chunk_operands` is
    its kernel). q, k, v, d: [B, H, P, K]; beta: [B, H, P]. Tokens past a prompt are
    identities (d = 1, beta = 0) and P is padded with them to whole chunks.
    lower_bound: the config's (every log decay lies in [lower_bound, 0]; None: no bound);
    chunk: tokens per chunk (default `chunk_size`, at most 16 blocks of `pair_block`: the
    pair products' graph grows with their count)."""
    B, H, P = beta.shape
    K = k.shape[-1]
    chunk = chunk or chunk_size(lower_bound)
    pad = -P % chunk
    N = (P + pad) // chunk
    widths = lambda a: ((0, 0), (0, 0), (0, pad)) + ((0, 0),) * (a.ndim - 3)
    # [B, H, P, ...] -> [B, H, N, chunk, ...]; padded tokens are identities
    split = lambda a, fill: jnp.pad(a, widths(a), constant_values=fill).reshape(
        (B, H, N, chunk) + a.shape[3:])
    q, k, v, beta, d = (split(q, 0.0), split(k, 0.0), split(v, 0.0), split(beta, 0.0),
                        split(d, 1.0))
    A, Bm = block_pair_products(q, k, d, pair_block(lower_bound))
    gamma = jax.lax.cumprod(d, axis=3)  # prod_{r<=t} d_r
    # u = u_v - w_k S^T, both solved for every chunk at once
    rhs = beta[..., None] * jnp.concatenate([v, gamma * k], axis=-1)
    solved = lower_product(unit_lower_inverse(beta[..., None] * A), rhs, SUBCHUNK)
    tail = k * suffix_products(d)  # k_t prod_{r>t} d_r
    return Operands(solved[..., :K], solved[..., K:], gamma * q, tail, gamma[..., -1, :], Bm)


def through_chunks(state, operands: Operands, lengths, tokens: int, *, scan=scan_chunks):
    """The prompts from `state` through their chunk operands: (state after them
    [B, H, K, K], o [B, H, tokens, K] bf16 values, undefined past each prompt's length).
    lengths [B]: the prompts' tokens (`scan_chunks`); tokens: P. scan: `scan_chunks` or
    its kernel."""
    state, o = scan(state, *operands, lengths)
    B, H, N, C, K = o.shape
    return state, round_bf16(o).reshape(B, H, N * C, K)[:, :, :tokens]


def chunk_size(lower_bound: float | None) -> int:
    """Tokens per chunk: CHUNK, or 8 sub-chunks where the decays are steep; for the
    softplus gate (None) 16 blocks of one token, the most `chunk_operands` takes and the
    scan kernel's smallest chunk."""
    if lower_bound is None:
        return 16
    return min(CHUNK, 8 * subchunk(lower_bound))


def operands_kernel_fits(lower_bound: float | None) -> bool:
    """Whether the operands' kernel (chunks of CHUNK, sub-chunks of SUBCHUNK) runs at
    this lower_bound (>= about -5.2)."""
    return subchunk(lower_bound) == SUBCHUNK and chunk_size(lower_bound) == CHUNK
