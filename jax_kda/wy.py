"""The recurrence in chunked (WY) form: the verify of T tokens from a state that is
only read, and the closed-form replay of recorded tokens into the checkpoint.

With the stock per-token recurrence S <- S diag(d_t); u_t = beta_t (v_t - S k_t);
S <- S + u_t k_t^T; o_t = S q_t, and Gamma_t = prod_{r<=t} d_r,
P(s, t) = prod_{s<r<=t} d_r (products of the d_r themselves, never quotients):

    w_t = S (Gamma_t * k_t),  y_t = S (Gamma_t * q_t)
    A_ts = k_s . (P(s, t) * k_t)  (s < t),  B_ts = k_s . (P(s, t) * q_t)  (s <= t)
    u_t = beta_t (v_t - w_t - sum_{s<t} A_ts u_s),  o_t = y_t + sum_{s<=t} B_ts u_s

and after n tokens S_n = S diag(D_n) + sum_{t<n} u_t (k_t * P_t)^T with D_n the product
of all n decays and P_t = prod_{t<s<n} d_s. Shapes: S [B, H, K, K] (value row, key
column); per-token vectors [B, H, T, K]; beta [B, H, T].

P is a cumulative product along t of d masked to 1 for r <= s (a [B, H, T, T, K] array;
a quotient Gamma_t / Gamma_s would underflow over a long chunk); u solves the unit
lower-triangular (I + diag(beta) A) u = diag(beta) (v - w) by forward substitution,
whose right-hand sides are the K state rows. Token t reads only tokens s <= t
(`jax_kda.triangular`): a non-finite value in a draft reaches no earlier token.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_kda.layer import HIGHEST, round_bf16
from jax_kda.tree import ancestor_mask
from jax_kda.triangular import lower_mask, masked_product, solve_unit_lower


def pair_decays(d):
    """P [B, H, T, T, K]: P[s, t] = prod_{s<r<=t} d_r for s <= t (1 on the diagonal and,
    unused, above it)."""
    T = d.shape[2]
    s, r = jnp.arange(T)[:, None], jnp.arange(T)[None, :]
    return jax.lax.cumprod(jnp.where((r > s)[..., None], d[:, :, None], 1.0), axis=3)


def pair_products(q, k, d):
    """A [B, H, T, T] (A[t, s], s < t) and Bm [B, H, T, T] (Bm[t, s], s <= t)."""
    T = k.shape[2]
    decayed_keys = k[:, :, :, None] * pair_decays(d)  # [B, H, s, t, K]
    A = jnp.einsum("bhstc,bhtc->bhts", decayed_keys, k, precision=HIGHEST)
    Bm = jnp.einsum("bhstc,bhtc->bhts", decayed_keys, q, precision=HIGHEST)
    return (jnp.where(lower_mask(T, strict=True), A, 0.0),
            jnp.where(lower_mask(T), Bm, 0.0))


def tree_pair_decays(d, parents):
    """gamma [B, H, T, K] and P [B, H, T, T, K] of a tree (`tree.node_parents`'
    parents [B, T]): gamma_t the product of the decays on node t's path, P[s, t] that of
    the nodes on t's path after s, for s an ancestor of t or t itself (1 elsewhere), each
    a product of decays as the stock loop applies them."""
    B, H, T, K = d.shape
    on_path = ancestor_mask(parents) | jnp.eye(T, dtype=bool)  # [B, t, s]
    gamma, pairs = [], []
    for t in range(T):
        parent = parents[:, t]
        at = jnp.clip(parent, 0, max(t - 1, 0))[:, None, None, None]
        if t:
            before = jnp.take_along_axis(jnp.stack(gamma, axis=2), at, axis=2)[:, :, 0]
            above = jnp.take_along_axis(jnp.stack(pairs, axis=3), at[..., None], axis=3)[..., 0, :]
        else:
            before, above = jnp.ones_like(d[:, :, 0]), jnp.ones((B, H, T, K), d.dtype)
        first = (parent < 0)[:, None, None]
        gamma.append(d[:, :, t] * jnp.where(first, 1.0, before))
        # P[s, t] = d_t P[s, parent(t)] for s a strict ancestor; 1 for s = t and off the path
        ancestor = (on_path[:, t] & (jnp.arange(T) != t))[:, None, :, None]  # [B, 1, s, 1]
        pairs.append(jnp.where(ancestor, d[:, :, t, None] * jnp.where(first[..., None], 1.0,
                                                                     above), 1.0))
    return jnp.stack(gamma, axis=2), jnp.stack(pairs, axis=3)


def tree_pair_products(q, k, d, parents):
    """A [B, H, T, T] (A[t, s], s a strict ancestor of t), Bm [B, H, T, T] (Bm[t, s], s
    an ancestor of t or t) and gamma of a tree; zero off the paths."""
    gamma, P = tree_pair_decays(d, parents)
    decayed_keys = k[:, :, :, None] * P  # [B, H, s, t, K]
    A = jnp.einsum("bhstc,bhtc->bhts", decayed_keys, k, precision=HIGHEST)
    Bm = jnp.einsum("bhstc,bhtc->bhts", decayed_keys, q, precision=HIGHEST)
    strict = ancestor_mask(parents)[:, None]  # [B, 1, t, s]
    on_path = strict | jnp.eye(k.shape[2], dtype=bool)
    return jnp.where(strict, A, 0.0), jnp.where(on_path, Bm, 0.0), gamma


def verify(state, q, k, v, beta, d, parents=None):
    """(u, o) of T tokens from `state`: u [B, H, T, K] f32, o [B, H, T, K] bf16 values.

    The K state rows are the right-hand sides of one T x T unit lower-triangular solve;
    the state is read by 2T dot products per row and never updated. parents: a tree's
    ([B, T], `tree.node_parents`), each node then verified along its own path; None: a
    chain.
    """
    if parents is not None:
        return _tree_verify(state, q, k, v, beta, d, parents)
    gamma = jax.lax.cumprod(d, axis=2)
    w = jnp.einsum("bhrc,bhtc->bhtr", state, gamma * k, precision=HIGHEST)
    y = jnp.einsum("bhrc,bhtc->bhtr", state, gamma * q, precision=HIGHEST)
    A, Bm = pair_products(q, k, d)
    T = k.shape[2]
    u = solve_unit_lower(beta[..., None] * A, beta[..., None] * (v - w),
                         lower_mask(T, strict=True))
    o = y + masked_product(Bm, u, lower_mask(T))
    return u, round_bf16(o)


def _tree_verify(state, q, k, v, beta, d, parents):
    """`verify` of a tree: gamma, the pairs, the solve and o over each node's path only
    (`tree.ancestor_mask`), so that a bad value in one branch reaches no other."""
    A, Bm, gamma = tree_pair_products(q, k, d, parents)
    w = jnp.einsum("bhrc,bhtc->bhtr", state, gamma * k, precision=HIGHEST)
    y = jnp.einsum("bhrc,bhtc->bhtr", state, gamma * q, precision=HIGHEST)
    strict = ancestor_mask(parents)[:, None]
    u = solve_unit_lower(beta[..., None] * A, beta[..., None] * (v - w), strict)
    o = y + masked_product(Bm, u, strict | jnp.eye(k.shape[2], dtype=bool))
    return u, round_bf16(o)


def replay(state, u, kn, d):
    """S_n from S_0 and n recorded tokens in closed form; u, kn, d: [B, H, N, K] with
    tokens past n given as u = 0, kn = 0, d = 1 (so one expression serves every n)."""
    from_t = jax.lax.cumprod(d, axis=2, reverse=True)  # prod_{s>=t} d_s
    after_t = jnp.concatenate([from_t[:, :, 1:], jnp.ones_like(d[:, :, :1])], axis=2)
    return state * from_t[:, :, :1] + jnp.einsum(
        "bhtr,bhtc->bhrc", u, kn * after_t, precision=HIGHEST)
