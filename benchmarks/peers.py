"""The implementations the benchmark runs outside XLA, on torch tensors:

- `KernelEager`: our fused kernel through the eager DLPack entry
  `jax_kda.ffi.eager_verify` (no XLA in the way: the raw kernel time).
- `FlaStock`: the stock pipeline a vLLM / flash-linear-attention user runs today, from
  the `fla-core` wheel's Triton kernels: the short convolution of q, k and v
  (`causal_conv1d_fwd` with the window as initial state and the new window as final
  state), the gate up-projection (a bf16 torch.matmul, the model's linear layer),
  `fused_recurrent_kda_fwd` as vLLM's spec-decode path calls it (the state pool updated
  in place, per-token state indices [B, T], accepted counts [B]: one FP32 state
  written per verify token, the gate and beta sigmoid and the q/k L2 norms in-kernel)
  and the gated RMSNorm (`layer_norm_gated_fwd`, sigmoid gate).

Each is built from the same JAX-made operands (`jax_kda.testing`), converted by DLPack;
`rotating` operand sets live side by side so consecutive calls touch cold memory, the
weights included: each set has its own copy, as each layer of a model has its own,
cold when the layer runs. `host_to_cuda` moves the kernel-study tools' host-built
operands to the GPU.
"""
from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jax_kda.config import K


def torch_or_none():
    try:
        import torch
    except ImportError:
        return None
    return torch


def cuda_ready(torch) -> bool:
    return torch is not None and torch.cuda.is_available()


def to_torch(torch, array, copy=True):
    """A torch view of a JAX array (DLPack), by default cloned: the kernels write in
    place, and a JAX array must not change under its holders."""
    if array is None:
        return None
    view = torch.from_dlpack(array)
    return view.clone() if copy else view


def as_torch_tree(torch, tree, copy=True):
    """The same pytree class with every array field as a torch copy (or view)."""
    fields = {name: to_torch(torch, value, copy) for name, value in vars(tree).items()}
    return type(tree)(**fields)


def host_to_cuda(torch, tree):
    """A pytree of JAX arrays on the host (the tools build their data with
    JAX_PLATFORMS=cpu, so that the only GPU work is the kernel's) as torch copies on the
    GPU, bf16 through its bits."""
    def move(array):
        array = np.asarray(array)
        if array.dtype == jnp.bfloat16:
            return torch.from_numpy(array.view(np.uint16).copy()).view(torch.bfloat16).cuda()
        return torch.from_numpy(array.copy()).cuda()
    return jax.tree.map(move, tree)


def cuda_to_host(torch, tree):
    """`host_to_cuda`'s inverse: a pytree of torch tensors on the GPU as JAX arrays on the
    host, bf16 through its bits."""
    def move(tensor):
        if tensor.dtype == torch.bfloat16:
            return jnp.asarray(tensor.view(torch.int16).cpu().numpy().view(jnp.bfloat16))
        return jnp.asarray(tensor.cpu().numpy())
    return jax.tree.map(move, tree)


def per_set(weights, sets: int):
    """`weights` (a pytree of torch tensors) and sets - 1 clones of it: one per operand
    set, so that a call finds its weights cold, as a model's layer does."""
    return [weights] + [jax.tree.map(lambda a: a.clone(), weights) for _ in range(sets - 1)]


def kernel_eager_unavailable(torch):
    """None if the eager kernel path can run here, else why not."""
    if not cuda_ready(torch):
        return "no CUDA GPU for torch"
    major, _ = torch.cuda.get_device_capability()
    if major < 9:
        return f"compute capability {major}.x < 9.0"
    try:
        from jax_kda.ffi import eager_verify  # noqa: F401
    except Exception as error:  # noqa: BLE001 - report whatever keeps it from loading
        return f"jax_kda.ffi.eager_verify: {type(error).__name__}: {error}"
    return None


