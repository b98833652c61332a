"""The static configuration of a KDA layer's verify (a frozen, hashable dataclass that jit
treats as a compile-time constant) and the constants every part of the package shares."""
from __future__ import annotations

import dataclasses
import math
import numbers

import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

K = 128  # key and value head dim, and the gate projection's rank
CONV_TAPS = 4  # the short convolution's width
NORM_EPS = 1e-6  # inside the L2 norms of q and k
SPLITS = (1, 2, 4, 8)  # CTAs per (request, head) the kernel can run with
MAX_TOKENS = 16  # tokens (chain or tree nodes) of one verify

SM_SHARED = 228 * 1024  # shared memory of one Hopper SM
CTA_RESERVED = 1024  # shared memory an SM keeps for each CTA resident on it
CTA_SHARED_LIMIT = 227 * 1024  # dynamic shared memory one CTA may opt into on sm_90
SOLO_SHARED = 120 * 1024  # more than half of SM_SHARED: no second CTA fits beside it
DEFAULT_SMS = 132  # H100 SXM and H200, where a device does not report its count


def integer(value, allowed):
    """value as an int if it is an integer (numpy's too, never a bool) in `allowed`."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        if allowed(int(value)):
            return int(value)
    return None


FP32_TINY = float(np.finfo(np.float32).tiny)  # the smallest normal FP32 number, 2^-126


def boolean(value, allowed):
    """value if it is a bool (Python's or NumPy's) in `allowed`."""
    if isinstance(value, (bool, np.bool_)) and allowed(bool(value)):
        return bool(value)
    return None


def dtype_of(value, allowed):
    """value as a NumPy dtype (from a dtype, a scalar type or its name) in `allowed`."""
    if value is None or isinstance(value, (bool, numbers.Number)):
        return None
    try:
        normal = jnp.dtype(value)
    except TypeError:
        return None
    return normal if allowed(normal) else None


STATE_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))  # a checkpoint's storage


def real(value, allowed):
    """value as a float if it is a real number (never a bool) in `allowed` that the
    FP32 arithmetic keeps: finite in FP32 and, unless 0, normal (GPUs flush subnormals
    to 0)."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        if math.isfinite(value) and allowed(float(value)) and fp32_normal(float(value)):
            return float(value)
    return None


def fp32_normal(value: float) -> bool:
    """Whether `value` is 0 or rounds to a finite, normal FP32 number."""
    with np.errstate(over="ignore"):
        single = abs(float(np.float32(value)))
    return value == 0.0 or (math.isfinite(single) and single >= FP32_TINY)


IN_FP32 = (f"that stays a finite, normal FP32 number (magnitude in [{FP32_TINY:.8g}, "
           f"{float(np.finfo(np.float32).max):.8g}])")


def _in_fp32(value) -> str:
    """What FP32 makes of a real `value` that it does not keep, for an error message."""
    if (not isinstance(value, numbers.Real) or isinstance(value, bool)
            or not math.isfinite(value) or fp32_normal(float(value))):
        return ""
    with np.errstate(over="ignore"):
        single = np.float32(value)
    kind = ("out of range" if not np.isfinite(single) else
            "subnormal" if single != 0 else "0")
    return f" ({float(single)!r} in FP32: {kind})"


