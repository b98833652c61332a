"""An independent NumPy model of the contract (docs/spec.md), written plainly: per
request, per head, per token loops, the stock per-token recurrence in float64.

It models one verify (steps 0-9, with the lazy checkpoint of checkpoint_every > 1),
the runner's `accept` and `flush`, and `prefill`, each for one layer or for stacked
layers (a leading [L] on every leaf, `layer=i`).
The bf16 roundings sit at the stock points (via ml_dtypes). The values rounded there
are computed as docs/spec.md pins them: the convolution and its SiLU in FP32 with the
taps in order, the gate projection as FP32 chains in gate_mode's order; everything
else (norms, decays, the recurrence, the gated RMSNorm) is float64. A checkpoint is
stored in its buffer's dtype where it is written: a bf16 state rounded to nearest even
from float64 by this module's own bit operations (`round_bf16_bits`), so the state's
one rounding shares no code with the package or ml_dtypes (`rounding` selects the
variants a test tells apart: "once", the contract; "twice", also where the replayed
state is used; "never", a float64 state). Nothing is imported from jax_kda: arguments
are read through their attribute names and converted with numpy, and the results are
SimpleNamespaces of numpy arrays in the stored dtypes.
"""
from __future__ import annotations

from types import SimpleNamespace

import ml_dtypes
import numpy as np

K = 128
TAPS = 4
NORM_EPS = 1e-6
CACHE_FIELDS = ("state", "conv", "corrections", "key_gates", "pending", "nodes")
PARAM_FIELDS = ("conv_weight", "conv_bias", "a_log", "dt_bias", "f_b", "norm_weight")


def bf16(x):
    """x rounded to bf16 (nearest even), as float64."""
    return np.asarray(x).astype(ml_dtypes.bfloat16).astype(np.float64)


def f64(x):
    return np.asarray(x).astype(np.float64)


def round_bf16_bits(x):
    """x (float64) rounded to the nearest bf16 value, ties to even, as float64: the
    53-bit significand cut by integer operations to bf16's 8 bits (fewer below its
    smallest normal 2^-126, where its spacing stays 2^-133); inf beyond its largest
    finite value; NaN and inf as they are. One rounding from float64: no float32 step
    in between (which could round a value just past a bf16 tie onto the tie)."""
    x = np.asarray(x, np.float64)
    bits = x.view(np.uint64)
    biased = ((bits >> np.uint64(52)) & np.uint64(0x7FF)).astype(np.int64)
    fraction = bits & np.uint64((1 << 52) - 1)
    significand = np.where(biased > 0, fraction | np.uint64(1 << 52), fraction)
    exponent = np.maximum(biased, 1) - 1075  # |x| = significand * 2^exponent
    spacing = np.maximum(np.maximum(biased, 1) - 1023, -126) - 7  # log2 of bf16's spacing
    drop = np.minimum(spacing - exponent, 62).astype(np.uint64)  # >= 45 significand bits
    kept = significand >> drop
    rest = significand & ((np.uint64(1) << drop) - np.uint64(1))
    half = np.uint64(1) << (drop - np.uint64(1))
    kept = kept + ((rest > half) | ((rest == half) & (kept & np.uint64(1) == 1)))
    with np.errstate(over="ignore"):  # inf and NaN: replaced below
        magnitude = np.ldexp(kept.astype(np.float64), exponent + drop.astype(np.int64))
    magnitude = np.where(magnitude >= 2.0**128, np.inf, magnitude)
    rounded = np.where(bits >> np.uint64(63) == 1, -magnitude, magnitude)
    return np.where(np.isfinite(x), rounded, x)


ROUNDINGS = ("once", "twice", "never")


def stored(state, buffer):
    """`state` (float64) as a checkpoint `buffer` of its dtype keeps it: bf16 rounded by
    `round_bf16_bits` (then exact in the buffer), float32 by NumPy's cast on assignment,
    float64 (rounding "never") as it is."""
    if buffer.dtype.name == "bfloat16":
        return round_bf16_bits(state)
    return state


