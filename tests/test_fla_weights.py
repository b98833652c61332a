"""Weights from flash-linear-attention and Hugging Face checkpoints (`jax_kda.checkpoints`).

fla's `KimiDeltaAttention` with random weights, converted, against our prefill and verify
on the same tokens: the XLA prefill + `fused_verify(backend="jax")`, the stock reference
and, on a Hopper GPU, the kernels (`backend="auto"`) each within bf16 rounding of fla's
layer, and the state after the prompt fla's in its own layout. It needs torch and fla
0.6.0 (which imports triton, even on a CPU) and is skipped without them. fla's layer runs
its naive torch references there (`fla.ops.kda.naive`, the gate's
`naive_kda_lowerbound_gate`) and plain torch for the short convolution and the gated
norm, at the rounding points of fla's kernels: fla's Triton kernels compute in bf16 where
the recurrence is FP32, several bf16 ulps from it (docs/spec.md, "Checkpoints"), too far
to tell a wrong mapping from their own rounding. Where CUDA runs them, a further test
bounds our distance from fla's kernels by theirs from fla's naive layer.
The converter's options and errors are tested without torch.
"""
import dataclasses

import numpy as np
import jax
import jax.numpy as jnp
import pytest

from compare import out_error, scaled_error
from jax_kda import (K, KdaConfig, PrefillInputs, VerifyInputs, cutedsl_supported,
                     fused_verify, init_cache, prefill)
from jax_kda.checkpoints import convert_layer
from jax_kda.projections import layer_inputs, layer_output
from jax_kda.ref import stock_prefill, stock_verify

# Worst error allowed against fla (units of compare.py: outputs relative to |e| + their
# row's mean |e|, states relative to the buffer's max |e|).
TOLERANCES = {
    # fla rounds its output to bf16 (half an ulp, 2^-9 of it), and a bf16 rounding of a
    # projection, convolution output, o_t or the norm may fall the other way on either
    # side, moving an output by about an ulp of its row's scale.
    "out": 2 * 2**-8,
    # FP32 states from the same bf16 inputs, in another FP32 order; a bf16 input that
    # rounds apart moves it by 2^-8 of an input's share.
    "state": 2**-8,
}
D, HEADS, PROMPT, TOKENS, BATCH = 256, 2, 24, 4, 2
LOWER_BOUND = -3.0  # not KdaConfig's default: a converter or config that drops it fails
FLA_TO_HF = {  # the names that differ; every other is the same in both
    "f_proj.0.weight": "f_a_proj.weight", "f_proj.1.weight": "f_b_proj.weight",
    "g_proj.0.weight": "g_a_proj.weight", "g_proj.1.weight": "g_b_proj.weight",
    "g_proj.1.bias": "g_b_proj.bias",
}


def fla_state(rng, heads=HEADS, conv_bias=True):
    """A random state dict of fla's names and shapes (NumPy, f32)."""
    HK = heads * K
    shapes = {"q_proj.weight": (HK, D), "k_proj.weight": (HK, D), "v_proj.weight": (HK, D),
              "f_proj.0.weight": (K, D), "f_proj.1.weight": (HK, K), "b_proj.weight": (heads, D),
              "A_log": (heads,), "dt_bias": (HK,), "g_proj.0.weight": (K, D),
              "g_proj.1.weight": (HK, K), "g_proj.1.bias": (HK,), "o_norm.weight": (K,),
              "o_proj.weight": (D, HK)}
    for part in "qkv":
        shapes[f"{part}_conv1d.weight"] = (HK, 1, 4)
        if conv_bias:
            shapes[f"{part}_conv1d.bias"] = (HK,)
    return {name: rng.standard_normal(shape).astype(np.float32)
            for name, shape in shapes.items()}


def convert(state, **options):
    config = KdaConfig(heads=HEADS, tokens=TOKENS, lower_bound=LOWER_BOUND)
    return convert_layer(state, config, **{"lower_bound": LOWER_BOUND, **options})


def assert_same_arrays(actual, expected):
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        assert a.dtype == e.dtype and a.shape == e.shape
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(e, np.float32))


def test_hf_names_convert_as_fla_names():
    """A Kimi-Linear-style checkpoint (A_log [1, 1, H, 1], under a layer's prefix, beside
    other layers' entries) gives the arrays of fla's names."""
    state = fla_state(np.random.default_rng(0))
    prefix = "model.layers.3.self_attn."
    hf = {prefix + FLA_TO_HF.get(name, name): value for name, value in state.items()}
    hf[prefix + "A_log"] = hf[prefix + "A_log"].reshape(1, 1, HEADS, 1)
    hf["model.layers.3.mlp.gate_proj.weight"] = np.zeros((4, D), np.float32)
    hf["model.layers.2.self_attn.A_log"] = np.zeros(HEADS + 1, np.float32)
    assert_same_arrays(convert(hf, names="hf", prefix=prefix), convert(state))


