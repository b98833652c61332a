"""The eager kernel's operand sets for one (B, T, split) point on the GPU and their time
in CUDA graphs of back-to-back launches (`Point`): the harness of the lazy checkpoint's
section, and of the kernel-study tools in tools/kernel_lab/."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import torch

import measure  # benchmarks/, on sys.path as the script's folder
from jax_kda import KdaConfig, kernel_abi
from jax_kda.ffi import solo_ctas
from jax_kda.testing import random_cache, random_inputs, random_params, random_parents
from peers import host_to_cuda

H, LAUNCHES, REPLAYS = 32, 32, 10
STATE_BYTES = 128 << 20  # state a launch's cache sets hold at the least: past the L2


def cute_tensors(arrays):
    """CuTe DSL tensors of torch tensors (None stays None: an absent operand)."""
    from cutlass.cute.runtime import from_dlpack

    return [None if a is None else
            from_dlpack(a, assumed_align=16).mark_layout_dynamic(leading_dim=a.dim() - 1)
            for a in arrays]


class Point:
    """The operands of one (B, T, split) point on the GPU (checkpoint_every: the config's
    lazy checkpoint; trees: the tree build, each request a random tree; state_dtype: the
    checkpoint's): one cache set per launch of a graph (at least LAUNCHES, and enough
    that the state comes from HBM), each cloned with its own copy of the weights, every
    request with a record row and a slot of its own. `named[i]`: set i's arrays by
    operand name; `sets[i]`: its CuTe DSL operands in `jax_kda.kernel_abi` order."""

    def __init__(self, B, T, split, checkpoint_every=1, trees=False, state_dtype=jnp.float32):
        import cuda.bindings.driver as cuda

        self.config = KdaConfig(heads=H, tokens=T, split=split,
                                checkpoint_every=checkpoint_every, trees=trees,
                                state_dtype=state_dtype)
        self.solo = solo_ctas(self.config, B, split)  # the launch shape eager_verify picks
        key = jax.random.key(B)
        params = host_to_cuda(torch, random_params(key, self.config))
        slots, rows = np.arange(1, B + 1), np.arange(B)
        state_bytes = B * H * 128 * 128 * self.config.state_dtype.itemsize
        self.nsets = max(LAUNCHES, -(-STATE_BYTES // state_bytes))
        first = host_to_cuda(torch, random_cache(jax.random.fold_in(key, 1), self.config,
                                                 B + 1, B))
        self.caches = [first] + [jax.tree.map(torch.clone, first)
                                 for _ in range(self.nsets - 1)]
        self.pending = first.pending.clone()
        inputs = random_inputs(jax.random.fold_in(key, 99), self.config, slots, rows)
        if trees:
            inputs = dataclasses.replace(inputs, parents=random_parents(
                np.random.default_rng(B), B, T))
        inputs = host_to_cuda(torch, inputs)
        self.out = torch.empty((B, T, H, 128), dtype=torch.bfloat16, device="cuda")
        self.stream = torch.cuda.Stream()
        self.handle = cuda.CUstream(self.stream.cuda_stream)
        weights = [params] + [jax.tree.map(torch.clone, params)
                              for _ in range(self.nsets - 1)]
        self.named = [dict(zip(kernel_abi.NAMES, kernel_abi.values(w, c, inputs, None, self.out)))
                      for w, c in zip(weights, self.caches)]
        self.sets = [cute_tensors(list(n.values())) for n in self.named]

    def hold(self, n):
        """Every request's pending count n from now on (`rearm` restores it)."""
        self.pending.fill_(n)
        self.rearm()

    def rearm(self):
        """Every set's pending counts back to the first ones (a verify leaves -1)."""
        for cache in self.caches:
            cache.pending.copy_(self.pending)

    def graph_time(self, compiled, extra=(), sets=None, serial=False, before=None):
        """Median microseconds per launch of `compiled`: one launch per cache set,
        back to back in a CUDA graph (PDL overlaps them; `serial`: each launch a child
        graph of its own, which PDL's edge does not cross), REPLAYS replays after two
        warm-up ones, the pending counts restored before each, outside the timing.
        sets: other operand lists than the verify's, one per cache set. before: work
        (torch, on this stream) put in front of every launch, as a model's other layers
        run between its verify calls."""
        sets = sets or self.sets

        def launch(i):
            if before is not None:
                with torch.cuda.stream(self.stream):
                    before()
            compiled(self.handle, *sets[i], *extra)

        launch(0)
        launches = [functools.partial(launch, i) for i in range(self.nsets)]
        with torch.cuda.stream(self.stream):
            replay = (measure.child_graph_chain(self.handle, launches) if serial
                      else self.one_graph(launches))
            seconds = measure.replay_time(torch, replay, REPLAYS, reset=self.rearm)
        return seconds * 1e6 / len(launches)

    def one_graph(self, launches):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=self.stream):
            for launch in launches:
                launch()

        def replay():
            with torch.cuda.stream(self.stream):
                graph.replay()
        return replay