def replayed(state, buffer, rounding):
    """The replayed state a step continues from: S_n itself (the contract), or for
    rounding "twice" as if written and read back first (a second rounding of what the
    write rounds again)."""
    return stored(state, buffer) if rounding == "twice" else state


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def l2_normalize(x, scale=1.0):
    return x / np.sqrt(np.sum(x * x) + NORM_EPS) * scale


def decay(raw_g, a_log, dt_bias, lower_bound):
    """Per key channel decays of one head from bf16 raw gates [K]: the sigmoid gate of
    lower_bound, or for None the softplus gate, softplus(x) = log(1 + e^x)."""
    x = raw_g + dt_bias
    if lower_bound is None:
        return np.exp(-np.exp(a_log) * np.logaddexp(0.0, x))
    return np.exp(lower_bound * sigmoid(np.exp(a_log) * x))


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
    summed in FP32 as one chain over the rank in order (mode 0) or as four chains over
    the rank quarters added ((c0 + c1) + c2) + c3 (mode 1)."""
    products = (np.asarray(f_a, np.float32)[None, :]
                * np.asarray(f_b, np.float32))  # products of bf16 values: exact in FP32
    chains = {0: 1, 1: 4}[gate_mode]
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


def _sizes(config):
    RQ = (config.checkpoint_every * config.tokens if config.record_tokens is None
          else config.record_tokens)
    scale = K**-0.5 if config.scale is None else config.scale
    return config.heads, config.tokens, RQ, scale


def kept_records(pending, RQ):
    """The records a verify of a row keeps, per pending value (an int or an int array):
    the count itself, or m of a row awaiting the accept of a verify that kept m
    (pending = -(m + 1)); clamped to [0, RQ]."""
    pending = np.asarray(pending, np.int64)
    return np.clip(np.where(pending >= 0, pending, -(pending + 1)), 0, RQ)


def copy_cache(cache, rounding="once"):
    """The cache as a SimpleNamespace of numpy copies in the stored dtypes (nodes None
    without trees; with rounding "never", the state in float64)."""
    new = SimpleNamespace(**{name: None if getattr(cache, name, None) is None
                             else np.array(getattr(cache, name)) for name in CACHE_FIELDS})
    if rounding == "never":
        new.state = new.state.astype(np.float64)
    return new


def tree_parents(parents, T):
    """A verify's parent of each node as the contract reads [T] int entries (None: the
    chain): node 0's is -1, a node t's outside [0, t) is 0."""
    if parents is None:
        return np.arange(T) - 1
    parents = np.asarray(parents, np.int64)
    return np.array([-1 if t == 0 else int(p) if 0 <= p < t else 0
                     for t, p in enumerate(parents)])


def record_positions(nodes, rec, h, n):
    """The record positions of a row's n kept tokens, in replay order: nodes[rec, h, :n]
    with trees, else 0 .. n - 1."""
    return list(range(n)) if nodes is None else [int(j) for j in nodes[rec, h, :n]]


def history_positions(nodes, rec, h, n):
    """The window positions of the next verify's three history inputs: those of the last
    three kept tokens (position + 3), j < 0 reading window[j + 3]."""
    kept = record_positions(nodes, rec, h, n)
    return [kept[j] + 3 if j >= 0 else j + 3 for j in range(n - 3, n)]


def _weights(params):
    """The layer's weights in float64 (None for a missing conv bias)."""
    return SimpleNamespace(**{name: None if getattr(params, name) is None
                              else f64(getattr(params, name)) for name in PARAM_FIELDS})


def _layer(tree, fields, layer):
    return SimpleNamespace(**{name: None if getattr(tree, name, None) is None
                              else np.asarray(getattr(tree, name))[layer] for name in fields})


