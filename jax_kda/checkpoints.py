"""A trained KDA layer's weights as jax_kda's: a state dict keyed by flash-linear-attention's
or a Hugging Face checkpoint's names to `KdaParams` and `KdaProjections` (docs/spec.md,
"Checkpoints").

Sizes: D the hidden size, H heads, K = 128. The two namings of one layer:

- "fla": `fla.layers.KimiDeltaAttention(head_dim=128, expand_v=1, conv_size=4)`'s
  `state_dict()` (flash-linear-attention 0.6.0);
- "hf": a Kimi-Linear-style checkpoint's files (`model.layers.{i}.self_attn.` before
  each name: Kimi-Linear, GLM-5-Next's linear layers).

The forget gate follows fla's `lower_bound` (the config's): a float is the gate
`lower_bound * sigmoid(exp(A_log) * (g + dt_bias))`; None, fla's default and Kimi-Linear's
released checkpoints', is `-exp(A_log) * softplus(g + dt_bias)`.
"""
from __future__ import annotations

from typing import Mapping

import jax.numpy as jnp
import numpy as np

from jax_kda.config import CONV_TAPS, K, KdaConfig
from jax_kda.projections import KdaProjections, fuse_inputs
from jax_kda.pytrees import KdaParams
from jax_kda.validate import BF16, F32, expect

NAMINGS = ("fla", "hf")
FLOATS = (F32, BF16, jnp.dtype(jnp.float16), jnp.dtype(jnp.float64))

# role: (fla's name, the Hugging Face checkpoint's name, shape from (D, H), required);
# a shape's entries are (label, size) pairs as `jax_kda.validate.expect` takes them.
WEIGHTS = {
    "q": ("q_proj.weight", "q_proj.weight", lambda D, H: [("H*K", H * K), ("D", D)], True),
    "k": ("k_proj.weight", "k_proj.weight", lambda D, H: [("H*K", H * K), ("D", D)], True),
    "v": ("v_proj.weight", "v_proj.weight", lambda D, H: [("H*K", H * K), ("D", D)], True),
    "q_conv": ("q_conv1d.weight", "q_conv1d.weight",
               lambda D, H: [("H*K", H * K), (None, 1), ("taps", CONV_TAPS)], True),
    "k_conv": ("k_conv1d.weight", "k_conv1d.weight",
               lambda D, H: [("H*K", H * K), (None, 1), ("taps", CONV_TAPS)], True),
    "v_conv": ("v_conv1d.weight", "v_conv1d.weight",
               lambda D, H: [("H*K", H * K), (None, 1), ("taps", CONV_TAPS)], True),
    "q_conv_bias": ("q_conv1d.bias", "q_conv1d.bias", lambda D, H: [("H*K", H * K)], False),
    "k_conv_bias": ("k_conv1d.bias", "k_conv1d.bias", lambda D, H: [("H*K", H * K)], False),
    "v_conv_bias": ("v_conv1d.bias", "v_conv1d.bias", lambda D, H: [("H*K", H * K)], False),
    "f_a": ("f_proj.0.weight", "f_a_proj.weight", lambda D, H: [("K", K), ("D", D)], True),
    "f_b": ("f_proj.1.weight", "f_b_proj.weight", lambda D, H: [("H*K", H * K), ("K", K)],
            True),
    "beta": ("b_proj.weight", "b_proj.weight", lambda D, H: [("H", H), ("D", D)], True),
    "a_log": ("A_log", "A_log", lambda D, H: [("H", H)], True),
    "dt_bias": ("dt_bias", "dt_bias", lambda D, H: [("H*K", H * K)], True),
    "g_a": ("g_proj.0.weight", "g_a_proj.weight", lambda D, H: [("K", K), ("D", D)], True),
    "g_b": ("g_proj.1.weight", "g_b_proj.weight", lambda D, H: [("H*K", H * K), ("K", K)],
            True),
    "g_bias": ("g_proj.1.bias", "g_b_proj.bias", lambda D, H: [("H*K", H * K)], False),
    "norm": ("o_norm.weight", "o_norm.weight", lambda D, H: [("K", K)], True),
    "out": ("o_proj.weight", "o_proj.weight", lambda D, H: [("D", D), ("H*K", H * K)], True),
}
CONV_BIASES = ("q_conv_bias", "k_conv_bias", "v_conv_bias")


