"""`jax_kda.projections`: the fused input projection's column layout, and the layer's
inputs and output projection against float64 NumPy (each projection of the unfused
weights, rounded to bf16 where a bf16 model's linear layer rounds it)."""
import numpy as np
import jax.numpy as jnp

from compare import out_error
from jax_kda import K
from jax_kda.projections import (KdaProjections, fuse_inputs, input_parts, layer_inputs,
                                 layer_output)

D, H, LEAD = 64, 2, (3, 5)
# bf16 outputs of FP32 sums in XLA's order against float64 ones: one rounding may fall
# the other way (an ulp, 2^-8 of the value); gate's input g_a is such a rounding too.
TOLERANCE = 2**-8


def bf16(a):
    """a rounded to bf16, as float64."""
    return np.asarray(np.asarray(a, np.float32).astype(jnp.bfloat16), np.float64)


def test_parts_invert_fuse():
    rng = np.random.default_rng(0)
    parts = [rng.standard_normal(LEAD + shape).astype(np.float32)
             for shape in ((3, H, K), (H,), (K,), (K,))]
    fused = fuse_inputs(*parts)
    assert fused.shape == LEAD + (3 * H * K + H + 2 * K,)
    for got, want in zip(input_parts(fused, H), parts, strict=True):
        np.testing.assert_array_equal(got, want)
    for got, want in zip(input_parts(jnp.asarray(fused), H), parts, strict=True):
        np.testing.assert_array_equal(np.asarray(got), want)


def test_layer_inputs_and_output_match_numpy():
    rng = np.random.default_rng(1)
    w = lambda *shape: bf16(rng.standard_normal(shape) * shape[0]**-0.5)
    w_x, w_beta, w_fa, w_ga, w_gate, w_out = (w(D, 3, H, K), w(D, H), w(D, K), w(D, K),
                                              w(K, H * K), w(H * K, D))
    gate_bias = rng.standard_normal((H, K))
    projections = KdaProjections(
        w_in=jnp.asarray(fuse_inputs(w_x, w_beta, w_fa, w_ga), jnp.bfloat16),
        w_gate=jnp.asarray(w_gate, jnp.bfloat16),
        gate_bias=jnp.asarray(gate_bias, jnp.float32), w_out=jnp.asarray(w_out, jnp.bfloat16))
    a = rng.standard_normal(LEAD + (D,)).astype(np.float32)
    x, f_a, beta, gate = layer_inputs(projections, jnp.asarray(a))
    a = bf16(a)
    want = {"x": bf16(np.einsum("...d,dpht->...pht", a, w_x)), "f_a": bf16(a @ w_fa),
            "beta": bf16(a @ w_beta),
            "gate": bf16((bf16(a @ w_ga) @ w_gate).reshape(LEAD + (H, K)) + gate_bias)}
    for name, got in (("x", x), ("f_a", f_a), ("beta", beta), ("gate", gate)):
        assert got.dtype == jnp.bfloat16 and got.shape == want[name].shape, name
        assert out_error(got, want[name]) <= TOLERANCE, name
    out = bf16(rng.standard_normal(LEAD + (H, K)))
    got = layer_output(projections, jnp.asarray(out, jnp.bfloat16))
    assert got.dtype == jnp.float32
    # FP32 sums of H K = 256 exact products: a few FP32 ulps of the terms' scale
    assert out_error(got, out.reshape(LEAD + (H * K,)) @ w_out) <= 2**-16
