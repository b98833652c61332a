"""The stock per-token recurrence, replay and verify each a `jax.lax.scan` over tokens:
nothing clever, the ground truth every fast path is held against, run by the same step
drivers as the XLA backend (`jax_kda.steps`). Same signatures as `fused_verify` and
`jax_kda.prefill`."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_kda.config import KdaConfig
from jax_kda.layer import HIGHEST, round_bf16, token_vectors
from jax_kda.pytrees import KdaCache, KdaParams, PrefillInputs, VerifyInputs
from jax_kda.steps import prompt_step, verify_step
from jax_kda.validate import check_prefill, check_verify


def stock_step(S, token):
    """One token of the stock recurrence: (S, (q, k, v, d, beta)) -> (S, (u, bf16 o)),
    vectors [B, H, K], beta [B, H]."""
    q, k, v, d, beta = token
    S = S * d[:, :, None, :]
    u = beta[..., None] * (v - jnp.einsum("bhrc,bhc->bhr", S, k, precision=HIGHEST))
    S = S + u[..., :, None] * k[..., None, :]
    o = jnp.einsum("bhrc,bhc->bhr", S, q, precision=HIGHEST)
    return S, (u, round_bf16(o))


def per_token(a):
    """[B, H, T, ...] -> [T, B, H, ...], the scan's leading axis."""
    return jnp.moveaxis(a, 2, 0)


def stock_replay(state, replay):
    """S_n: the recorded tokens folded in one per scan step."""

    def replay_step(S, token):
        u, kn, d = token  # each [B, H, K]
        return S * d[:, :, None, :] + u[..., :, None] * kn[..., None, :], None

    return jax.lax.scan(replay_step, state, tuple(map(per_token, replay)))[0]


def stock_recurrence(state, replay, tokens):
    """Replay then verify, one token per scan step (a tree: each node from its parent's
    state, one node at a time): (S_n, u, o)."""
    state_n = stock_replay(state, replay)
    operands = tuple(map(per_token, (tokens.q, tokens.k, tokens.v, tokens.d, tokens.beta)))
    if tokens.parents is not None:
        u, o = stock_tree(state_n, operands, tokens.parents)
        return state_n, u, o
    _, (u, o) = jax.lax.scan(stock_step, state_n, operands)
    return state_n, jnp.moveaxis(u, 0, 2), jnp.moveaxis(o, 0, 2)


def stock_tree(state, operands, parents):
    """The stock step of each node of a tree from its parent's state (node 0's from
    `state`), the plain way: every node's state kept. operands: per_token's (q, k, v, d,
    beta); parents: [B, T] (`tree.node_parents`). Returns (u, o) [B, H, T, K]."""
    states, us, os = [], [], []
    for t, token in enumerate(zip(*operands)):
        before = state
        if t:  # node t >= 1's parent is a node before it
            at = parents[:, t, None, None, None, None]
            before = jnp.take_along_axis(jnp.stack(states, axis=2), at, axis=2)[:, :, 0]
        S, (u, o) = stock_step(before, token)
        states.append(S)
        us.append(u)
        os.append(o)
    return jnp.stack(us, axis=2), jnp.stack(os, axis=2)


def stock_verify(params: KdaParams, cache: KdaCache, inputs: VerifyInputs,
                 config: KdaConfig, *, layer=None):
    """`fused_verify` with the stock per-token recurrence (docs/spec.md): the ground
    truth. Returns (out [B, T, H, K] bf16, cache). Not jitted; wrap it in `jax.jit`
    with `static_argnames="config"` to run it fast."""
    _, layer = check_verify(params, cache, inputs, config, layer)
    return verify_step(params, cache, inputs, config, layer, stock_recurrence)


def stock_prefill_recurrence(state, replay, params, prompt, config):
    """The kept records folded in, then the prompt, one token per scan step: (state, o)."""
    q, k, v, beta, d = token_vectors(params, prompt, config)
    state, (_, o) = jax.lax.scan(stock_step, stock_replay(state, replay),
                                 tuple(map(per_token, (q, k, v, d, beta))))
    return state, jnp.moveaxis(o, 0, 2)


def stock_prefill(params: KdaParams, cache: KdaCache, inputs: PrefillInputs,
                  config: KdaConfig, *, layer=None):
    """`jax_kda.prefill` with the stock per-token recurrence: the ground truth.
    Returns (out [B, P, H, K] bf16, cache). Not jitted, like `stock_verify`."""
    layer = check_prefill(params, cache, inputs, config, layer)
    return prompt_step(params, cache, inputs, config, layer, stock_prefill_recurrence)
