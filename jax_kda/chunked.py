"""The recurrence in chunked (WY) form: the verify of T tokens from a state that is
only read, and the closed-form replay of recorded tokens into the checkpoint.

With the stock per-token recurrence S <- S diag(d_t); u_t = beta_t (v_t - S k_t);
S <- S + u_t k_t^T; o_t = S q_t, and Gamma_t = prod_{r<=t} d_r,
P(s, t) = prod_{s<r<=t} d_r (products taken in token order, never as quotients):

    w_t = S (Gamma_t * k_t),  y_t = S (Gamma_t * q_t)
    A_ts = k_s . (P(s, t) * k_t)  (s < t),  B_ts = k_s . (P(s, t) * q_t)  (s <= t)
    u_t = beta_t (v_t - w_t - sum_{s<t} A_ts u_s),  o_t = y_t + sum_{s<=t} B_ts u_s

and after n tokens S_n = S diag(D_n) + sum_{t<n} u_t (k_t * P_t)^T with D_n the product
of all n decays and P_t = prod_{t<s<n} d_s. Shapes: S [B, H, K, K] (value row, key
column); per-token vectors [B, H, T, K]; beta [B, H, T].
"""
from __future__ import annotations

import jax.numpy as jnp

from jax_kda.layer import HIGHEST, round_bf16


def pair_products(q, k, d):
    """A [B, H, T, T] (A[t, s], s < t) and Bm [B, H, T, T] (Bm[t, s], s <= t)."""
    T = k.shape[2]
    zero = jnp.zeros(k.shape[:2], k.dtype)
    A = [[zero] * T for _ in range(T)]
    Bm = [[zero] * T for _ in range(T)]
    for s in range(T):
        Bm[s][s] = jnp.sum(k[:, :, s] * q[:, :, s], axis=-1)
        weighted = k[:, :, s]
        for t in range(s + 1, T):
            weighted = weighted * d[:, :, t]
            A[t][s] = jnp.sum(weighted * k[:, :, t], axis=-1)
            Bm[t][s] = jnp.sum(weighted * q[:, :, t], axis=-1)
    stack = lambda rows: jnp.stack([jnp.stack(r, axis=-1) for r in rows], axis=-2)
    return stack(A), stack(Bm)


def decayed(x, d):
    """Gamma_t * x_t with Gamma_t = d_0 d_1 ... d_t (sequential products)."""
    gamma, out = None, []
    for t in range(x.shape[2]):
        gamma = d[:, :, t] if gamma is None else gamma * d[:, :, t]
        out.append(gamma * x[:, :, t])
    return jnp.stack(out, axis=2)


def verify(state, q, k, v, beta, d):
    """(u, o) of T tokens from `state`: u [B, H, T, K] f32, o [B, H, T, K] bf16 values.

    Every state row solves its own T x T lower-triangular system, by forward
    substitution; the state is read by 2T dot products per row and never updated.
    """
    T = k.shape[2]
    w = jnp.einsum("bhrc,bhtc->bhtr", state, decayed(k, d), precision=HIGHEST)
    y = jnp.einsum("bhrc,bhtc->bhtr", state, decayed(q, d), precision=HIGHEST)
    A, Bm = pair_products(q, k, d)
    u = []
    for t in range(T):
        total = w[:, :, t]
        for s in range(t):
            total = total + A[:, :, t, s, None] * u[s]
        u.append((v[:, :, t] - total) * beta[:, :, t, None])
    o = []
    for t in range(T):
        total = y[:, :, t]
        for s in range(t + 1):
            total = total + Bm[:, :, t, s, None] * u[s]
        o.append(round_bf16(total))
    return jnp.stack(u, axis=2), jnp.stack(o, axis=2)


def replay(state, u, kn, d):
    """S_n from S_0 and n recorded tokens in closed form; u, kn, d: [B, H, N, K] with
    tokens past n given as u = 0, kn = 0, d = 1 (so one expression serves every n)."""
    suffix = jnp.ones_like(d[:, :, 0])
    weighted = [None] * d.shape[2]
    for t in reversed(range(d.shape[2])):
        weighted[t] = kn[:, :, t] * suffix
        suffix = suffix * d[:, :, t]
    kp = jnp.stack(weighted, axis=2)
    return state * suffix[:, :, None, :] + jnp.einsum(
        "bhtr,bhtc->bhrc", u, kp, precision=HIGHEST)