def test_absent_biases():
    """No conv biases: conv_bias None; no output-gate bias: gate_bias zeros."""
    state = fla_state(np.random.default_rng(1), conv_bias=False)
    with_bias = convert(state)[1].gate_bias
    del state["g_proj.1.bias"]
    params, projections = convert(state)
    assert params.conv_bias is None and np.any(with_bias != 0)
    np.testing.assert_array_equal(projections.gate_bias, np.zeros((HEADS, K), np.float32))


def without(state, name):
    return {k: v for k, v in state.items() if k != name}


def renamed(state, old, new):
    return {new if k == old else k: v for k, v in state.items()}


def reshaped(state, name, shape):
    return {**state, name: np.zeros(shape, np.float32)}


@pytest.mark.parametrize("edit,options,error,match", [
    (lambda s: without(s, "g_proj.0.weight"), {}, ValueError, r"missing g_proj\.0\.weight"),
    (lambda s: renamed(s, "o_norm.weight", "o_norm.scale"), {}, ValueError,
     r"missing o_norm\.weight"),
    (lambda s: {**s, "q_norm.weight": np.ones(K, np.float32)}, {}, ValueError,
     r"unexpected q_norm\.weight"),
    (lambda s: without(s, "k_conv1d.bias"), {}, ValueError, r"expected all three or none"),
    (lambda s: reshaped(s, "v_proj.weight", (2 * HEADS * K, D)), {}, ValueError,
     r"v_proj\.weight: expected \[H\*K=256, D=256\]"),  # GVA: more value heads
    (lambda s: reshaped(s, "q_proj.weight", (HEADS * 64, D)), {}, ValueError,
     r"q_proj\.weight: expected \[H\*K=256, D\]"),  # head_dim 64
    (lambda s: reshaped(s, "q_conv1d.weight", (HEADS * K, 1, 3)), {}, ValueError,
     r"q_conv1d\.weight: expected \[H\*K=256, 1, taps=4\]"),
    (lambda s: reshaped(s, "A_log", (HEADS, 1)), {}, ValueError,
     r"A_log: expected \[H\] or \[1, 1, H, 1\], got \[2, 1\]"),
    (lambda s: reshaped(s, "A_log", (HEADS + 1,)), {}, ValueError,
     r"config\.heads=2: the checkpoint has H=3"),
    (lambda s: {**s, "f_proj.1.weight": "weights"}, {}, TypeError,
     r"f_proj\.1\.weight: expected an array"),
    (lambda s: s, {"lower_bound": None}, ValueError,
     r"lower_bound: the checkpoint's None differs from config\.lower_bound=-3\.0 \(None is "
     r"the softplus gate"),
    (lambda s: s, {"lower_bound": -5.0}, ValueError,
     r"lower_bound: the checkpoint's -5\.0 differs from config\.lower_bound=-3\.0"),
    (lambda s: s, {"names": "kimi"}, ValueError, r"names: expected one of \('fla', 'hf'\)"),
    (lambda s: s, {"names": "hf"}, ValueError, r"missing f_a_proj\.weight"),
], ids=["missing", "renamed", "unknown", "partial-conv-bias", "gva", "head-dim-64",
        "conv-size-3", "a-log-shape", "heads", "not-an-array", "softplus-gate",
        "other-lower-bound", "bad-names", "other-names"])
def test_errors(edit, options, error, match):
    with pytest.raises(error, match=match):
        convert(edit(fla_state(np.random.default_rng(2))), **options)


def test_config_type():
    with pytest.raises(TypeError, match=r"config: expected a KdaConfig, got dict"):
        convert_layer(fla_state(np.random.default_rng(3)), {}, lower_bound=LOWER_BOUND)


def fla_modules():
    """(torch, fla's kda layer module, fla's modules) or a skip."""
    torch = pytest.importorskip("torch")
    try:
        import fla.layers.kda as fla_kda
        import fla.modules as fla_modules
    except ImportError as error:  # fla 0.6.0 imports triton at import, GPU or not
        pytest.skip(f"flash-linear-attention not importable: {error}")
    return torch, fla_kda, fla_modules


