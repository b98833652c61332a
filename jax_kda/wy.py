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


def tree_pair_products(q, k, d, parents, strict):
    """(gamma, A, Bm) of a tree (`tree.node_parents`' parents [B, T]; strict: its
    `tree.ancestor_mask`): gamma_t the product of the decays on node t's path; A[t, s]
    (s a strict ancestor of t) and Bm[t, s] (s an ancestor of t or t) with P(s, t) the
    product of the decays of the nodes on t's path after s, as the stock loop applies
    them; zero off the paths."""
    B, H, T, K = d.shape
    gamma, pairs = [d[:, :, 0]], [jnp.ones((B, H, T, K), d.dtype)]  # node 0: no ancestor
    for t in range(1, T):  # node t's parent is a node before it: its columns are made
        at = parents[:, t, None, None, None]
        before = jnp.take_along_axis(jnp.stack(gamma, axis=2), at, axis=2)[:, :, 0]
        above = jnp.take_along_axis(jnp.stack(pairs, axis=3), at[..., None], axis=3)
        gamma.append(d[:, :, t] * before)
        # P[s, t] = d_t P[s, parent(t)] for s a strict ancestor of t, 1 elsewhere
        ancestor = strict[:, None, t, :, None]  # [B, 1, s, 1]
        pairs.append(jnp.where(ancestor, d[:, :, t, None] * above[..., 0, :], 1.0))
    decayed_keys = k[:, :, :, None] * jnp.stack(pairs, axis=3)  # [B, H, s, t, K]
    A = jnp.einsum("bhstc,bhtc->bhts", decayed_keys, k, precision=HIGHEST)
    Bm = jnp.einsum("bhstc,bhtc->bhts", decayed_keys, q, precision=HIGHEST)
    on_path = strict | jnp.eye(T, dtype=bool)
    return (jnp.stack(gamma, axis=2), jnp.where(strict[:, None], A, 0.0),
            jnp.where(on_path[:, None], Bm, 0.0))


def verify(state, q, k, v, beta, d, parents=None):
    """(u, o) of T tokens from `state`: u [B, H, T, K] f32, o [B, H, T, K] bf16 values.

    The K state rows are the right-hand sides of one T x T unit lower-triangular solve;
    the state is read by 2T dot products per row and never updated. parents: a tree's
    ([B, T], `tree.node_parents`), each node then verified along its own path only (a
    bad value in one branch reaches no other); None: a chain.
    """
    T = k.shape[2]
    if parents is None:
        strict = lower_mask(T, strict=True)
        gamma = jax.lax.cumprod(d, axis=2)
        A, Bm = pair_products(q, k, d)
    else:
        strict = ancestor_mask(parents)  # [B, t, s]
        gamma, A, Bm = tree_pair_products(q, k, d, parents, strict)
        strict = strict[:, None]
    w = jnp.einsum("bhrc,bhtc->bhtr", state, gamma * k, precision=HIGHEST)
    y = jnp.einsum("bhrc,bhtc->bhtr", state, gamma * q, precision=HIGHEST)
    u = solve_unit_lower(beta[..., None] * A, beta[..., None] * (v - w), strict)
    o = y + masked_product(Bm, u, strict | jnp.eye(T, dtype=bool))
    return u, round_bf16(o)


def replay(state, u, kn, d):
    """S_n from S_0 and n recorded tokens in closed form; u, kn, d: [B, H, N, K] with
    tokens past n given as u = 0, kn = 0, d = 1 (so one expression serves every n)."""
    from_t = jax.lax.cumprod(d, axis=2, reverse=True)  # prod_{s>=t} d_s
    after_t = jnp.concatenate([from_t[:, :, 1:], jnp.ones_like(d[:, :, :1])], axis=2)
    return state * from_t[:, :, :1] + jnp.einsum(
        "bhtr,bhtc->bhrc", u, kn * after_t, precision=HIGHEST)
