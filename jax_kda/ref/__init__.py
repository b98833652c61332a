"""The references: the stock per-token recurrence as `jax.lax.scan`s, with the
signatures of `fused_verify` and `prefill`. The WY form the fast paths run is
`jax_kda.wy`; `jax_kda.xla` runs it as the "jax" backend."""
from jax_kda.ref.stock import stock_prefill, stock_verify

__all__ = ["stock_prefill", "stock_verify"]
