"""The projections around a KDA layer, as a serving model runs them: from the residual
stream to the layer's inputs (`VerifyInputs`' and `PrefillInputs`' x, f_a, beta, gate)
in one matmul, and from the layer's output back to the residual stream.

Sizes: D the residual width, H heads, K = 128 (also the rank of the two low-rank
gates). Weights are bf16, products accumulate in FP32 (`preferred_element_type`), and
each input is rounded to bf16 once, where a bf16 model's linear layer rounds it. The
fused matrix's columns are, in order:

    q [H, K] | k [H, K] | v [H, K] | beta [H] | f_a [K] | g_a [K]

q, k, v before the short convolution; beta the beta logits; f_a the forget gate's
low-rank activations (its up-projection is `KdaParams.f_b`, inside the layer); g_a the
output gate's, whose up-projection w_gate (and gate_bias) gives the output-gate logits.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jax_kda.config import K
from jax_kda.pytrees import _pytree


@_pytree
@dataclasses.dataclass(frozen=True)
class KdaProjections:
    """A KDA layer's projections (each with a leading [L] when stacked).

    w_in: [D, 3 H K + H + 2 K] bf16, the fused input projection (columns as the
      module's docstring lays them out: `fuse_inputs`, `input_parts`).
    w_gate: [K, H K] bf16, the output gate's up-projection (rank row).
    gate_bias: [H, K] f32, added to the output-gate logits before their bf16 rounding.
    w_out: [H K, D] bf16, the output projection (rows head-major).
    """

    w_in: jax.Array
    w_gate: jax.Array
    gate_bias: jax.Array
    w_out: jax.Array


def heads_of(projections: KdaProjections) -> int:
    """H, from w_gate's columns."""
    return projections.w_gate.shape[-1] // K


def input_parts(columns, heads: int):
    """The fused input projection's columns split along the last axis: [..., 3 H K + H +
    2 K] -> (x [..., 3, H, K], beta [..., H], f_a [..., K], g_a [..., K]), for the
    weights' columns and for the projected activations alike."""
    HK = heads * K
    lead = columns.shape[:-1]
    x = columns[..., :3 * HK].reshape(*lead, 3, heads, K)
    beta = columns[..., 3 * HK:3 * HK + heads]
    f_a = columns[..., 3 * HK + heads:3 * HK + heads + K]
    g_a = columns[..., 3 * HK + heads + K:]
    return x, beta, f_a, g_a


def fuse_inputs(x, beta, f_a, g_a):
    """`input_parts`' inverse: x [..., 3, H, K], beta [..., H], f_a [..., K], g_a
    [..., K] -> [..., 3 H K + H + 2 K] (any array module's arrays: NumPy's or JAX's)."""
    module = jnp if isinstance(x, jax.Array) else np
    x = x.reshape(*x.shape[:-3], -1)
    return module.concatenate([x, beta, f_a, g_a], axis=-1)


def project(a, w):
    """a [..., M] @ w [M, N] in bf16 with FP32 accumulation: [..., N] f32."""
    return jnp.matmul(a.astype(jnp.bfloat16), w, preferred_element_type=jnp.float32)


def layer_inputs(projections: KdaProjections, a):
    """The KDA layer's inputs from the normed residual stream a [..., D] (any float
    dtype; rounded to bf16 for the matmul): (x [..., 3, H, K], f_a [..., K], beta
    [..., H], gate [..., H, K]), all bf16, in `VerifyInputs`' order. One matmul for all
    of them but the output gate's up-projection, which reads g_a's bf16 rounding."""
    H = heads_of(projections)
    x, beta, f_a, g_a = (y.astype(jnp.bfloat16) for y in
                         input_parts(project(a, projections.w_in), H))
    gate = project(g_a, projections.w_gate).reshape(*g_a.shape[:-1], H, K)
    return x, f_a, beta, (gate + projections.gate_bias).astype(jnp.bfloat16)


def layer_output(projections: KdaProjections, out):
    """The layer's output out [..., H, K] bf16 projected back: [..., D] f32."""
    return project(out.reshape(*out.shape[:-2], -1), projections.w_out)