def _stacked(one_layer):
    """`one_layer(params, cache, ...) -> (out, new cache)` for stacked params and cache
    with `layer`: a layer outside [0, L) makes every row a padding row (zero out, the
    cache unchanged); layer None calls it on one layer's arguments."""

    def run(params, cache, batch, config, layer=None, rounding="once"):
        assert rounding in ROUNDINGS, rounding
        if layer is None:
            return one_layer(params, cache, batch, config, rounding=rounding)
        new = copy_cache(cache, rounding)
        L = new.state.shape[0]
        layer = int(layer)
        if not 0 <= layer < L:
            out, _ = one_layer(_layer(params, PARAM_FIELDS, 0), _layer(cache, CACHE_FIELDS, 0),
                               batch, config, padding=True, rounding=rounding)
            return out, new
        out, layer_cache = one_layer(_layer(params, PARAM_FIELDS, layer),
                                     _layer(cache, CACHE_FIELDS, layer), batch, config,
                                     rounding=rounding)
        for name in CACHE_FIELDS:
            if getattr(new, name) is not None:
                getattr(new, name)[layer] = getattr(layer_cache, name)
        return out, new

    run.__doc__ = one_layer.__doc__
    return run


def _replay(old, slot, rec, h, n, w, lb):
    """S_n of (slot, head h) from the stock recurrence over the n recorded tokens, in
    the order `record_positions` gives."""
    state = f64(old.state[slot, h])
    for t in record_positions(old.nodes, rec, h, n):
        kn = l2_normalize(f64(old.key_gates[rec, h, t, 0]))
        d = decay(f64(old.key_gates[rec, h, t, 1]), w.a_log[h], w.dt_bias[h], lb)
        state = state * d[None, :] + np.outer(f64(old.corrections[rec, h, t]), kn)
    return state


def _tokens(state, history, x, f_a, beta_logit, gate, w, h, config, count):
    """The stock recurrence over `count` tokens of one request and head from `state`.

    history: [3 parts, 3 positions, K] raw inputs before x_0; x: [count, 3, K] raw
    inputs of head h; f_a [count, K]; beta_logit [count]; gate [count, K].
    Returns (state, out [count, K], u [count, K], key [count, K], raw_g [count, K]).
    """
    _, _, _, scale = _sizes(config)
    lb = config.lower_bound
    qkv = np.empty((3, count, K))
    for part in range(3):
        seq = np.concatenate([history[part], x[:, part]])  # [count + 3, K]
        bias = None if w.conv_bias is None else w.conv_bias[part, h]
        qkv[part] = conv_silu(seq, w.conv_weight[part, :, h], bias, count)
    out, u_all, raw_all = (np.empty((count, K)) for _ in range(3))
    for t in range(count):
        q_hat = l2_normalize(qkv[0, t], scale)
        k_hat = l2_normalize(qkv[1, t])
        raw_g = gate_projection(f_a[t], w.f_b[h], config.gate_mode)
        d = decay(raw_g, w.a_log[h], w.dt_bias[h], lb)
        beta = sigmoid(beta_logit[t])
        state = state * d[None, :]
        u = beta * (qkv[2, t] - state @ k_hat)
        state = state + np.outer(u, k_hat)
        o = bf16(state @ q_hat)
        rstd = 1.0 / np.sqrt(np.mean(o**2) + config.eps)
        out[t] = bf16(o * rstd * w.norm_weight * sigmoid(gate[t]))
        u_all[t], raw_all[t] = u, raw_g
    return state, out, u_all, qkv[1], raw_all