def naive_kda(q, k, v, g, beta, *, A_log, dt_bias, initial_state, output_final_state,
              use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel,
              allow_neg_eigval, lower_bound, state_v_first, cu_seqlens, safe_gate=False):
    """fla's chunk_kda / fused_recurrent_kda as its layer calls them, by fla's naive
    recurrence: q and k normed in FP32 (the kernels' l2norm), the gate of lower_bound
    (fla's softplus gate for None)."""
    import torch
    from fla.ops.kda.gate import naive_kda_gate, naive_kda_lowerbound_gate
    from fla.ops.kda.naive import naive_recurrent_kda

    assert use_qk_l2norm_in_kernel and use_gate_in_kernel and use_beta_sigmoid_in_kernel
    assert not allow_neg_eigval and cu_seqlens is None and not safe_gate
    l2 = lambda x: x.float() / torch.sqrt(x.float().square().sum(-1, keepdim=True) + 1e-6)
    if initial_state is not None and state_v_first:
        initial_state = initial_state.transpose(-1, -2)  # [V, K] -> fla's [K, V]
    gate = (naive_kda_gate(g, A_log, dt_bias) if lower_bound is None else
            naive_kda_lowerbound_gate(g, A_log, dt_bias, lower_bound))
    o, state = naive_recurrent_kda(
        l2(q), l2(k), v, gate,
        beta.float().sigmoid(), initial_state=initial_state,
        output_final_state=output_final_state)
    if state is not None and state_v_first:
        state = state.transpose(-1, -2)
    return o, state


def conv_forward(self, x, residual=None, mask=None, cache=None, output_final_state=False,
                 cu_seqlens=None, chunk_indices=None):
    """ShortConvolution's forward as its kernels compute it (FP32, SiLU, rounded to x's
    dtype) by torch's depthwise conv1d, from a zero history; no conv state comes back."""
    import torch.nn.functional as F

    assert residual is None and mask is None and cache is None and cu_seqlens is None
    T = x.shape[1]
    bias = None if self.bias is None else self.bias.float()
    y = F.conv1d(x.float().transpose(1, 2), self.weight.float(), bias,
                 padding=self.kernel_size[0] - 1, groups=self.hidden_size)[..., :T]
    return F.silu(y).transpose(1, 2).to(x.dtype), None


def norm_forward(self, x, g, residual=None, prenorm=False, residual_in_fp32=False):
    """FusedRMSNormGated's forward with the sigmoid gate, in FP32, rounded to x's dtype."""
    import torch

    assert self.activation == "sigmoid" and residual is None and not prenorm
    xf = x.float()
    rms = torch.rsqrt(xf.square().mean(-1, keepdim=True) + self.eps)
    return (xf * rms * self.weight.float() * g.float().sigmoid()).to(x.dtype)


@pytest.fixture
def fla_layer():
    """make(conv_bias, lower_bound) -> (torch, fla's KimiDeltaAttention in bf16 (A_log and
    dt_bias f32) with random weights, its device: CUDA where there is one, naive: its
    kernels' torch stand-ins above, for `fla_run`)."""
    torch, fla_kda, modules = fla_modules()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    naive = {(fla_kda, "chunk_kda"): naive_kda, (fla_kda, "fused_recurrent_kda"): naive_kda,
             (modules.ShortConvolution, "forward"): conv_forward,
             (modules.FusedRMSNormGated, "forward"): norm_forward}

    def make(conv_bias, lower_bound):
        torch.manual_seed(5 + conv_bias)
        layer = fla_kda.KimiDeltaAttention(hidden_size=D, head_dim=K, num_heads=HEADS,
                                           lower_bound=lower_bound, conv_bias=conv_bias,
                                           layer_idx=0)
        with torch.no_grad():  # every weight away from its init's constants
            layer.o_norm.weight.normal_(1.0, 0.2)
            layer.g_proj[1].bias.normal_(0.0, 1.0)
            layer.dt_bias.normal_(0.0, 1.0)  # decays spread over (0, 1)
            layer.A_log.uniform_(-1.0, 1.0)
        layer = layer.to(device, torch.bfloat16)
        layer.A_log.data, layer.dt_bias.data = layer.A_log.float(), layer.dt_bias.float()
        return torch, layer, device, naive

    return make


def fla_run(torch, layer, device, hidden, naive=None):
    """fla's layer on hidden [B, P + T, D] (bf16 values), on the stand-ins `naive` for its
    kernels unless None: (outputs [B, P + T, D] f32, the state after the prompt's P tokens
    [B, H, V, K] f32, fla's state_v_first layout)."""
    from fla.models.cache_utils import Cache

    hidden = torch.from_numpy(hidden).to(device, torch.bfloat16)
    with pytest.MonkeyPatch.context() as patch, torch.no_grad():
        for (owner, name), stand_in in (naive or {}).items():
            patch.setattr(owner, name, stand_in)
        out = layer(hidden)[0]
        cache = Cache()
        layer(hidden[:, :PROMPT], past_key_values=cache, use_cache=True)
    return out.float().cpu().numpy(), cache[0]["recurrent_state"].float().cpu().numpy()