@dataclasses.dataclass(frozen=True)
class KdaConfig:
    """Static settings of a KDA layer's speculative verify.

    Attributes:
      heads: H, number of heads (>= 1); every head has K = 128 key and value channels.
      tokens: T, tokens fed to one verify (2..16): the last sampled token plus T-1
        drafts, a chain or, with `trees`, a tree of them.
      record_tokens: RQ, tokens a record row holds; None means C * T (C =
        checkpoint_every). Must be >= T.
      lower_bound: the forget gate's lower bound (< 0): decays are
        exp(lower_bound * sigmoid(exp(a_log) (g + dt_bias))), each log decay in
        [lower_bound, 0]; None: the softplus gate of fla's default and Kimi-Linear's
        checkpoints, decays exp(-exp(a_log) softplus(g + dt_bias)), unbounded below.
      scale: the query scale (> 0); None means K**-0.5.
      eps: the gated RMSNorm's epsilon (> 0).
      gate_mode: FP32 summation order of the gate projection: 0 = one chain over the
        K rank columns, 1 = four chains over column quarters added as ((c0+c1)+c2)+c3.
      split: CTAs per (request, head) in the CuTe DSL kernel (1, 2, 4, 8); None picks
        one from the batch size. Ignored by the XLA backend.
      checkpoint_every: C (>= 1). 1 writes the replayed state to the checkpoint at every
        verify that replays; C > 1 keeps the accepted tokens in the records and writes
        the state only when the next T records would not fit after them (docs/spec.md,
        "Lazy checkpoint").
      trees: whether verifies may take token trees (`VerifyInputs.parents`) and
        `accept` a path of one: the cache then keeps each record's node links
        (`KdaCache.nodes`; docs/spec.md, "Token trees"). Needs checkpoint_every 1.

    Integer fields take Python or NumPy integers (not bools), real fields any real
    number that stays a finite, normal FP32 number (the arithmetic is FP32: a value
    that overflows, underflows to 0 or is subnormal there is refused); both are stored
    as Python int and float.
    """

    heads: int
    tokens: int
    record_tokens: int | None = None
    lower_bound: float | None = -5.0
    scale: float | None = None
    eps: float = 1e-5
    gate_mode: int = 0
    split: int | None = None
    checkpoint_every: int = 1
    trees: bool = False
    state_dtype: DTypeLike = jnp.float32

    def __post_init__(self):
        rules = [
            ("heads", integer, lambda v: v >= 1, "an int >= 1"),
            ("tokens", integer, lambda v: 2 <= v <= MAX_TOKENS, f"an int in 2..{MAX_TOKENS}"),
            ("record_tokens", integer, lambda v: v >= self.tokens,
             f"None or an int >= tokens={self.tokens}"),
            ("lower_bound", real, lambda v: v < 0, f"None or a float < 0 {IN_FP32}"),
            ("scale", real, lambda v: v > 0, f"None or a float > 0 {IN_FP32}"),
            ("eps", real, lambda v: v > 0, f"a float > 0 {IN_FP32}"),
            ("gate_mode", integer, lambda v: v in (0, 1), "0 or 1"),
            ("split", integer, lambda v: v in SPLITS, f"None or one of {SPLITS}"),
            ("checkpoint_every", integer, lambda v: v >= 1, "an int >= 1"),
            ("trees", boolean, lambda v: not v or self.checkpoint_every == 1,
             "a bool" if self.checkpoint_every == 1 else
             f"False at checkpoint_every={self.checkpoint_every} (trees need 1: a kept "
             f"path's records would lie under the next verify's nodes)"),
            ("state_dtype", dtype_of, lambda v: v in STATE_DTYPES,
             "jnp.float32 or jnp.bfloat16"),
        ]
        for name, kind, allowed, expected in rules:
            value = getattr(self, name)
            if value is None and expected.startswith("None"):
                continue
            normal = kind(value, allowed)
            if normal is None:
                raise ValueError(f"{name}: expected {expected}, got {value!r}"
                                 + _in_fp32(value))
            object.__setattr__(self, name, normal)

    @property
    def rq(self) -> int:
        """Tokens a record row holds (record_tokens, or checkpoint_every * tokens when
        None)."""
        if self.record_tokens is None:
            return self.checkpoint_every * self.tokens
        return self.record_tokens

    @property
    def window(self) -> int:
        """W = RQ + 3: positions of the conv window (the three inputs before record
        token 0, then the input of each record token)."""
        return self.rq + CONV_TAPS - 1

    @property
    def query_scale(self) -> float:
        """scale, or K**-0.5 when None."""
        return K**-0.5 if self.scale is None else self.scale