def _tree_tokens(state, history, x, f_a, beta_logit, gate, parents, w, h, config):
    """`_tokens` of a tree of T nodes: node t from its parent's state (node 0 from
    `state`), its convolution over its path's raw inputs, the window's history past the
    root. parents: [T] as `tree_parents` reads them. Returns (out, u, key, raw_g), each
    [T, K]."""
    T = len(parents)
    _, _, _, scale = _sizes(config)
    lb = config.lower_bound
    out, u_all, key_all, raw_all = (np.empty((T, K)) for _ in range(4))
    states = {}
    for t in range(T):
        path, a = [t], int(parents[t])
        while a >= 0 and len(path) < 4:  # the nearest ancestors, nearest first
            path.append(a)
            a = int(parents[a])
        seq_nodes = path[::-1]  # [ancestors..., t]
        qkv = np.empty((3, K))
        for part in range(3):
            seq = [history[part, i] for i in range(3)][len(seq_nodes) - 1:]
            seq = np.array(seq + [x[node, part] for node in seq_nodes])  # [4, K]
            bias = None if w.conv_bias is None else w.conv_bias[part, h]
            qkv[part] = conv_silu(seq, w.conv_weight[part, :, h], bias, 1)[0]
        q_hat = l2_normalize(qkv[0], scale)
        k_hat = l2_normalize(qkv[1])
        raw_g = gate_projection(f_a[t], w.f_b[h], config.gate_mode)
        d = decay(raw_g, w.a_log[h], w.dt_bias[h], lb)
        beta = sigmoid(beta_logit[t])
        S = (state if parents[t] < 0 else states[int(parents[t])]) * d[None, :]
        u = beta * (qkv[2] - S @ k_hat)
        S = S + np.outer(u, k_hat)
        states[t] = S
        o = bf16(S @ q_hat)
        rstd = 1.0 / np.sqrt(np.mean(o**2) + config.eps)
        out[t] = bf16(o * rstd * w.norm_weight * sigmoid(gate[t]))
        u_all[t], key_all[t], raw_all[t] = u, qkv[1], raw_g
    return out, u_all, key_all, raw_all


def _verify_one(params, cache, inputs, config, padding=False, rounding="once"):
    """One verify of one layer (docs/spec.md, steps 0-9): returns (out [B, T, H, K] bf16
    values as float64, cache)."""
    H, T, RQ, _ = _sizes(config)
    w = _weights(params)
    old, new = copy_cache(cache), copy_cache(cache, rounding)
    raw_x = np.asarray(inputs.x)  # bf16, stored into the window as it is
    x, f_a = f64(inputs.x), f64(inputs.f_a)
    beta_logit, gate = f64(inputs.beta), f64(inputs.gate)
    slots, record_rows = np.asarray(inputs.slots), np.asarray(inputs.record_rows)
    given = getattr(inputs, "parents", None)
    S, R = old.state.shape[0], old.pending.shape[0]
    B = x.shape[0]
    out = np.zeros((B, T, H, K))
    if padding:
        return out, new

    for b in range(B):
        slot, rec = int(slots[b]), int(record_rows[b])
        if not 0 < slot < S:
            continue  # a padding row: nothing read or written
        has_records = 0 <= rec < R
        for h in range(H):
            n = int(kept_records(old.pending[rec, h], RQ)) if has_records else 0
            state = replayed(_replay(old, slot, rec, h, n, w, config.lower_bound),
                             new.state, rounding)
            # lazy checkpoint: the n tokens stay in the records, this verify's go after
            keep = config.checkpoint_every > 1 and n + T <= RQ
            if n > 0 and not keep:
                new.state[slot, h] = stored(state, new.state)
            base = n if keep else 0
            window = old.conv[slot, :, h]  # [3 parts, K, W] bf16
            kept = history_positions(old.nodes, rec, h, n) if has_records else [0, 1, 2]
            history = np.moveaxis(window[..., kept], -1, 1)  # [3 parts, 3, K]
            parents = tree_parents(None if given is None else given[b], T)
            if given is None:
                _, out[b, :, h], u, key, raw_g = _tokens(
                    state, f64(history), x[b, :, :, h], f_a[b], beta_logit[b, :, h],
                    gate[b, :, h], w, h, config, T)
            else:
                out[b, :, h], u, key, raw_g = _tree_tokens(
                    state, f64(history), x[b, :, :, h], f_a[b], beta_logit[b, :, h],
                    gate[b, :, h], parents, w, h, config)
            if has_records:
                new.corrections[rec, h, base:base + T] = u
                new.key_gates[rec, h, base:base + T, 0] = key
                new.key_gates[rec, h, base:base + T, 1] = raw_g
                new.pending[rec, h] = -(base + 1)
                if new.nodes is not None:
                    new.nodes[rec, h, base:base + T] = parents
            new.conv[slot, :, h, :, base:base + 3] = window[..., kept]
            new.conv[slot, :, h, :, base + 3:base + T + 3] = np.moveaxis(raw_x[b, :, :, h],
                                                                         0, -1)
    return out, new


