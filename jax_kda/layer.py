"""The pointwise pieces of a KDA layer at the stock rounding points (docs/spec.md, steps
2-6), and the token preparation built of them (a step's or a prompt's tokens convolved,
projected, normalized), shared by every JAX path: the stock reference, the XLA backend,
flush and prefill.

Arrays are FP32 unless named otherwise; "bf16 values" means FP32 arrays holding values
that were rounded to bf16 where the stock layer rounds.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jax_kda.config import CONV_TAPS, K, NORM_EPS, KdaConfig
from jax_kda.pytrees import KdaParams
from jax_kda.tree import nearest_ancestors

HIGHEST = jax.lax.Precision.HIGHEST


def round_bf16(x):
    """x rounded to bf16 (nearest even), kept as FP32. A reduce_precision, because XLA
    on GPUs elides an f32 -> bf16 -> f32 round trip (xla_allow_excess_precision)."""
    return jax.lax.reduce_precision(x, exponent_bits=8, mantissa_bits=7)


def silu(y):
    """The convolution's SiLU y / (1 + exp(-y)), rounded to bf16."""
    return round_bf16(y / (1.0 + jnp.exp(-y)))


def l2_normalize(x, scale=1.0):
    """x / sqrt(sum(x^2) + 1e-6) * scale over the last axis (K channels)."""
    return x / jnp.sqrt(jnp.sum(x * x, axis=-1, keepdims=True) + NORM_EPS) * scale


def decay(raw_g, a_log, dt_bias, lower_bound):
    """d = exp(lower_bound * sigmoid(exp(a_log) * (raw_g + dt_bias))) per key channel, or
    for lower_bound None (the softplus gate) exp(-exp(a_log) * softplus(raw_g + dt_bias)).

    raw_g: [..., H, K] bf16 values; a_log: [H]; dt_bias: [H, K].
    """
    if lower_bound is None:
        return jnp.exp(-jnp.exp(a_log)[:, None] * jax.nn.softplus(raw_g + dt_bias))
    return jnp.exp(lower_bound * jax.nn.sigmoid(jnp.exp(a_log)[:, None] * (raw_g + dt_bias)))


def gate_projection(f_a, f_b, gate_mode):
    """raw_g = bf16(f_a . f_b[h]^T): [B, T, K] x [H, K, K] -> [B, T, H, K] bf16 values.

    gate_mode 0 sums the K rank columns as one chain; 1 as four chains over column
    quarters added ((c0 + c1) + c2) + c3. Each chain is written out as FP32 additions in
    rank order, never a dot: a dot's summation order is the platform's (XLA:CPU's
    differs between CPUs), and a different order can flip a bf16 rounding. Products of
    bf16 values are exact in FP32, so a fused multiply-add rounds as the addition does.
    """
    chains = 4 if gate_mode == 1 else 1
    a = jnp.moveaxis(f_a.astype(jnp.float32), -1, 0)[:, :, :, None, None]  # [K, B, T, 1, 1]
    b = jnp.moveaxis(f_b.astype(jnp.float32), -1, 0)  # [K, H, features]
    width = K // chains
    sums = []
    for first in range(0, K, width):
        total = a[first] * b[first]
        for r in range(first + 1, first + width):
            total = total + a[r] * b[r]
        sums.append(total)
    total = sums[0]
    for part in sums[1:]:
        total = total + part
    return round_bf16(total)


def convolve(history, x, weight, bias, parents=None):
    """The short causal convolution and SiLU of q, k and v.

    history: [B, 3, 3, H, K] bf16 values, the three inputs before x_0 (part, position, ...).
    x: [B, T, 3, H, K] the step's raw inputs. weight: [3, 4, H, K]; bias: [3, H, K] or None.
    parents: None (a chain) or [B, T] int32 (a tree, as `tree.node_parents` reads it):
    tap 3 reads a node's own input, taps 2, 1, 0 its path's before it.
    Returns [B, T, 3, H, K] bf16 values: y_t = bias + sum_i w_i seq_i, taps in order.
    """
    T = x.shape[1]
    seq = jnp.concatenate([jnp.moveaxis(history, 2, 1), x.astype(jnp.float32)], axis=1)
    if parents is None:
        taps = [seq[:, i:i + T] for i in range(CONV_TAPS)]
    else:  # positions in seq: the history at 0..2, node j at j + 3
        reach = nearest_ancestors(parents, CONV_TAPS - 1)  # nearest first
        at = [reach[..., CONV_TAPS - 2 - i] for i in range(CONV_TAPS - 1)]
        at.append(jnp.broadcast_to(jnp.arange(T), parents.shape))
        taps = [jnp.take_along_axis(seq, (a + CONV_TAPS - 1)[:, :, None, None, None], axis=1)
                for a in at]
    weight = weight.astype(jnp.float32)
    y = jnp.zeros(x.shape, jnp.float32) if bias is None else jnp.broadcast_to(
        bias.astype(jnp.float32), x.shape)
    for i in range(CONV_TAPS):
        y = y + weight[:, i] * taps[i]
    return silu(y)