def ours(params, projections, config, hidden, run_prefill, run_verify):
    """Our layer on hidden [B, P + T, D]: the prompt prefilled, then one verify of the T
    tokens after it. Returns (outputs [B, P + T, D] f32, states [B, H, V, K] after the
    prompt)."""
    inputs = layer_inputs(projections, jnp.asarray(hidden))  # x, f_a, beta, gate
    slots = jnp.arange(1, BATCH + 1, dtype=jnp.int32)
    out_p, cache = run_prefill(params, poisoned_cache(config), PrefillInputs(
        *(a[:, :PROMPT] for a in inputs), jnp.full(BATCH, PROMPT, jnp.int32), slots,
        slots - 1), config)
    states = np.asarray(cache.state[1:])
    out_v, _ = run_verify(params, cache, VerifyInputs(
        *(a[:, PROMPT:] for a in inputs), slots, slots - 1), config)
    return np.asarray(layer_output(projections, jnp.concatenate([out_p, out_v], 1))), states


def poisoned_cache(config):
    """A fresh cache with NaN in every state and in the window's first three positions
    (a prefill reads neither)."""
    cache = init_cache(config, BATCH + 1, BATCH)
    return dataclasses.replace(cache, state=jnp.full_like(cache.state, jnp.nan),
                               conv=cache.conv.at[..., :3].set(jnp.nan))


PATHS = {
    "xla": (lambda *a: prefill(*a, backend="jax"), lambda *a: fused_verify(*a, backend="jax")),
    "stock": (jax.jit(stock_prefill, static_argnames="config"),
              jax.jit(stock_verify, static_argnames="config")),
    # the verify kernel; the prefill's kernels where they take the gate (not the softplus)
    "kernels": (prefill, fused_verify),
}
ON_HOPPER = [pytest.mark.gpu, pytest.mark.skipif(
    not cutedsl_supported(), reason="needs a CUDA GPU of compute capability >= 9.0")]


def converted(fla_layer, conv_bias, lower_bound):
    """fla's layer, its run on the naive stand-ins, our params and projections, config and
    the hidden states they ran on."""
    torch, layer, device, naive = fla_layer(conv_bias, lower_bound)
    hidden = np.random.default_rng(6 + conv_bias).standard_normal(
        (BATCH, PROMPT + TOKENS, D)).astype(jnp.bfloat16).astype(np.float32)
    want = fla_run(torch, layer, device, hidden, naive)
    state = {name: value.float().cpu().numpy() for name, value in layer.state_dict().items()}
    config = KdaConfig(heads=HEADS, tokens=TOKENS, lower_bound=lower_bound,
                       eps=layer.o_norm.eps)
    params, projections = convert_layer(state, config, lower_bound=layer.lower_bound)
    assert (params.conv_bias is not None) == conv_bias
    return (torch, layer, device), want, (params, projections, config, hidden)


@pytest.mark.parametrize("path", ["xla", "stock", pytest.param("kernels", marks=ON_HOPPER)])
@pytest.mark.parametrize("lower_bound", [LOWER_BOUND, None], ids=["sigmoid-gate",
                                                                 "softplus-gate"])
@pytest.mark.parametrize("conv_bias", [False, True], ids=["no-conv-bias", "conv-bias"])
def test_matches_fla_layer(fla_layer, conv_bias, lower_bound, path):
    """A prompt of 24 tokens then a verify of 4, two requests: the layer's outputs (after
    o_proj) within bf16 rounding of fla's on the same hidden states, and the state after
    the prompt fla's (state_v_first: [V, K], as ours); with fla's lower-bound gate and
    with its default softplus gate (lower_bound None, Kimi-Linear's)."""
    _, (want, want_states), ours_args = converted(fla_layer, conv_bias, lower_bound)
    got, states = ours(*ours_args, *PATHS[path])
    assert out_error(got, want) <= TOLERANCES["out"]
    assert scaled_error(states, want_states) <= TOLERANCES["state"]


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["xla", pytest.param("kernels", marks=ON_HOPPER)])
@pytest.mark.parametrize("lower_bound", [LOWER_BOUND, None], ids=["sigmoid-gate",
                                                                 "softplus-gate"])
def test_no_farther_from_fla_kernels_than_fla_is(fla_layer, lower_bound, path):
    """fla's layer on its Triton kernels (CUDA): our outputs and state no farther from
    them than fla's own layer on the naive stand-ins is, within the rounding allowed."""
    if not pytest.importorskip("torch").cuda.is_available():
        pytest.skip("fla's Triton kernels need CUDA")
    (torch, layer, device), (naive, naive_states), ours_args = converted(
        fla_layer, True, lower_bound)
    want, want_states = fla_run(torch, layer, device, ours_args[-1])
    got, states = ours(*ours_args, *PATHS[path])
    assert out_error(got, want) <= out_error(naive, want) + TOLERANCES["out"]
    assert (scaled_error(states, want_states)
            <= scaled_error(naive_states, want_states) + TOLERANCES["state"])
