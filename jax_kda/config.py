"""The static configuration of one KDA verify: a frozen, hashable dataclass that jit
treats as a compile-time constant."""
from __future__ import annotations

import dataclasses

K = 128  # key and value head dim, and the gate projection's rank
CONV_TAPS = 4
SPLITS = (1, 2, 4, 8)


@dataclasses.dataclass(frozen=True)
class KdaConfig:
    """Static settings of a KDA layer's speculative verify.

    Attributes:
      heads: H, number of heads (>= 1); every head has K = 128 key and value channels.
      tokens: T, tokens fed to one verify (2..8): the last sampled token plus T-1 drafts.
      record_tokens: RQ, tokens a record row holds; None means T. Must be >= T.
      lower_bound: the gate's lower bound; decays are exp(lower_bound * sigmoid(.)).
      scale: the query scale; None means K**-0.5.
      eps: the gated RMSNorm's epsilon.
      gate_mode: FP32 summation order of the gate projection: 0 = one chain over the
        K rank columns, 1 = four chains over column quarters added as ((c0+c1)+c2)+c3.
      split: CTAs per (request, head) in the CuTe DSL kernel (1, 2, 4, 8); None picks
        one from the batch size. Ignored by the pure-JAX backend.
    """

    heads: int
    tokens: int
    record_tokens: int | None = None
    lower_bound: float = -5.0
    scale: float | None = None
    eps: float = 1e-5
    gate_mode: int = 0
    split: int | None = None

    def __post_init__(self):
        if not isinstance(self.heads, int) or self.heads < 1:
            raise ValueError(f"heads: expected an int >= 1, got {self.heads!r}")
        if not isinstance(self.tokens, int) or not 2 <= self.tokens <= 8:
            raise ValueError(f"tokens: expected an int in 2..8, got {self.tokens!r}")
        if self.record_tokens is not None and (
            not isinstance(self.record_tokens, int) or self.record_tokens < self.tokens
        ):
            raise ValueError(
                f"record_tokens: expected None or an int >= tokens={self.tokens}, "
                f"got {self.record_tokens!r}"
            )
        if self.gate_mode not in (0, 1):
            raise ValueError(f"gate_mode: expected 0 or 1, got {self.gate_mode!r}")
        if self.split is not None and self.split not in SPLITS:
            raise ValueError(f"split: expected None or one of {SPLITS}, got {self.split!r}")
        for name in ("lower_bound", "eps") + (("scale",) if self.scale is not None else ()):
            if not isinstance(getattr(self, name), (int, float)):
                raise TypeError(f"{name}: expected a float, got {getattr(self, name)!r}")
        if self.eps <= 0:
            raise ValueError(f"eps: expected > 0, got {self.eps!r}")

    @property
    def rq(self) -> int:
        """Tokens a record row holds (record_tokens, or tokens when None)."""
        return self.tokens if self.record_tokens is None else self.record_tokens

    @property
    def query_scale(self) -> float:
        """scale, or K**-0.5 when None."""
        return K**-0.5 if self.scale is None else float(self.scale)
