"""Triangular products and solves of the WY forms, in which a row never reads a row it
does not depend on.

In a lower-triangular product L x, row t depends on rows s <= t of x only; a matrix
product still multiplies the zeros above the diagonal by the later rows, and 0 * NaN or
0 * inf is NaN: one bad token would poison every token of its chunk, its records and the
state a later step replays (docs/spec.md, "Bad values"). Here the left-out terms are
selected away, never multiplied by zero, so a non-finite value in token s reaches only
the rows that the stock per-token recurrence lets it reach. Each row is one dot over the
rows before it: a dot's result does not depend on the program around it, where XLA's
fusion of written-out sums does (FMA contraction), and the references and the backends
must give the same bits in a scan over layers as in a call per layer. Shapes:
[..., T, T] matrices (row t, column s) and [..., T, K] right-hand sides; a mask is
lower triangular (it names s <= t only) and broadcasts against the matrices.
"""
from __future__ import annotations

import jax.numpy as jnp

from jax_kda.layer import HIGHEST


def lower_mask(size: int, *, strict: bool = False):
    """[size, size] bool: s <= t (s < t where strict) at [t, s]."""
    t, s = jnp.arange(size)[:, None], jnp.arange(size)[None, :]
    return s < t if strict else s <= t


def row_dot(weights, x, mask, t: int, width: int):
    """sum of weights[t, s] x_s over the s < width where mask[t, s]: one dot over x's
    first `width` rows, those outside the mask selected to 0 first."""
    rows = jnp.where(mask[..., t, :width, None], x[..., :width, :], 0.0)
    return jnp.einsum("...s,...sk->...k", weights[..., t, :width], rows, precision=HIGHEST)


def masked_product(weights, x, mask):
    """[..., T, K]: row t = the sum of weights[t, s] x_s over the s <= t where
    mask[t, s], the other rows never read."""
    T = x.shape[-2]
    return jnp.stack([row_dot(weights, x, mask, t, t + 1) for t in range(T)], axis=-2)


def lower_product(lower, x, block: int):
    """lower x for lower [..., C, C] lower triangular (its diagonal included): the
    diagonal blocks of `block` rows by `masked_product`, all blocks at once, the
    blocks left of them by matrix products (every row of those is before every row of
    the block). C a multiple of block, or smaller than it (one block)."""
    C = lower.shape[-1]
    block = min(block, C)
    n = C // block
    blocks = x.reshape(x.shape[:-2] + (n, block, x.shape[-1]))
    diagonal = masked_product(diagonal_blocks(lower, block), blocks, lower_mask(block))
    rows = [diagonal[..., 0, :, :]]
    for i in range(1, n):
        here = slice(i * block, (i + 1) * block)
        rows.append(diagonal[..., i, :, :] + jnp.einsum(
            "...ts,...sr->...tr", lower[..., here, :i * block], x[..., :i * block, :],
            precision=HIGHEST))
    return jnp.concatenate(rows, axis=-2)


def solve_unit_lower(N, b, mask):
    """x [..., T, K] with x_t = b_t - sum of N[t, s] x_s over the s < t where mask[t, s]:
    (I + N) x = b by forward substitution, in order of t. Each row reads only the rows
    its mask names, and rounds as forward substitution does (a blocked triangular
    solve rounds about twice as far from exact)."""
    rows = [b[..., 0, :]]
    for t in range(1, b.shape[-2]):
        rows.append(b[..., t, :] - row_dot(N, jnp.stack(rows, axis=-2), mask, t, t))
    return jnp.stack(rows, axis=-2)


def unit_lower_inverse(N):
    """(I + N)^-1 for N [..., C, C] strictly lower triangular, C a power of two.

    Blocks of up to 16 rows by forward substitution (each row an expression of the rows
    above it, for all blocks at once), then blocks of twice the size from their halves,
    [[A, 0], [G, D]]^-1 = [[A^-1, 0], [-D^-1 G A^-1, D^-1]]: blocked substitution, whose
    intermediates stay the size of the inverse's entries (a product of powers of N would
    not). A row of the inverse reads only the rows of N at or above it."""
    C = N.shape[-1]
    size = min(16, C)
    blocks = diagonal_blocks(N, size)
    eye = jnp.eye(size, dtype=N.dtype)
    rows = []
    for i in range(size):
        row = jnp.broadcast_to(eye[i], blocks.shape[:-2] + (size,))
        for j in range(i):
            row = row - blocks[..., i, j, None] * rows[j]
        rows.append(row)
    inverse = jnp.stack(rows, axis=-2)  # [..., C / size, size, size]
    while size < C:
        pairs = inverse.reshape(inverse.shape[:-3] + (inverse.shape[-3] // 2, 2, size, size))
        first, second = pairs[..., 0, :, :], pairs[..., 1, :, :]
        coupling = diagonal_blocks(N, 2 * size)[..., size:, :size]
        # every row of `coupling` is after every row of `first`
        carried = jnp.einsum("...ts,...sr->...tr", coupling, first, precision=HIGHEST)
        below = -lower_product(second, carried, 16)
        inverse = jnp.concatenate([
            jnp.concatenate([first, jnp.zeros_like(first)], axis=-1),
            jnp.concatenate([below, second], axis=-1)], axis=-2)
        size *= 2
    return inverse.reshape(N.shape)


def diagonal_blocks(N, size):
    """[..., C / size, size, size]: the diagonal blocks of N [..., C, C]."""
    n = N.shape[-1] // size
    blocks = N.reshape(N.shape[:-2] + (n, size, n, size))
    return jnp.stack([blocks[..., i, :, i, :] for i in range(n)], axis=-3)
