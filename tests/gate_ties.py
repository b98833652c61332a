"""Gate projection inputs on which the two gate_modes give different raw gates.

For a designed feature row the only nonzero products f_a[r] * f_b[f, r] sit in rank
columns 0, 1 (the first quarter) and 32, 33 (the second), all of one sign s and scaled
by the token's power of two p:

    col 0: m,  col 1: h = half a bf16 ulp of m,  cols 32, 33: q = half an FP32 ulp of m

with m a bf16 value whose last mantissa bit is 0 (even). m + h is exact in FP32 and
lies exactly halfway between two bf16 values. gate_mode 0 (one chain in column order)
adds q to m + h twice: each is a tie in FP32 and rounds to even, back to m + h, whose
bf16 rounding is a tie again and goes to the even m. gate_mode 1 sums the quarter
chains first, m + h and q + q = an FP32 ulp (both exact), then adds them: m + h + ulp,
exact, just above the tie, rounds away to m + one bf16 ulp. Every other sum is exact
(adding zeros), so only the gate_mode's grouping decides the result.
"""
import numpy as np
import jax.numpy as jnp

K = 128
COLUMNS = (0, 1, 32, 33)


def tie_f_b(rng, heads, designed=slice(0, None, 2)):
    """f_b [H, K, K] bf16: the `designed` feature rows (even ones by default) as above
    (with p = 1), the others random as a trained layer's."""
    f_b = rng.standard_normal((heads, K, K)) * K**-0.5
    rows = np.arange(K)[designed]
    exponent = rng.integers(-2, 2, size=(heads, len(rows)))
    # 8 significant bits with the last one 0: 1.xxxxxx0 * 2^e
    mantissa = 1.0 + 2.0 * rng.integers(0, 64, size=(heads, len(rows))) / 128.0
    sign = rng.choice([-1.0, 1.0], size=(heads, len(rows)))
    m = sign * mantissa * np.ldexp(1.0, exponent)
    half_bf16_ulp = sign * np.ldexp(1.0, exponent - 8)
    half_f32_ulp = sign * np.ldexp(1.0, exponent - 24)
    f_b[:, rows] = 0.0
    for column, value in zip(COLUMNS, (m, half_bf16_ulp, half_f32_ulp, half_f32_ulp)):
        f_b[:, rows, column] = value
    return jnp.asarray(f_b, jnp.bfloat16)


def tie_f_a(rng, shape):
    """f_a [..., K] bf16: random, with the four designed columns one signed power of
    two per token (p = +-1/2, +-1, +-2), so the ties hold in every token."""
    f_a = rng.standard_normal(shape + (K,))
    p = rng.choice([-1.0, 1.0], size=shape) * np.ldexp(1.0, rng.integers(-1, 2, size=shape))
    f_a[..., list(COLUMNS)] = p[..., None]
    return jnp.asarray(f_a, jnp.bfloat16)
