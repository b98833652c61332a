"""Every argument check: shapes, dtypes and config at trace time, once at each public
entry (`check_verify`, `check_prefill`, `check_accept`, `check_flush`); index and
pending values on the host (`check_inputs`)."""
from __future__ import annotations

import numpy as np
import jax.numpy as jnp

from jax_kda.config import CONV_TAPS, K, KdaConfig
from jax_kda.pytrees import KdaCache, KdaParams, PrefillInputs, VerifyInputs, awaiting

BF16, F32, I32 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32), jnp.dtype(jnp.int32)
BOOL = jnp.dtype(bool)


def _describe(dims, dtypes):
    text = ", ".join(
        label if value is None else (str(value) if label is None else f"{label}={value}")
        for label, value in dims
    )
    return f"[{text}] {' or '.join(d.name for d in dtypes)}"


def expect(name, array, dims, dtypes):
    """Checks `array` against `dims` ((label, size) pairs; size None binds the label to
    whatever the array has) and `dtypes`; returns the bound sizes by label."""
    if not hasattr(array, "shape") or not hasattr(array, "dtype"):
        raise TypeError(f"{name}: expected an array {_describe(dims, dtypes)}, got {array!r}")
    shape = tuple(array.shape)
    ok = len(shape) == len(dims) and all(
        value is None or size == value for (_, value), size in zip(dims, shape)
    )
    if not ok or jnp.dtype(array.dtype) not in dtypes:
        raise ValueError(
            f"{name}: expected {_describe(dims, dtypes)}, "
            f"got [{', '.join(map(str, shape))}] {jnp.dtype(array.dtype).name}"
        )
    return {label: size for (label, value), size in zip(dims, shape) if value is None}


def typed(name, value, cls):
    if not isinstance(value, cls):
        raise TypeError(f"{name}: expected a {cls.__name__}, got {type(value).__name__}")


def _lead(layers):
    """The leading layer dim of stacked leaves: [] for one layer, [("L", L)] (L None:
    bound by the first leaf) for stacked ones."""
    return [] if layers is False else [("L", None if layers is True else layers)]


def check_params(params: KdaParams, config: KdaConfig, layers=False) -> None:
    """Trace-time check of the layer weights against `config`; layers: False (one
    layer), or the stacked layer count L."""
    typed("params", params, KdaParams)
    typed("config", config, KdaConfig)
    H, lead = config.heads, _lead(layers)
    conv_dtype = jnp.dtype(getattr(params.conv_weight, "dtype", F32))
    expect("params.conv_weight", params.conv_weight,
           lead + [(None, 3), (None, CONV_TAPS), ("H", H), (None, K)], (F32, BF16))
    if params.conv_bias is not None:
        expect("params.conv_bias", params.conv_bias,
               lead + [(None, 3), ("H", H), (None, K)], (conv_dtype,))
    expect("params.a_log", params.a_log, lead + [("H", H)], (F32,))
    expect("params.dt_bias", params.dt_bias, lead + [("H", H), (None, K)], (F32,))
    expect("params.f_b", params.f_b, lead + [("H", H), (None, K), (None, K)], (BF16,))
    expect("params.norm_weight", params.norm_weight, lead + [(None, K)], (F32, BF16))


def check_cache(cache: KdaCache, config: KdaConfig, stacked: bool | None = None):
    """Trace-time check of the cache; stacked: whether leaves carry a layer axis (None:
    read off cache.state's rank). Returns (S, R, L), L None for one layer."""
    typed("cache", cache, KdaCache)
    typed("config", config, KdaConfig)
    if stacked is None:
        stacked = getattr(cache.state, "ndim", 4) == 5
    H, RQ, W = config.heads, config.rq, config.window
    state_dims = _lead(stacked) + [("S", None), ("H", H), (None, K), (None, K)]
    try:
        sizes = expect("cache.state", cache.state, state_dims, (config.state_dtype,))
    except ValueError as error:
        if jnp.dtype(cache.state.dtype) == config.state_dtype:
            raise
        raise ValueError(f"{error}: config.state_dtype is {config.state_dtype.name} "
                         "(init_cache(config, ...) makes a cache of it)") from None
    S, L = sizes["S"], sizes.get("L")
    lead = _lead(False if L is None else L)
    expect("cache.conv", cache.conv,
           lead + [("S", S), (None, 3), ("H", H), (None, K), ("W", W)], (BF16,))
    R = expect("cache.corrections", cache.corrections,
               lead + [("R", None), ("H", H), ("RQ", RQ), (None, K)], (F32,))["R"]
    expect("cache.key_gates", cache.key_gates,
           lead + [("R", R), ("H", H), ("RQ", RQ), (None, 2), (None, K)], (BF16,))
    expect("cache.pending", cache.pending, lead + [("R", R), ("H", H)], (I32,))
    if config.trees:
        if cache.nodes is None:
            raise ValueError("cache.nodes: expected an array [R, H, RQ] int32 with "
                             "config.trees, got None (init_cache with this config)")
        expect("cache.nodes", cache.nodes, lead + [("R", R), ("H", H), ("RQ", RQ)], (I32,))
    elif cache.nodes is not None:
        raise ValueError("cache.nodes: expected None without config.trees, got an array "
                         "(KdaConfig(trees=True) for a cache of trees)")
    if S < 1 or R < 1:
        raise ValueError(f"cache: expected S >= 1 slots and R >= 1 record rows, got {S=}, {R=}")
    return S, R, L


