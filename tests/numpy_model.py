"""An independent NumPy model of one verify (SPEC.md section 3), written plainly: per
request, per head, per token loops, the stock per-token recurrence in float64.

The bf16 roundings sit at the stock points (via ml_dtypes). The values rounded there
are computed as SPEC.md pins them: the convolution and its SiLU in FP32 with the taps
in order, the gate projection as FP32 chains in gate_mode's order; everything else
(norms, decays, the recurrence, the gated RMSNorm) is float64. Nothing is imported from
jax_kda: arguments are read through their attribute names and converted with numpy.
"""
from __future__ import annotations

from types import SimpleNamespace

import ml_dtypes
import numpy as np

K = 128
TAPS = 4
NORM_EPS = 1e-6


def bf16(x):
    """x rounded to bf16 (nearest even), as float64."""
    return np.asarray(x).astype(ml_dtypes.bfloat16).astype(np.float64)


def f64(x):
    return np.asarray(x).astype(np.float64)


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def l2_normalize(x, scale=1.0):
    return x / np.sqrt(np.sum(x * x) + NORM_EPS) * scale


def decay(raw_g, a_log, dt_bias, lower_bound):
    """Per key channel decays of one head from bf16 raw gates [K]."""
    return np.exp(lower_bound * sigmoid(np.exp(a_log) * (raw_g + dt_bias)))


def conv_silu(seq, weight, bias, T):
    """bf16(SiLU(y_t)) of one part and head, y_t = bias + sum_i w_i seq[t + i] in FP32
    with the taps in order: seq [T + 3, K], weight [4, K], bias [K] or None -> [T, K]."""
    f32 = np.float32
    out = np.empty((T, K))
    for t in range(T):
        y = np.zeros(K, f32) if bias is None else bias.astype(f32)
        for i in range(TAPS):
            y = y + weight[i].astype(f32) * seq[t + i].astype(f32)
        out[t] = bf16(y / (f32(1.0) + np.exp(-y)))
    return out


def gate_projection(f_a, f_b, gate_mode):
    """bf16(f_a . f_b^T) of one token and head: f_a [K], f_b [K features, K rank],
    summed in FP32 as one chain over the rank (mode 0) or four quarter chains (mode 1)."""
    products = (f_a.astype(np.float32)[None, :] * f_b.astype(np.float32))  # exact in FP32
    chains = 1 if gate_mode == 0 else 4
    parts = []
    for c in np.split(products, chains, axis=1):
        total = np.zeros(K, np.float32)
        for r in range(c.shape[1]):
            total = total + c[:, r]
        parts.append(total)
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    return bf16(total)


def verify(params, cache, inputs, config):
    """One verify: returns (out [B, T, H, K] bf16 values as float64, cache) with the
    cache a SimpleNamespace of numpy arrays in the stored dtypes (copies)."""
    H, T = config.heads, config.tokens
    RQ = config.tokens if config.record_tokens is None else config.record_tokens
    scale = K**-0.5 if config.scale is None else config.scale
    lb = config.lower_bound

    conv_weight = f64(params.conv_weight)
    conv_bias = None if params.conv_bias is None else f64(params.conv_bias)
    a_log, dt_bias, f_b = f64(params.a_log), f64(params.dt_bias), f64(params.f_b)
    norm_weight = f64(params.norm_weight)
    new = SimpleNamespace(**{name: np.array(getattr(cache, name)) for name in
                             ("state", "conv", "corrections", "key_gates", "pending")})
    old = SimpleNamespace(**{name: np.array(getattr(cache, name)) for name in
                             ("state", "conv", "corrections", "key_gates", "pending")})
    x, f_a = f64(inputs.x), f64(inputs.f_a)
    beta_logit, gate = f64(inputs.beta), f64(inputs.gate)
    slots, record_rows = np.asarray(inputs.slots), np.asarray(inputs.record_rows)
    S, R = old.state.shape[0], old.pending.shape[0]
    B = x.shape[0]
    out = np.zeros((B, T, H, K))

    for b in range(B):
        slot, rec = int(slots[b]), int(record_rows[b])
        if not 0 < slot < S:
            continue
        has_records = 0 <= rec < R
        n = int(np.clip(old.pending[rec], 0, RQ)) if has_records else 0
        o_start = n - 1 if n > 0 else 0
        window = f64(old.conv[slot])  # [3, H, K, RQ + 2]
        history = window[..., o_start:o_start + 3]
        for h in range(H):
            state = f64(old.state[slot, h])
            for t in range(n):
                key = f64(old.key_gates[rec, h, t, 0])
                d = decay(f64(old.key_gates[rec, h, t, 1]), a_log[h], dt_bias[h], lb)
                kn = l2_normalize(key)
                state = state * d[None, :] + np.outer(f64(old.corrections[rec, h, t]), kn)
            if n > 0:
                new.state[slot, h] = state

            qkv = np.empty((3, T, K))
            for part in range(3):
                seq = np.concatenate([history[part, h].T, x[b, :, part, h]])  # [T + 3, K]
                bias = None if conv_bias is None else conv_bias[part, h]
                qkv[part] = conv_silu(seq, conv_weight[part, :, h], bias, T)
            o = np.empty((T, K))
            for t in range(T):
                q_hat = l2_normalize(qkv[0, t], scale)
                k_hat = l2_normalize(qkv[1, t])
                raw_g = gate_projection(f_a[b, t], f_b[h], config.gate_mode)
                d = decay(raw_g, a_log[h], dt_bias[h], lb)
                beta = sigmoid(beta_logit[b, t, h])
                state = state * d[None, :]
                u = beta * (qkv[2, t] - state @ k_hat)
                state = state + np.outer(u, k_hat)
                o[t] = bf16(state @ q_hat)
                rstd = 1.0 / np.sqrt(np.mean(o[t] ** 2) + config.eps)
                out[b, t, h] = bf16(o[t] * rstd * norm_weight * sigmoid(gate[b, t, h]))
                if has_records:
                    new.corrections[rec, h, t] = u
                    new.key_gates[rec, h, t, 0] = qkv[1, t]
                    new.key_gates[rec, h, t, 1] = raw_g
        new.conv[slot, ..., :2] = old.conv[slot, ..., o_start + 1:o_start + 3]
        new.conv[slot, ..., 2:T + 2] = np.moveaxis(np.asarray(inputs.x)[b], 0, -1)
    return out, new