class KernelEager:
    """Our kernel on torch tensors over operand sets, set i being (params[i], caches[i],
    inputs[i], layers[i]): build it with `rotating` (one cache holding every set's slots,
    the weights a copy per set), `per_layer` (a model's layers, each its own of
    everything) or `stacked` (a model's layers in stacked params and cache, set i
    running layer i).

    A verify leaves its record rows awaiting an accept (pending -1), so that a second
    launch of a set would replay nothing: `rearm` restores every pending count to its
    value at construction (pass it to the timers as their reset)."""

    def __init__(self, torch, params, caches, inputs, config, layers=None):
        from jax_kda.ffi import eager_verify

        self.torch, self.config, self._verify = torch, config, eager_verify
        self.params, self.caches, self.inputs = params, caches, inputs
        self.layers = layers or [None] * len(inputs)
        B, T, H = inputs[0].x.shape[0], config.tokens, config.heads
        self.outs = [torch.empty((B, T, H, K), dtype=torch.bfloat16,
                                 device=caches[0].state.device) for _ in inputs]
        pendings = {id(c.pending): c.pending for c in caches}
        self.armed = [(p, p.clone()) for p in pendings.values()]

    @classmethod
    def rotating(cls, torch, params, cache, sets, config):
        """`sets` (VerifyInputs, each with its own slots and record rows) on one cache."""
        cache = as_torch_tree(torch, cache)
        return cls(torch, per_set(as_torch_tree(torch, params), len(sets)),
                   [cache] * len(sets), [as_torch_tree(torch, s) for s in sets], config)

    @classmethod
    def per_layer(cls, torch, params, caches, inputs, config):
        """Lists of JAX pytrees, one entry per layer, run on the JAX buffers themselves
        (no copies: the caches are updated in place, so pass only arrays that nothing
        reads afterwards, as a donated cache)."""
        tree = lambda trees: [as_torch_tree(torch, t, copy=False) for t in trees]
        return cls(torch, tree(params), tree(caches), tree(inputs), config)

    @classmethod
    def stacked(cls, torch, params, cache, inputs, config, layers: int):
        """Stacked JAX params and cache (leading [L]) and one step's inputs, every layer
        on the JAX buffers themselves (as `per_layer`), layer i a [1] int32 tensor."""
        params, cache, inputs = (as_torch_tree(torch, t, copy=False)
                                 for t in (params, cache, inputs))
        index = [torch.tensor([i], dtype=torch.int32, device=cache.state.device)
                 for i in range(layers)]
        return cls(torch, [params] * layers, [cache] * layers, [inputs] * layers, config,
                   index)

    def __call__(self, i: int):
        stream = self.torch.cuda.current_stream().cuda_stream
        self._verify(self.params[i], self.caches[i], self.inputs[i], self.outs[i],
                     self.config, stream=stream, layer=self.layers[i])

    def rearm(self):
        """Every pending count back to its value at construction (one copy per cache)."""
        for pending, first in self.armed:
            pending.copy_(first)

    def poisoned_run(self, i: int = 0):
        """Output of set i with the output buffer poisoned (NaN) first."""
        self.outs[i].fill_(float("nan"))
        self(i)
        self.torch.cuda.synchronize()
        return self.outs[i]


def fla_unavailable(torch):
    """None if fla's Triton kernels can run here, else why not."""
    if torch is None:
        return "torch is not installed"
    if not cuda_ready(torch) and os.environ.get("TRITON_INTERPRET") != "1":
        return "no CUDA GPU for Triton"
    os.environ.setdefault("FLA_DISABLE_BACKEND_DISPATCH", "1")  # the Triton kernels only
    # fla/__init__ imports its model zoo (transformers) when it can; the kernels need none
    # of it, and a transformers version it does not expect must not take them down.
    for name in ("fla.layers", "fla.models"):
        sys.modules.setdefault(name, None)
    try:
        import fla.modules.causal_conv1d.ops  # noqa: F401
        import fla.modules.norm.fused_norm_gate  # noqa: F401
        import fla.ops.kda.fused_recurrent  # noqa: F401
    except Exception as error:  # noqa: BLE001
        return f"fla-core: {type(error).__name__}: {error}"
    return None


