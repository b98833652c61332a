"""The fused verify kernel's shared memory and addresses, in plain Python (no CuTe DSL):
what a CTA of a configuration holds on chip, in allocation order (docs/design.md's
table), its size, where each buffer of the reused scratch lies, and the element offset
of an operand at an index. The launch heuristics size a CTA from it
(`jax_kda.ffi.launch.kernel_split`) without building a kernel; `FusedVerify` carves
its shared memory and computes every address from it.

A buffer is (dtype name, shape); shapes are row-major.
"""
from __future__ import annotations

import math

from jax_kda import kernel_abi
from jax_kda.config import K, KdaConfig

WIDTHS = {"float32": 32, "bfloat16": 16, "int32": 32, "int64": 64}  # bits of a dtype
BARRIERS = ("exchange", "state_arrived", "gates_arrived", "pairs_arrived")  # one mbarrier each


def footprint(buffers) -> int:
    """Bytes of the (dtype, shape) buffers laid out one after another, 16-byte aligned."""
    return sum(-(-math.prod(shape) * WIDTHS[dtype] // 128) * 16 for dtype, shape in buffers)


def carve(buffers) -> list:
    """(byte offset, dtype, shape) of each of the (dtype, shape) buffers laid out one
    after another from 0, 16-byte aligned each."""
    placed, offset = [], 0
    for dtype, shape in buffers:
        placed.append((offset, dtype, shape))
        offset += footprint([(dtype, shape)])
    return placed


class FusedLayout:
    """The shared memory and addresses of `config` at `split` CTAs per (request, head):
    RC = 128 / split state rows per CTA (`rows`)."""

    def __init__(self, config: KdaConfig, split: int):
        self.config, self.split = config, split
        self.tokens, self.record_tokens = config.tokens, config.rq
        self.lazy = config.checkpoint_every > 1  # a verify may keep its replayed tokens
        self.trees = config.trees
        self.state_dtype = config.state_dtype.name  # the checkpoint's storage
        self.rows = K // split
        self.sizes = kernel_abi.sizes_of(config, None, None, None)

    def staged(self):
        """This CTA's state rows as they lie in global memory: (dtype, [RC, K]), the
        state's dtype (f32 or bf16)."""
        return self.state_dtype, (self.rows, K)

    def early_buffers(self):
        """Staged operands read before the state pass: the inputs x [T, 3, K] and the
        window [3, K, W], last: the first late buffer (8 T K bytes) outsizes x (6 T K)
        and lies over the window's first bytes, so it is written once the window is
        copied out (a CTA barrier between). (The records are staged over old_decays:
        `FusedVerify.records`.)"""
        T, W = self.tokens, self.config.window
        return [("bfloat16", (T, 3, K)), ("bfloat16", (3, K, W))]

    def late_buffers(self):
        """Written from the state pass on: Gamma k and Gamma q [2T, K] and the rows' dots
        [RC, 2T + 1]."""
        T, RC = self.tokens, self.rows
        return [("float32", (2 * T, K)), ("float32", (RC, 2 * T + 1))]

    def scratch_bytes(self):
        """The bytes the early buffers and then the late ones share."""
        return max(footprint(self.early_buffers()), footprint(self.late_buffers()))

    def shared_buffers(self):
        """The other shared buffers, in allocation order: name -> (dtype, shape); kx (lazy
        builds) lies over decays where it fits (`kx_over_decays`); tree builds add each
        node's parent, its strict ancestors as bits and the kept tokens' record
        positions in replay order."""
        T, RQ, RC, NP = self.tokens, self.record_tokens, self.rows, self.tokens ** 2
        return {"gate_in": ("bfloat16", (T, RC)), "kp": ("float32", (RQ, K)),
                "old_decays": ("float32", (RQ, K)), "decay_n": ("float32", (K,)),
                "old_u": ("float32", (RQ, RC)), "decays": ("float32", (T, K)),
                "raw_gates": ("bfloat16", (T, K)), "values_v": ("float32", (T, K)),
                "norm_sums": ("float32", (T, 2, 4)), "old_sums": ("float32", (RQ, 4)),
                "pairs": ("float32", (NP, 4)), "pair_sums": ("float32", (NP,)),
                "betas": ("float32", (T,)), "out_sums": ("float32", (T, 4)),
                "received": ("float32", (self.split, T)),
                **({"kx": ("float32", (RQ, 2 * T))} if self.lazy and not self.kx_over_decays()
                   else {}),
                **({"parents": ("int32", (T,)), "ancestors": ("int32", (T,)),
                    "order": ("int32", (RQ,))} if self.trees else {})}

    def kx_over_decays(self):
        """Whether a lazy build's kx [RQ, 2T] f32 takes the bytes of decays [T, K] f32
        (read by then): where 2 RQ <= K."""
        return 2 * self.record_tokens <= K

    def shared_bytes(self):
        """Dynamic shared memory per CTA (an upper bound: every alignment padded)."""
        staged = footprint([self.staged()])
        return (staged + 128 + self.scratch_bytes() + 128
                + footprint(self.shared_buffers().values()) + 16 + 8 * len(BARRIERS))

    def offset(self, name, *index):
        """Element offset of operand `name` at `index` (the leading indices; the rest are
        0), row-major by the operand table's sizes: every address the kernel computes is
        one of these (it passes index[0] as an Int64)."""
        dims = [self.sizes[d] if isinstance(d, str) else d
                for d in next(op for op in kernel_abi.OPERANDS if op.name == name).dims]
        total = index[0]
        for size, i in zip(dims[1:], index[1:]):
            total = total * size + i
        return total * math.prod(dims[len(index):])