def convert_layer(state: Mapping[str, np.ndarray], config: KdaConfig, *,
                  lower_bound: float | None, names: str = "fla",
                  prefix: str = "") -> tuple[KdaParams, KdaProjections]:
    """One KDA layer's weights from a checkpoint, as NumPy arrays (`jax.device_put`
    places them; `jax.tree.map(np.stack, ...)` of L layers' stacks them).

    Args:
      state: the checkpoint's arrays by name (NumPy arrays of any float dtype, e.g. a
        torch state dict's `{n: t.float().numpy()}`); entries not under `prefix` are
        left alone, every entry under it must be one of the layer's.
      config: the config that will run the layer: its heads must be the checkpoint's H
        (A_log's size) and its lower_bound the checkpoint's; its eps should be the
        checkpoint's gated-norm epsilon (fla's `norm_eps`, Hugging Face's
        `rms_norm_eps`), which a state dict does not hold.
      lower_bound: the checkpoint's forget-gate lower bound (fla's `lower_bound`; None
        for the softplus gate of fla's default and Kimi-Linear's checkpoints).
      names: "fla" or "hf", the naming of `state` (the module's docstring).
      prefix: what precedes the layer's names in `state`, e.g.
        "model.layers.0.self_attn.".

    Returns:
      (params, projections): `KdaParams` (conv_weight [3, 4, H, K], conv_bias [3, H, K]
      f32 or None where the checkpoint has none, a_log [H] f32, dt_bias [H, K] f32, f_b
      [H, K, K] bf16, norm_weight [K] f32) and `KdaProjections` (w_in [D, 3 H K + H +
      2 K], w_gate [K, H K], w_out [H K, D] bf16; gate_bias [H, K] f32, zeros where the
      checkpoint has none). bf16 weights convert exactly; wider ones round to bf16.

    Raises ValueError naming the entries that are missing, unexpected or mis-shaped
    (GVA, expand_v != 1, head_dim != 128, conv_size != 4 or no short convolution are
    layers jax_kda does not run), and where config or lower_bound do not match.
    """
    if names not in NAMINGS:
        raise ValueError(f"names: expected one of {NAMINGS}, got {names!r}")
    if not isinstance(config, KdaConfig):
        raise TypeError(f"config: expected a KdaConfig, got {type(config).__name__}")
    if lower_bound != config.lower_bound:
        raise ValueError(f"lower_bound: the checkpoint's {lower_bound!r} differs from "
                         f"config.lower_bound={config.lower_bound!r} (None is the softplus "
                         f"gate of fla's default and Kimi-Linear's checkpoints)")
    column = NAMINGS.index(names)
    full = {role: prefix + row[column] for role, row in WEIGHTS.items()}
    arrays = {role: state[name] for role, name in full.items() if name in state}
    missing = [full[role] for role, row in WEIGHTS.items() if row[3] and role not in arrays]
    if missing:
        raise ValueError(f"state: missing {', '.join(missing)} ({names} names of a KDA "
                         f"layer)")
    unknown = sorted(set(k for k in state if k.startswith(prefix)) - set(full.values()))
    if unknown:
        raise ValueError(f"state: unexpected {', '.join(unknown)} under prefix {prefix!r}: "
                         f"not a weight of a KDA layer jax_kda runs ({names} names)")
    biases = [role in arrays for role in CONV_BIASES]
    if any(biases) and not all(biases):
        raise ValueError(f"state: {', '.join(full[r] for r in CONV_BIASES)}: expected all "
                         f"three or none")
    a_log = np.asarray(arrays["a_log"])
    H = a_log.size
    if a_log.shape not in ((H,), (1, 1, H, 1)):
        raise ValueError(f"{full['a_log']}: expected [H] or [1, 1, H, 1], got "
                         f"{list(a_log.shape)}")
    if H != config.heads:
        raise ValueError(f"config.heads={config.heads}: the checkpoint has H={H} heads "
                         f"({full['a_log']})")
    arrays["a_log"] = a_log.reshape(H)
    D = expect(full["q"], arrays["q"], [("H*K", H * K), ("D", None)], FLOATS)["D"]
    for role, array in arrays.items():
        expect(full[role], array, WEIGHTS[role][2](D, H), FLOATS)
    return _params(arrays, H), _projections(arrays, H)


def _params(arrays, H) -> KdaParams:
    f32 = lambda role: np.asarray(arrays[role], np.float32)
    # a conv1d's weight [H K, 1, taps] -> [taps, H, K]
    taps = lambda part: f32(f"{part}_conv").reshape(H, K, CONV_TAPS).transpose(2, 0, 1)
    conv_bias = None
    if "q_conv_bias" in arrays:
        conv_bias = np.stack([f32(f"{part}_conv_bias").reshape(H, K) for part in "qkv"])
    return KdaParams(
        conv_weight=np.stack([taps(part) for part in "qkv"]),
        conv_bias=conv_bias,
        a_log=f32("a_log"),
        dt_bias=f32("dt_bias").reshape(H, K),
        f_b=np.asarray(arrays["f_b"], jnp.bfloat16).reshape(H, K, K),  # [feature, rank]
        norm_weight=f32("norm"),
    )


def _projections(arrays, H) -> KdaProjections:
    # a torch Linear's weight is [out, in]: its transpose maps [..., in] -> [..., out]
    t = lambda role: np.asarray(arrays[role], jnp.bfloat16).T
    D = arrays["q"].shape[1]
    x = np.stack([t(part).reshape(D, H, K) for part in "qkv"], axis=1)  # [D, 3, H, K]
    gate_bias = np.asarray(arrays.get("g_bias", np.zeros(H * K)), np.float32)
    return KdaProjections(
        w_in=fuse_inputs(x, t("beta"), t("f_a"), t("g_a")),
        w_gate=t("g_b"),
        gate_bias=gate_bias.reshape(H, K),
        w_out=t("out"),
    )