class FlaStock:
    """The fla / vLLM stock verify on the same operands.

    Built from a JAX cache and input sets like `KernelEager.rotating`; each request b of set s
    owns T state slots of a pool [1 + sets * B * T, H, V, K] (value-first, our layout),
    the one at accepted[b] - 1 holding its checkpoint, and one conv window per part.
    `checkpoint` ([sets * B, H, K, K], optional) replaces the state read from the cache
    (pass the flushed state when comparing outputs with ours); `accepted` ([sets * B])
    likewise; `windows` ([sets * B, 3, H, K, 3] bf16, optional) the three inputs before
    x_0 per part.
    """

    def __init__(self, torch, params, cache, sets, config, *, rng=None, checkpoint=None,
                 accepted=None, windows=None):
        from fla.modules.causal_conv1d.ops import causal_conv1d_fwd
        from fla.modules.norm.fused_norm_gate import layer_norm_gated_fwd
        from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

        self._conv, self._norm, self._recurrence = (causal_conv1d_fwd, layer_norm_gated_fwd,
                                                    fused_recurrent_kda_fwd)
        self.torch, self.config = torch, config
        device = "cuda" if torch.cuda.is_available() else "cpu"
        H, T = config.heads, config.tokens
        B, nsets = sets[0].x.shape[0], len(sets)
        rng = rng or np.random.default_rng(0)
        t = lambda a: to_torch(torch, a).to(device)
        slots = np.concatenate([np.asarray(s.slots) for s in sets])
        # Checkpoints of every request of every set, in set order: [nsets * B, H, K, K].
        if checkpoint is None:
            state = t(cache.state)
            checkpoint = state[torch.as_tensor(slots, device=device).long()]
        else:
            checkpoint = t(checkpoint)
        if accepted is None:
            accepted = rng.integers(1, T + 1, size=nsets * B)
        accepted = np.asarray(accepted)
        pool = torch.empty((1 + nsets * B * T, H, K, K), dtype=torch.float32, device=device)
        pool[0].zero_()
        indices = 1 + np.arange(nsets * B * T, dtype=np.int32).reshape(nsets * B, T)
        start = indices[np.arange(nsets * B), accepted - 1]
        pool[torch.as_tensor(start, device=device).long()] = checkpoint
        self.pool = pool
        self.indices = [torch.as_tensor(indices[s * B:(s + 1) * B], device=device)
                        for s in range(nsets)]
        self.accepted = [torch.as_tensor(accepted[s * B:(s + 1) * B].astype(np.int32),
                                         device=device) for s in range(nsets)]
        # Conv windows [B, H*K, 4] per part and set, positions 1..3 = the history.
        if windows is None:
            conv = t(cache.conv)  # [S, 3, H, K, W]
            windows = conv[torch.as_tensor(slots, device=device).long(), ..., 0:3]
        else:
            windows = t(windows)
        win = torch.zeros((nsets * B, 3, H * K, 4), dtype=torch.bfloat16, device=device)
        win[..., 1:] = windows.reshape(nsets * B, 3, H * K, 3)
        self.windows = [[win[s * B:(s + 1) * B, p].contiguous() for p in range(3)]
                        for s in range(nsets)]
        w = t(params.conv_weight).float()  # [3, 4, H, K]
        bias = params.conv_bias
        first = dict(
            conv_w=[w[p].reshape(4, H * K).t().contiguous() for p in range(3)],
            conv_b=[None] * 3 if bias is None else [
                t(bias).float()[p].reshape(H * K).contiguous() for p in range(3)],
            f_b=t(params.f_b).reshape(H * K, K),  # [H*K, rank] bf16
            a_log=t(params.a_log).float().contiguous(),
            dt_bias=t(params.dt_bias).float().contiguous(),
            norm_w=t(params.norm_weight).float().contiguous())
        self.weights = per_set(first, nsets)
        self.inputs = []
        for s in sets:
            self.inputs.append(dict(x=t(s.x), f_a=t(s.f_a).reshape(B * T, K),
                                    beta=t(s.beta), gate=t(s.gate).reshape(B * T * H, K)))
        self.B = B

    def conv(self, i: int):
        """q, k, v after the short convolution and SiLU: three [B, T, H*K] bf16."""
        x, out, w = self.inputs[i]["x"], [], self.weights[i]
        H = self.config.heads
        for p in range(3):
            part = x[:, :, p].reshape(self.B, self.config.tokens, H * K)
            y, _ = self._conv(part, w["conv_w"][p], w["conv_b"][p], None,
                              initial_state=self.windows[i][p], output_final_state=True,
                              activation="silu")
            out.append(y)
        return out

    def gate(self, i: int):
        """The raw gate [B, T, H, K] bf16: f_a @ f_b^T, the model's up-projection."""
        B, T, H = self.B, self.config.tokens, self.config.heads
        return (self.inputs[i]["f_a"] @ self.weights[i]["f_b"].t()).reshape(B, T, H, K)

    def recurrence(self, i: int, q, k, v, g):
        """fused_recurrent_kda_fwd in vLLM's spec-decode form on q, k, v [B, T, H*K]
        (after the conv) and the raw gate g [B, T, H, K]; o [B, T, H, K] bf16."""
        B, T, H = self.B, self.config.tokens, self.config.heads
        o, _ = self._recurrence(
            q=q.reshape(B, T, H, K), k=k.reshape(B, T, H, K), v=v.reshape(B, T, H, K),
            g=g, beta=self.inputs[i]["beta"], A_log=self.weights[i]["a_log"],
            dt_bias=self.weights[i]["dt_bias"],
            scale=self.config.query_scale, initial_state=self.pool, inplace_final_state=True,
            ssm_state_indices=self.indices[i], num_accepted_tokens=self.accepted[i],
            use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
            use_beta_sigmoid_in_kernel=True, lower_bound=float(self.config.lower_bound),
            state_v_first=True)
        return o

    def norm(self, i: int, o):
        B, T, H = self.B, self.config.tokens, self.config.heads
        y = self._norm(o.reshape(B * T * H, K), self.inputs[i]["gate"],
                       self.weights[i]["norm_w"], None,
                       activation="sigmoid", eps=float(self.config.eps), is_rms_norm=True)[0]
        return y.reshape(B, T, H, K)

    def pipeline(self, i: int):
        """The whole stock verify of set i: conv, gate projection, recurrence, norm."""
        q, k, v = self.conv(i)
        o = self.recurrence(i, q, k, v, self.gate(i))
        return self.norm(i, o)

    def recurrence_only(self, i: int):
        """The recurrence kernel alone on preformed q, k, v, g (`prepare_recurrence`)."""
        q, k, v, g = self.prepared[i]
        return self.recurrence(i, q, k, v, g)

    def prepare_recurrence(self):
        """Run the stages before the recurrence once per set, so `recurrence_only` times
        the recurrence kernel on real conv outputs and gates."""
        self.prepared = []
        for i in range(len(self.inputs)):
            q, k, v = self.conv(i)
            self.prepared.append((q, k, v, self.gate(i)))