def check_layer(layer, L):
    """`layer` of a stacked call: a Python int in [0, L) or an int32 scalar array."""
    if isinstance(layer, (int, np.integer)) and not isinstance(layer, bool):
        if not 0 <= int(layer) < L:
            raise ValueError(f"layer: expected an int in [0, L={L}), got {layer!r}")
        return jnp.int32(layer)
    expect("layer", layer, [], (I32,))
    return layer


def check_rows(name, array, B=None):
    """A [B] int32 index array; returns B."""
    return expect(name, array, [("B", B)], (I32,)).get("B", B)


def check_verify(params: KdaParams, cache: KdaCache, inputs: VerifyInputs,
                 config: KdaConfig, layer=None):
    """Trace-time check of every argument of a verify; returns (B, S, R, layer), layer
    an int32 scalar for a stacked call (None otherwise)."""
    stacked = layer is not None
    _, _, L = check_cache(cache, config, stacked)
    check_params(params, config, L if stacked else False)
    typed("inputs", inputs, VerifyInputs)
    H, T = config.heads, config.tokens
    B = expect("x", inputs.x, [("B", None), ("T", T), (None, 3), ("H", H), (None, K)],
               (BF16,))["B"]
    expect("f_a", inputs.f_a, [("B", B), ("T", T), (None, K)], (BF16,))
    expect("beta", inputs.beta, [("B", B), ("T", T), ("H", H)], (BF16,))
    expect("gate", inputs.gate, [("B", B), ("T", T), ("H", H), (None, K)], (BF16,))
    check_rows("slots", inputs.slots, B)
    check_rows("record_rows", inputs.record_rows, B)
    if inputs.parents is not None:
        if not config.trees:
            raise ValueError("parents: given, but config.trees is False (the cache keeps no "
                             "node links); use KdaConfig(trees=True), or parents=None for a "
                             "chain")
        expect("parents", inputs.parents, [("B", B), ("T", T)], (I32,))
    return B, (check_layer(layer, L) if stacked else None)


def check_prefill(params: KdaParams, cache: KdaCache, inputs: PrefillInputs,
                  config: KdaConfig, layer=None):
    """Trace-time check of every argument of a prefill; returns the int32 layer of a
    stacked call (None otherwise)."""
    stacked = layer is not None
    _, _, L = check_cache(cache, config, stacked)
    check_params(params, config, L if stacked else False)
    typed("inputs", inputs, PrefillInputs)
    H = config.heads
    sizes = expect("x", inputs.x, [("B", None), ("P", None), (None, 3), ("H", H), (None, K)],
                   (BF16,))
    B, P = sizes["B"], sizes["P"]
    expect("f_a", inputs.f_a, [("B", B), ("P", P), (None, K)], (BF16,))
    expect("beta", inputs.beta, [("B", B), ("P", P), ("H", H)], (BF16,))
    expect("gate", inputs.gate, [("B", B), ("P", P), ("H", H), (None, K)], (BF16,))
    for name in ("lengths", "slots", "record_rows"):
        check_rows(name, getattr(inputs, name), B)
    if inputs.resume is not None:
        expect("resume", inputs.resume, [("B", B)], (BOOL,))
    return check_layer(layer, L) if stacked else None



def check_accept(cache: KdaCache, record_rows, accepted, config: KdaConfig,
                 path=None) -> None:
    """Trace-time check of an accept's arguments (the cache stacked or not)."""
    typed("config", config, KdaConfig)
    check_cache(cache, config)
    B = check_rows("record_rows", record_rows)
    check_rows("accepted", accepted, B)
    if path is not None:
        if not config.trees:
            raise ValueError("path: given, but config.trees is False (no verify took a "
                             "tree); use KdaConfig(trees=True), or path=None for a chain")
        expect("path", path, [("B", B), ("T", config.tokens)], (I32,))


def check_flush(params: KdaParams, cache: KdaCache, slots, record_rows,
                config: KdaConfig) -> None:
    """Trace-time check of a flush's arguments (params and cache stacked alike, or
    not)."""
    _, _, L = check_cache(cache, config)
    check_params(params, config, False if L is None else L)
    B = check_rows("slots", slots)
    check_rows("record_rows", record_rows, B)