verify = _stacked(_verify_one)
verify.__doc__ = """One verify (docs/spec.md, steps 0-9), of one layer or, with `layer`,
of layer `layer` of stacked params and cache; `rounding` of the state: one of ROUNDINGS
(`replayed`). Returns (out [B, T, H, K] bf16 values as float64, cache as numpy
arrays)."""


def accept(cache, record_rows, accepted, config, path=None):
    """The runner's accept: in every head (and layer) of each in-range record row that
    awaits an accept (pending = -(m + 1) < 0), pending := m + a, a = clamp(accepted, 0,
    T), m clamped to [0, RQ] and the sum to RQ; with `path` ([B, T]; trees), a is cut
    at the first entry that is not node 0 (first) or a child of the entry before (by
    the nodes the verify recorded), and nodes[m + i] := m + path[i] for i < a; without
    it (a chain) nodes[m + i] := m + i where the cache has nodes. Everything else
    unchanged."""
    _, T, RQ, _ = _sizes(config)
    new = copy_cache(cache)
    old = np.array(new.pending)
    R = old.shape[-2]
    for b, (rec, count) in enumerate(zip(np.asarray(record_rows).tolist(),
                                         np.asarray(accepted).tolist())):
        if not 0 <= rec < R:
            continue
        for index in np.ndindex(old[..., rec, :].shape):  # (layer,) head
            value = int(old[..., rec, :][index])
            if value >= 0:
                continue
            m = int(kept_records(value, RQ))
            a = min(max(count, 0), T)
            nodes = None if new.nodes is None else new.nodes[..., rec, :, :][index]
            if path is not None:
                steps = [int(v) for v in np.asarray(path)[b]]
                length = 0
                while length < a:
                    node, before = steps[length], (-1 if length == 0 else steps[length - 1])
                    if not 0 <= node < T or (length == 0 and node != 0) or (
                            length > 0 and int(nodes[m + node]) != before):
                        break
                    length += 1
                a = length
            if nodes is not None:
                order = steps[:a] if path is not None else list(range(a))
                nodes[m:m + a] = [m + node for node in order]
            new.pending[..., rec, :][index] = min(m + a, RQ)
    return new


def _flush_one(params, cache, batch, config, rounding="once"):
    slots, record_rows = batch
    H, _, RQ, _ = _sizes(config)
    w = _weights(params)
    old, new = copy_cache(cache), copy_cache(cache, rounding)
    S, R = old.state.shape[0], old.pending.shape[0]
    for slot, rec in zip(np.asarray(slots).tolist(), np.asarray(record_rows).tolist()):
        if not 0 < slot < S:
            continue
        has_records = 0 <= rec < R
        for h in range(H):
            n = int(kept_records(old.pending[rec, h], RQ)) if has_records else 0
            if n > 0:
                new.state[slot, h] = stored(_replay(old, slot, rec, h, n, w,
                                                    config.lower_bound), new.state)
            kept = history_positions(old.nodes, rec, h, n) if has_records else [0, 1, 2]
            new.conv[slot, :, h, :, :3] = old.conv[slot, :, h][..., kept]
        if has_records:
            new.pending[rec] = 0
    return None, new