def gated_rmsnorm(o, gate, norm_weight, eps):
    """bf16(o * rsqrt(mean(o^2) + eps) * norm_weight * sigmoid(gate)) over K value rows.

    o: [..., K] bf16 values; gate: [..., K] bf16 logits; norm_weight: [K].
    """
    rstd = jax.lax.rsqrt(jnp.mean(o * o, axis=-1, keepdims=True) + eps)
    gated = jax.nn.sigmoid(gate.astype(jnp.float32))
    return (o * rstd * norm_weight.astype(jnp.float32) * gated).astype(jnp.bfloat16)


class Tokens(NamedTuple):
    """A step's per-token operands. q, k: [B, H, T, K] normalized (q scaled); v:
    [B, H, T, K]; d: [B, H, T, K] decays; beta: [B, H, T]; key, raw_g: [B, T, H, K]
    bf16 values recorded for the next replay; parents: [B, T] int32 of a tree (as
    `tree.node_parents` reads them), None for a chain."""

    q: jax.Array
    k: jax.Array
    v: jax.Array
    d: jax.Array
    beta: jax.Array
    key: jax.Array
    raw_g: jax.Array
    parents: jax.Array | None = None


def convolved(params: KdaParams, x, f_a, history, config: KdaConfig, parents=None):
    """The convolution and SiLU of q, k and v, and the gate projection: (y [B, T, 3, H, K],
    raw_g [B, T, H, K]), bf16 values, token-major. x: [B, T, 3, H, K] bf16; f_a:
    [B, T, K]; history as `cache_rows.read_history` returns it; parents: a tree's
    (`convolve`), None for a chain."""
    return (convolve(history, x, params.conv_weight, params.conv_bias, parents),
            gate_projection(f_a, params.f_b, config.gate_mode))


def normalized(params: KdaParams, y, raw_g, beta, config: KdaConfig,
               parents=None) -> Tokens:
    """The norms, decays and betas of `convolved`'s tokens (beta: [B, T, H] logits);
    parents: a tree's, kept in the `Tokens`."""
    q, key, v = (jnp.swapaxes(y[:, :, i], 1, 2) for i in range(3))  # [B, H, T, K]
    d = decay(raw_g, params.a_log, params.dt_bias, config.lower_bound)
    return Tokens(
        q=l2_normalize(q, config.query_scale),
        k=l2_normalize(key),
        v=v,
        d=jnp.swapaxes(d, 1, 2),
        beta=jax.nn.sigmoid(jnp.swapaxes(beta.astype(jnp.float32), 1, 2)),
        key=jnp.swapaxes(key, 1, 2),
        raw_g=raw_g,
        parents=parents,
    )


def prepare_tokens(params: KdaParams, x, f_a, beta, history, config: KdaConfig,
                   parents=None) -> Tokens:
    """Convolution, SiLU, norms, gate projection, decays and betas of the tokens
    (`convolved`, then `normalized`); parents: a tree's, None for a chain."""
    return normalized(params, *convolved(params, x, f_a, history, config, parents), beta,
                      config, parents)


class Prompt(NamedTuple):
    """A piece's tokens as the layer's pointwise part leaves them, token-major: y
    [B, P, 3, H, K] and raw_g [B, P, H, K] (`convolved`: bf16 values), beta
    [B, P, H] (the logits as given), lengths [B] (clamped to [0, P])."""

    y: jax.Array
    raw_g: jax.Array
    beta: jax.Array
    lengths: jax.Array


def token_vectors(params: KdaParams, prompt: Prompt, config: KdaConfig):
    """(q, k, v, beta, d) of the prompt, [B, H, P, ...] (`normalized`): identity
    tokens past each length, zeroed too so that any padding (even NaN) is inert."""
    tokens = normalized(params, prompt.y, prompt.raw_g, prompt.beta, config)
    B, P = prompt.beta.shape[:2]
    valid = jnp.arange(P)[None, :] < prompt.lengths[:, None]  # [B, P]
    mask = lambda a, fill: jnp.where(valid.reshape(B, 1, P, *(1,) * (a.ndim - 3)), a, fill)
    return (mask(tokens.q, 0.0), mask(tokens.k, 0.0), mask(tokens.v, 0.0),
            mask(tokens.beta, 0.0), mask(tokens.d, 1.0))