def check_inputs(cache: KdaCache, slots, record_rows, config: KdaConfig, *,
                 accepted=None, parents=None, path=None) -> None:
    """Host-side check of one batch's index values (concrete arrays, not tracers), for
    a verify or, with `accepted`, for the `accept` after it.

    Raises ValueError listing every problem: slots or record rows past their buffers
    (which a verify treats as padding / as keeping no records), negative indices other
    than the padding slot 0 and the record row -1 (each means one of those, but a
    runner rarely writes them on purpose), a slot or record row used twice in the
    batch, pending values that differ between heads or layers, counts above RQ (clamped
    by a verify), values below -(RQ - T + 1) (awaiting an accept after more kept
    records than a verify keeps), and a record row that still awaits the accept of its
    last verify (whose tokens then count as rejected). With `accepted`: counts outside
    [0, T] (clamped) and record rows that no verify has left awaiting an accept (the
    accept is ignored there). With trees: `parents` ([B, T], a verify's) entries the
    verify reads otherwise (node 0's not -1, a node t's outside [0, t)); `path` ([B, T],
    with `accepted`) entries that end the path before the accepted count (not node 0
    first, or not a child of the entry before by the tree the awaited verify recorded).
    Padding rows (slot <= 0) are ignored.
    """
    S, R, _ = check_cache(cache, config)
    slots, rows = np.asarray(slots), np.asarray(record_rows)
    pending = np.asarray(cache.pending).reshape(-1, R, config.heads)
    live = slots > 0
    problems = []
    for name, values, size, fallback in (("slots", slots, S, "treated as padding"),
                                         ("record_rows", rows, R, "keeps no records")):
        for b in np.flatnonzero((values >= size) & live):
            problems.append(f"{name}[{b}]={values[b]} is >= {size}: {fallback}")
    for b in np.flatnonzero(slots < 0):
        problems.append(f"slots[{b}]={slots[b]} is negative: treated as padding (use 0)")
    for b in np.flatnonzero(live & (rows < -1)):
        problems.append(f"record_rows[{b}]={rows[b]} is below -1: keeps no records (use -1)")
    indexed = live & (rows >= 0) & (rows < R)
    for name, values, mask in (("slots", slots, live & (slots < S)),
                               ("record_rows", rows, indexed)):
        used, counts = np.unique(values[mask], return_counts=True)
        for value in used[counts > 1]:
            where = np.flatnonzero(mask & (values == value)).tolist()
            problems.append(f"{name}: {value} is used by several requests {where}")
    T, RQ = config.tokens, config.rq
    lowest = awaiting(RQ - T)  # a verify keeps at most RQ - T records
    for b in np.flatnonzero(indexed):
        n = pending[:, rows[b]]
        first = int(n.flat[0])
        if np.any(n != first):
            problems.append(f"pending[{rows[b]}] (request {b}) differs between heads or "
                            f"layers: {sorted(set(n.ravel().tolist()))}")
        elif first < lowest:
            problems.append(f"pending[{rows[b]}]={first} (request {b}) is below "
                            f"-(RQ - T + 1)={lowest}: no verify leaves it")
        elif accepted is None and first < 0:
            problems.append(f"pending[{rows[b]}] (request {b}) awaits the accept of its last "
                            "verify: its tokens count as rejected")
        elif accepted is None and first > RQ:
            problems.append(f"pending[{rows[b]}]={first} (request {b}) is outside [0, RQ={RQ}]: "
                            "clamped")
        elif accepted is not None and first >= 0:
            problems.append(f"record_rows[{b}]={rows[b]}: no verify awaits an accept there "
                            "(the accept is ignored)")
    if accepted is not None:
        accepted = np.asarray(accepted)
        for b in np.flatnonzero(live & ((accepted < 0) | (accepted > T))):
            problems.append(f"accepted[{b}]={accepted[b]} is outside [0, T={T}]: clamped")
    if parents is not None:
        parents = np.asarray(parents)
        for b in np.flatnonzero(live):
            for t, parent in enumerate(parents[b].tolist()):
                if t == 0 and parent != -1:
                    problems.append(f"parents[{b}, 0]={parent} is not -1: read as -1")
                elif t and not 0 <= parent < t:
                    problems.append(f"parents[{b}, {t}]={parent} is outside [0, {t}): read as "
                                    "0 (a child of node 0)")
    if path is not None and accepted is not None and cache.nodes is not None:
        path = np.asarray(path)
        links = np.asarray(cache.nodes).reshape(-1, R, config.heads, RQ)[0, :, 0]
        for b in np.flatnonzero(indexed):
            first = int(pending[0, rows[b], 0])
            if first >= 0:
                continue
            m, count = -first - 1, min(max(int(accepted[b]), 0), T)
            for i, node in enumerate(path[b, :count].tolist()):
                before = -1 if i == 0 else int(path[b, i - 1])
                inside = 0 <= node < T and 0 <= m + node < RQ
                if not (inside and links[rows[b], m + node] == before):
                    problems.append(f"path[{b}, {i}]={node} is not "
                                    + ("node 0" if i == 0 else f"a child of node {before}")
                                    + f" in the awaited tree: the path ends there ({i} of "
                                    f"{count} accepted)")
                    break
    if problems:
        raise ValueError("check_inputs found:\n  " + "\n  ".join(problems))