def flush(params, cache, slots, record_rows, config, rounding="once"):
    """The runner's flush (docs/spec.md): each live request's S_n into state[slot],
    window[0..2] := window[n..n+2], pending := 0 (records left), in every layer of a
    stacked cache (params stacked alike)."""
    assert rounding in ROUNDINGS, rounding
    if np.ndim(cache.pending) == 2:
        return _flush_one(params, cache, (slots, record_rows), config, rounding)[1]
    new = copy_cache(cache, rounding)
    for layer in range(new.state.shape[0]):
        _, layer_cache = _flush_one(_layer(params, PARAM_FIELDS, layer),
                                    _layer(cache, CACHE_FIELDS, layer),
                                    (slots, record_rows), config, rounding)
        for name in CACHE_FIELDS:
            if getattr(new, name) is not None:
                getattr(new, name)[layer] = getattr(layer_cache, name)
    return new


def _prefill_one(params, cache, inputs, config, padding=False, rounding="once"):
    """Prefill of one layer (docs/spec.md, "Prefill"): a new prompt from a zero state and
    history, a resumed one from the checkpoint with its kept records folded in and the
    window's history."""
    H, _, RQ, _ = _sizes(config)
    w = _weights(params)
    old, new = copy_cache(cache), copy_cache(cache, rounding)
    raw_x = np.asarray(inputs.x)
    x, f_a = f64(inputs.x), f64(inputs.f_a)
    beta_logit, gate = f64(inputs.beta), f64(inputs.gate)
    slots, record_rows = np.asarray(inputs.slots), np.asarray(inputs.record_rows)
    lengths = np.asarray(inputs.lengths)
    B, P = x.shape[:2]
    resume = (np.zeros(B, bool) if inputs.resume is None else np.asarray(inputs.resume))
    S, R = new.state.shape[0], new.pending.shape[0]
    out = np.zeros((B, P, H, K))
    if padding:
        return out, new
    for b in range(B):
        slot, rec = int(slots[b]), int(record_rows[b])
        if not 0 < slot < S:
            continue
        count = int(np.clip(lengths[b], 0, P))
        has_records = 0 <= rec < R
        window = np.zeros((3, H, K, 3), raw_x.dtype)  # [part, head, channel, position]
        for h in range(H):
            n = int(kept_records(old.pending[rec, h], RQ)) if has_records and resume[b] else 0
            state, history = np.zeros((K, K)), np.zeros((3, 3, K))
            if resume[b]:
                state = replayed(_replay(old, slot, rec, h, n, w, config.lower_bound),
                                 new.state, rounding)
                kept = history_positions(old.nodes, rec, h, n) if has_records else [0, 1, 2]
                window[:, h] = old.conv[slot, :, h][..., kept]
                history = np.moveaxis(f64(window[:, h]), -1, 1)  # [3 parts, 3, K]
            state, out[b, :count, h], _, _, _ = _tokens(
                state, history, x[b, :count, :, h], f_a[b, :count], beta_logit[b, :count, h],
                gate[b, :count, h], w, h, config, count)
            new.state[slot, h] = stored(state, new.state)
        # [history, x] per position, [positions, 3, H, K]; its last three are the window
        seq = np.concatenate([np.moveaxis(window, -1, 0), raw_x[b, :count]])
        new.conv[slot, ..., :3] = np.moveaxis(seq[-3:], 0, -1)
        if has_records:
            new.pending[rec] = 0
    return out, new


prefill = _stacked(_prefill_one)
prefill.__doc__ = """Prefill (docs/spec.md, "Prefill") of one layer or, with `layer`,
of layer `layer` of stacked params and cache; `rounding` as for `verify`: (out
[B, P, H, K] as float64, cache)."""
