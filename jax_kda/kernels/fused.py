"""The fused verify kernel (docs/spec.md; its layout is docs/design.md): one pass over
each request's FP32 state replays the accepted tokens of the last verify into the
checkpoint (closed form), verifies this step's T tokens from it in chunked (WY) form
and records them. A tree build (`KdaConfig.trees`) verifies a token tree the same way,
each node along its own path: its decays, pair products, solve and convolution taken
over its ancestors only (selected, never multiplied by zero), and replays the accepted
path's records in its order.

A cluster of `split` CTAs of 256 threads per (request, head); CTA `rank` owns the state
rows [rank RC, (rank + 1) RC), RC = 128 / split. Every CTA of the item recomputes the
per-token operands (convolution, norms); the gate projection is shared instead (each
CTA projects its channel share and pushes the decays to its peers over distributed
shared memory), and so are the pair products where they come in two units or more
(`shared_pairs`) and the gated RMSNorm's sums of squares. Before
`griddepcontrol.wait` the kernel reads only the weights (no earlier op of a program can
be writing them); a stacked call's layer index, which one may be, is read there too but
only to aim the weights' loads, and checked after the wait.
"""
from __future__ import annotations

import collections
import enum
from typing import NamedTuple

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64

from jax_kda import kernel_abi
from jax_kda.config import K, NORM_EPS, SOLO_SHARED, KdaConfig
from jax_kda.pytrees import AWAITING
from jax_kda.kernels.compile import Kernel, Signature
from jax_kda.kernels.fused_layout import BARRIERS, FusedLayout, carve
from jax_kda.kernels.primitives import (DTYPES, RN, aligned, allocate, bulk_copy, decays,
                                        divided_by_roots, exp, load_i32s, load_if,
                                        load_vec, load_words, mma_bf16, prefetch_line_l2,
                                        push_f32, round_bf16, row_major, sigmoids, silus_bf16,
                                        stage_rows, store_bf16x4_if, store_f32x4_if,
                                        store_vec, strided_rows, transpose_sum, tree_sum,
                                        warp_totals, wide)

THREADS = 256
CROWDED_CTAS_PER_SM = 8  # above it (at T <= 4) the state is requested with the operands
STAMPS = 16  # int64 per CTA in the timeline build: SM id, two global times, Phase clocks
RECORDS_READ = 1  # the named barrier of section 1 in `load_records` (0: the CTA's)
TOKENS_LENT, TOKENS_TAKEN = 2, 3  # `looped_vectors`' named barriers, the CTA's threads
UNROLLED_TOKENS = 14  # past it the convolution and pair products may loop (`looped_tokens`)
CONV_TOKENS = 4  # tokens an iteration of that loop takes
BATCHED_TREE_TOKENS = 12  # past it a tree's pair products go node by node (batches spill)


class Phase(enum.IntEnum):
    """The points of a CTA's life that the timeline build stamps (`FusedVerify.stamp`)."""

    START = 0
    WEIGHTS_ISSUED = 1
    WAITED = 2  # griddepcontrol.wait returned
    READS_ISSUED = 3
    GATES_PROJECTED = 4
    OPERANDS_ARRIVED = 5
    CONVOLVED = 6  # and the records loaded
    CLUSTER_SYNCED = 7
    VECTORS_READY = 8  # records and window written, token and replay vectors
    STATE_ARRIVED = 9
    STATE_PASSED = 10
    SOLVED = 11
    NORMED = 12


# The kernel's view of its operands (the table's order), and the timeline build's stamps.
Pointers = collections.namedtuple("Pointers", kernel_abi.NAMES + ("timeline",))


class Weights(NamedTuple):
    """A thread's share of the weights, in registers: conv taps and bias of its channel
    (q and k, or v), the dt_bias and f_b mma fragments of its projection block, and
    (exp input a_log, its channel's dt_bias, its row's norm weight) in `scalars`."""

    taps: object
    bias: object
    dt_gate: object
    fb_words: object
    scalars: object


Shared = collections.namedtuple("Shared", (
    "staged", "x_in", "records_in", "window", "xvec", "dots", "gate_in", "kp",
    "old_decays", "decay_n", "old_u", "decays", "raw_gates", "values_v", "norm_sums",
    "old_sums", "pairs", "pair_sums", "betas", "out_sums", "received", "exchange",
    "state_arrived", "gates_arrived", "pairs_arrived", "kx", "parents", "ancestors",
    "order"),
    defaults=(None,) * 4)  # kx: lazy builds only; the last three: tree builds only


class Item(NamedTuple):
    """The (request, head) a CTA verifies: its slot and record row, whether it is a real
    request (`live`) and keeps records, and its layer's operands (`ptr`)."""

    slot: object
    rec: object
    live: object
    has_records: object
    ptr: object


def pair_index(T, t, s, kind):
    """Position of A_ts (kind "A", s < t) or B_ts (kind "B", s <= t) in the T^2 pairs."""
    if kind == "A":
        return t * (t - 1) // 2 + s
    return T * (T - 1) // 2 + t * (t + 1) // 2 + s


class FusedVerify(Kernel):
    """The kernel of one configuration, its compile key; `__call__` launches it on a
    stream with the operands of `signature`.

    config: the `KdaConfig` (its split resolved). split: CTAs per (request, head).
    has_bias: whether conv_bias is given. conv_dtype, norm_dtype: the dtype names
    ("float32" or "bfloat16") of conv_weight and conv_bias, and of norm_weight.
    timeline: the diagnostic build that stamps each CTA's phases (`stamp`, `Phase`) into
    one more operand, a [CTAs, STAMPS] int64 tensor. solo: each CTA asks for SOLO_SHARED
    bytes of shared memory, so that no other CTA shares its SM (`jax_kda.ffi.solo_ctas`
    says where). stacked: params and cache carry a leading layer axis and the `layer`
    operand says which layer to run.
    """

    # === The host side: the compile key, the signature, the launch

    def __init__(self, config: KdaConfig, split: int, has_bias: bool, *, conv_dtype="float32",
                 norm_dtype="float32", timeline=False, solo=False, stacked=False):
        self.config, self.split, self.has_bias = config, split, has_bias
        self.conv_dtype, self.norm_dtype = conv_dtype, norm_dtype
        self.timeline, self.solo, self.stacked = timeline, solo, stacked
        self.heads, self.tokens, self.record_tokens = config.heads, config.tokens, config.rq
        self.gate_mode, self.lower_bound = config.gate_mode, config.lower_bound
        self.lazy = config.checkpoint_every > 1  # a verify may keep its replayed tokens
        self.trees = config.trees
        self.state_bytes = config.state_dtype.itemsize  # 4, or 2 for a bf16 checkpoint
        self.scale, self.eps = config.query_scale, config.eps
        self.layout = FusedLayout(config, split)
        self.rows = self.layout.rows  # RC: state rows per CTA
        # RPT: 4 rows per thread where the 2T x 4 dot accumulators fit the registers
        # (T <= 5), else 2 up to T = 8, else 1 (2 spill at T = 9 and 10, the gate
        # projection's second tile beside them); at most 32 threads per row (splits >= 4)
        rows = 4 if 2 * self.tokens * 4 <= 40 else 2 if self.tokens <= 8 else 1
        self.rows_per_thread = min(rows, self.rows * 32 // THREADS)
        self.lanes = THREADS * self.rows_per_thread // self.rows  # threads per row
        self.chunks = K // (4 * self.lanes)  # KCH: 4-key chunks per thread and row
        self.tiles = -(-self.tokens // 8)  # the gate projection's mma tiles of 8 tokens

    def pair_units(self):
        """(by node, units): the pair products go node by node (T units) where they loop
        (`looped_tokens`) or in a tree past BATCHED_TREE_TOKENS tokens, the others in
        batches of 32 pairs."""
        if self.looped_tokens() or (self.trees and self.tokens > BATCHED_TREE_TOKENS):
            return True, self.tokens
        return False, -(-self.tokens ** 2 // 32)

    def looped_tokens(self):
        """Whether the convolution (`convolve`) and the pair products
        (`looped_node_pairs`) loop over the tokens at run time: past UNROLLED_TOKENS
        tokens at split > 1. With the convolution's loop, T = 9 to 14 at gate_mode 1 and
        split 2 spilled 112 bytes of operand pointers, a tree of 16 at gate_mode 1 and
        split 1 96 bytes (a split a launch of 8 tokens or more takes only when asked:
        `jax_kda.ffi.kernel_split`)."""
        return self.tokens > UNROLLED_TOKENS and self.split > 1

    def shared_pairs(self):
        """Whether the cluster's CTAs share the pair products (which each would compute
        whole), each computing its units and pushing them to every CTA: at split > 1,
        where there are two units or more, but a tree's batches past 8 nodes (each
        batch's pairs hold their paths' decays: 24 bytes spilled at 12 nodes)."""
        by_node, units = self.pair_units()
        batched_tree = self.trees and not by_node and self.tokens > 8
        return self.split > 1 and units >= 2 and not batched_tree

    def pair_owner(self, unit: int):
        """The rank of the CTA that computes pair unit `unit`; None where each computes
        every unit. Batches, and looped nodes (each one iteration's work), in turn;
        unrolled nodes (2t + 1 pairs each) there and back, 0, 1, ..., 1, 0, which evens
        the CTAs' pairs out."""
        if not self.shared_pairs():
            return None
        if not self.pair_units()[0] or self.looped_tokens():
            return unit % self.split
        turn = unit % (2 * self.split)
        return turn if turn < self.split else 2 * self.split - 1 - turn

    def key(self):
        return (self.config, self.split, self.has_bias, self.conv_dtype, self.norm_dtype,
                self.timeline, self.solo, self.stacked)

    def role(self):
        """verify_t{T}_split{split}, then _tree, _bf16_state, _keep{C} where they hold."""
        return "".join([f"verify_t{self.tokens}_split{self.split}",
                        "_tree" if self.trees else "",
                        "_bf16_state" if self.state_bytes == 2 else "",
                        f"_keep{self.config.checkpoint_every}" if self.lazy else ""])

    @property
    def dims(self):
        """B requests, S slots, R record rows, L layers (stacked builds'); CTAS, the
        timeline build's rows of stamps."""
        return ("B", "S", "R", "L") + (("CTAS",) if self.timeline else ())

    def signature(self, B, S, R, L, ctas=None):
        """The operand table's operands at B, S, R and L (`kernel_abi`; inputs None where
        the build takes none, outputs only the build's; conv_weight and conv_bias of
        conv_dtype, norm_weight of norm_dtype), then the timeline build's stamps
        [ctas, STAMPS] int64."""
        sizes = kernel_abi.sizes_of(self.config, B, S, R, L)
        own = {"conv_weight": self.conv_dtype, "norm_weight": self.norm_dtype,
               "state": self.layout.state_dtype}

        def operand(op):
            if not kernel_abi.present(op, self.has_bias, self.stacked, self.trees):
                return None
            return kernel_abi.shape(op, sizes, self.stacked), kernel_abi.dtype(op, own)

        stamps = (((ctas, STAMPS), "int64"),) if self.timeline else ()
        outputs = [operand(op) for op in kernel_abi.OUTPUTS]
        return Signature(tuple(map(operand, kernel_abi.INPUTS)),
                         tuple(o for o in outputs if o is not None) + stamps,
                         tuple(kernel_abi.aliases(self.has_bias, self.stacked,
                                                  self.trees).items()))

    @cute.jit
    def __call__(self, stream: cuda.CUstream, *tensors):
        """Launches the grid (split, H, B) on `stream`; tensors: the operand table's,
        in its order (None for an operand the build takes not), then the timeline
        build's stamps."""
        named = dict(zip(kernel_abi.NAMES + ("timeline",), tensors))
        lead = 1 if self.stacked else 0
        num_slots, num_records = named["state"].shape[lead], named["pending"].shape[lead]
        num_layers = named["state"].shape[0] if self.stacked else 1
        stand_in = {"conv_bias": "conv_weight", "layer": "slots", "parents": "slots",
                    "nodes": "pending", "timeline": "out"}
        ptr = Pointers(*[(named[n] if named.get(n) is not None else named[stand_in[n]]
                          ).iterator for n in Pointers._fields])  # stand-ins never read
        cluster = (self.split, 1, 1) if self.split > 1 else None
        self.kernel(ptr, Int32(num_slots), Int32(num_records), Int32(num_layers)).launch(
            grid=(self.split, self.heads, named["slots"].shape[0]), block=(THREADS, 1, 1),
            cluster=cluster, stream=stream, use_pdl=True, min_blocks_per_mp=2,
            smem=max(self.layout.shared_bytes(), SOLO_SHARED) if self.solo else None,
            preferred_smem_carveout=100)

    # === The device body: the kernel, a live item's phases in run order, a padding row

    @cute.kernel
    def kernel(self, ptr: Pointers, num_slots: Int32, num_records: Int32, num_layers: Int32):
        tid, _, _ = cute.arch.thread_idx()
        rank, head, request = cute.arch.block_idx()
        smem = self.shared_memory()
        self.stamp(ptr.timeline, Phase.START, tid)
        projecting, block = self.projection_role(rank, tid)
        if cutlass.const_expr(self.split > 1):
            self.arm(smem.gates_arrived, self.tokens * K * 4, tid)
            if cutlass.const_expr(self.shared_pairs()):
                self.arm(smem.pairs_arrived, self.tokens ** 2 * 4 * 4, tid)
            cute.arch.cluster_arrive_relaxed()  # waited on before the decays are pushed
        guess = self.guess_layer(ptr, num_layers)
        weights = self.load_weights(self.at_layer(ptr, guess, num_slots, num_records), head,
                                    projecting, block, tid)
        ctas = cute.arch.grid_dim()[2] * (self.heads * self.split)
        if 2 * ctas <= (1 if self.solo else 2) * cute.arch.nsmid():
            # The next launch's CTAs all fit beside this one's, so every CTA starts while
            # the previous launch runs and sits in griddepcontrol.wait: that time warms
            # L2 with the item's operands, which then take L2's latency, not HBM's.
            self.prefetch(self.at_layer(ptr, guess, num_slots, num_records), num_slots,
                          num_records, request, head, rank, tid)
        self.stamp(ptr.timeline, Phase.WEIGHTS_ISSUED, tid)
        cute.arch.griddepcontrol_wait()
        self.stamp(ptr.timeline, Phase.WAITED, tid)
        read = [(ptr.slots, request), (ptr.record_rows, request)]
        if cutlass.const_expr(self.stacked):
            read.append((ptr.layer, 0))
        loaded = load_i32s(read)
        slot, rec, layer = loaded[0], loaded[1], guess
        if cutlass.const_expr(self.stacked):
            layer = loaded[2]
        # While the slot is on its way: every read that does not depend on it (loaded
        # here, used only once every other read of the item is in flight).
        activation_words = self.load_activations(ptr.f_a, request, projecting, tid)
        beta_t = load_if(ptr.beta, self.offset("beta", request,
                                               cutlass.min(tid, self.tokens - 1), head),
                         tid < self.tokens)
        parent_t = Int32(0)
        if cutlass.const_expr(self.trees):
            parent_t = load_if(ptr.parents, self.offset("parents", request,
                                                        cutlass.min(tid, self.tokens - 1)),
                               tid < self.tokens)
        self.stage_inputs(smem, ptr, request, head, rank, tid)
        item = self.resolve(ptr, weights, guess, slot, rec, layer, num_slots, num_records,
                            num_layers, head, projecting, block, tid)
        if item.live:
            self.verify_item(smem, weights, item, activation_words, beta_t, parent_t, ctas,
                             request, head, rank, projecting, block, tid)
        else:
            self.padding_row(ptr, request, head, rank, tid)

    @cute.jit
    def verify_item(self, smem, weights, item, activation_words, beta_t, parent_t, ctas,
                    request, head, rank, projecting, block, tid):
        """A live item, phase by phase: every read issued at once, the gate projection
        while they land, the per-token operands, the records and window written, the
        state pass, the T x T solve and the gated RMSNorm."""
        T: cutlass.Constexpr = self.tokens
        RQ: cutlass.Constexpr = self.record_tokens
        ptr, timeline = item.ptr, item.ptr.timeline
        pending_n = load_if(ptr.pending, self.offset("pending", item.rec, head),
                            item.has_records)
        position_t = Int32(0)
        if cutlass.const_expr(self.trees):  # the record position of kept token tid
            position_t = load_if(ptr.nodes, self.offset("nodes", item.rec, head,
                                                        cutlass.min(tid, RQ - 1)),
                                 item.has_records & (tid < RQ))
        crowded = self.issue_reads(smem, item, ctas, head, rank, tid)
        self.stamp(timeline, Phase.READS_ISSUED, tid)
        a_exp = exp(weights.scalars[0])
        if cutlass.const_expr(self.split > 1):
            cute.arch.cluster_wait()
        if projecting:
            self.gate_projection(activation_words, ptr.f_a, request, weights.fb_words,
                                 weights.dt_gate, a_exp, smem.decays, smem.raw_gates,
                                 smem.gates_arrived, block, tid)
        # the pending count and beta arrive behind the slot: used only now
        n, write, base = self.kept(pending_n)
        if tid < T:
            smem.betas[tid] = sigmoids([beta_t])[0]
        if cutlass.const_expr(self.trees):
            self.store_tree(smem, parent_t, position_t, tid)
        self.stamp(timeline, Phase.GATES_PROJECTED, tid)
        self.await_operands(smem, item, crowded, head, rank, tid)
        self.stamp(timeline, Phase.OPERANDS_ARRIVED, tid)
        if cutlass.const_expr(self.trees):
            self.find_ancestors(smem.parents, smem.ancestors, tid)
        activations = self.convolve(smem, weights.taps, weights.bias, n, base, tid)
        self.load_records(smem, a_exp, weights.scalars[1], n, tid)
        cute.arch.griddepcontrol_launch_dependents()
        cute.arch.barrier()
        self.stamp(timeline, Phase.CONVOLVED, tid)
        if cutlass.const_expr(self.split > 1):
            cute.arch.cluster_wait()  # every CTA of the item has read the old records
        self.stamp(timeline, Phase.CLUSTER_SYNCED, tid)
        self.write_records(ptr, activations, smem, item, base, head, rank, tid)
        cute.arch.barrier()  # the window copied out: Gamma q's last rows lie over it
        self.vectors(smem, activations, n, rank, tid)
        low_rank = self.low_rank(smem, n, write, tid)
        self.stamp(timeline, Phase.VECTORS_READY, tid)
        self.state_pass(ptr.state, smem, item.slot, n, write, low_rank, head,
                        rank * self.rows, timeline, tid)
        cute.arch.barrier()
        self.stamp(timeline, Phase.STATE_PASSED, tid)
        outs, gated = self.solve_rows(ptr.corrections, smem, item, n, low_rank, base, head,
                                      rank * self.rows, tid)
        self.stamp(timeline, Phase.SOLVED, tid)
        self.gated_norm(ptr.out, outs, gated, smem, weights.scalars[2], request, head, rank,
                        tid)
        self.stamp(timeline, Phase.NORMED, tid)

    @cute.jit
    def padding_row(self, ptr, request, head, rank, tid):
        """A padding row: zero outputs, nothing else touched."""
        if cutlass.const_expr(self.split > 1):
            cute.arch.cluster_wait()  # this thread's arrival is matched
        cute.arch.cp_async_commit_group()
        cute.arch.cp_async_wait_group(0)  # no copy may land after the CTA is gone
        if tid < self.rows:
            for t in cutlass.range_constexpr(self.tokens):
                ptr.out[self.offset("out", request, t, head, rank * self.rows + tid)] = \
                    BFloat16(0.0)
        cute.arch.griddepcontrol_launch_dependents()

    # === Setup: shared memory, addresses, the warps' roles, barriers, stamps

    @cute.jit
    def shared_memory(self):
        """The CTA's shared memory as `FusedLayout` plans it, carved once: a `Shared` of
        every buffer and mbarrier. The item's small operands, staged by cp.async and read
        before the state pass, share their bytes with the state pass's vectors and the
        rows' dots."""
        layout = self.layout
        smem = cutlass.memory.SmemAllocator()
        dtype, shape = layout.staged()
        staged = smem.allocate_tensor(DTYPES[dtype], row_major(*shape), byte_alignment=128)
        scratch = smem.allocate(layout.scratch_bytes(), byte_alignment=128)
        buffers = allocate(smem, layout.shared_buffers())
        barriers = {name: smem.allocate_array(Int64, 1, byte_alignment=8)
                    for name in BARRIERS}
        x_in, window, xvec, dots = [
            cute.make_tensor(cute.recast_ptr(scratch + at, dtype=DTYPES[dtype]),
                             row_major(*shape))
            for at, dtype, shape in carve(layout.early_buffers())
            + carve(layout.late_buffers())]
        if cutlass.const_expr(self.lazy and layout.kx_over_decays()):  # read by then
            buffers["kx"] = cute.make_tensor(buffers["decays"].iterator,
                                             row_major(self.record_tokens, 2 * self.tokens))
        return Shared(staged=staged, x_in=x_in, records_in=self.records(buffers["old_decays"]),
                      window=window, xvec=xvec, dots=dots, **buffers, **barriers)

    def records(self, old_decays):
        """The staged records [RQ, 2, K] bf16 over old_decays [RQ, K] f32: record t and
        old_decays' row t are the same 4 K bytes, so `load_records` may write a token's
        decays once every thread has read its record."""
        return cute.make_tensor(cute.recast_ptr(old_decays.iterator, dtype=BFloat16),
                                row_major(self.record_tokens, 2, K))

    def offset(self, name, *index):
        """Element offset (Int64) of operand `name` at `index` (`FusedLayout.offset`):
        every address the kernel computes is one of these."""
        return self.layout.offset(name, wide(index[0]), *index[1:])

    @cute.jit
    def stamp(self, timeline, phase: cutlass.Constexpr, tid):
        """Diagnostics (timeline=True): thread 0 writes the SM clock at `phase` of its CTA
        into timeline [CTAs, STAMPS] int64, after the SM id and the global timer at the
        start, the global timer again at the end."""
        if cutlass.const_expr(self.timeline):
            if tid == 0:
                rank, head, request = cute.arch.block_idx()
                row = wide((request * self.heads + head) * self.split + rank) * STAMPS
                if cutlass.const_expr(phase == Phase.START):
                    timeline[row] = Int64(cute.arch.smid())
                    timeline[row + 1] = cute.arch.globaltimer()
                timeline[row + 3 + int(phase)] = cute.arch.clock64()
                if cutlass.const_expr(phase == Phase.NORMED):
                    timeline[row + 2] = cute.arch.globaltimer()

    def projection_role(self, rank, tid):
        """(projecting, block): whether this thread's warp runs the gate projection, and
        of which 16-feature block. f_b is read once per cluster: the last 8 / split warps
        of CTA `rank` project the blocks rank 8 / split + [0, 8 / split) of its channel
        share (the last warps: section 1's convolution is the lighter one)."""
        PW = 8 // self.split
        block = tid // 32 - (8 - PW) + rank * PW
        projecting = True if self.split == 1 else tid // 32 >= 8 - PW
        return projecting, block

    @cute.jit
    def arm(self, barrier, tx_bytes: cutlass.Constexpr, tid):
        """Thread 0 makes `barrier` an mbarrier of one arrival that also waits for
        tx_bytes of copies or DSMEM pushes."""
        if tid == 0:
            cute.arch.mbarrier_init(barrier, 1)
            cute.arch.mbarrier_init_fence()
            cute.arch.mbarrier_arrive_and_expect_tx(barrier, tx_bytes)

    # === Phase 1 (START .. WEIGHTS_ISSUED): weights and L2 prefetches, before the wait

    @cute.jit
    def guess_layer(self, ptr, num_layers):
        """A stacked call's layer before griddepcontrol.wait, to aim the weights' loads:
        read from L2 (an earlier op may still be writing it; `resolve` reads it again
        after the wait), clamped into range. 0 for one layer's call."""
        layer = Int32(0)
        if cutlass.const_expr(self.stacked):
            layer = load_i32s([(ptr.layer, 0)], speculative=True)[0]
            layer = cutlass.max(cutlass.min(layer, num_layers - 1), Int32(0))
        return layer

    def at_layer(self, ptr, layer, num_slots, num_records):
        """ptr with the stacked operands (weights and cache) moved to `layer`'s."""
        if not self.stacked:
            return ptr
        runtime, moved = {"S": num_slots, "R": num_records}, {}
        for op in kernel_abi.OPERANDS:
            if op.stacks:
                size = wide(layer)
                for d in op.dims:
                    size = size * (runtime[d] if d in runtime else self.layout.sizes.get(d, d))
                moved[op.name] = getattr(ptr, op.name) + size
        return ptr._replace(**moved)

    @cute.jit
    def load_weights(self, ptr, head, projecting, block, tid):
        """A thread's `Weights`, in registers."""
        weights = Weights(cute.make_rmem_tensor((2, 4), Float32),
                          cute.make_rmem_tensor(2, Float32),
                          cute.make_rmem_tensor(2, Float32),
                          cute.make_rmem_tensor((8, 4), cutlass.Uint32),
                          cute.make_rmem_tensor(3, Float32))
        self.fill_weights(weights, ptr, head, projecting, block, tid)
        return weights

    @cute.jit
    def fill_weights(self, weights, ptr, head, projecting, block, tid):
        """Loads `weights`: conv taps and bias of this thread's channel (q and k, or v),
        a_log, the dt_bias values it needs, the f_b mma fragments of feature block
        `block` if its warp is `projecting`, its row's norm weight."""
        channel, section = tid % K, tid // K
        weights.bias.fill(0.0)
        for s in cutlass.range_constexpr(2):
            part = 2 * section + s  # 0 q, 1 k, 2 v (s = 1 unused in section 1)
            if (section == 0) | (s == 0):
                for i in cutlass.range_constexpr(4):
                    weights.taps[s, i] = Float32(
                        ptr.conv_weight[self.offset("conv_weight", part, i, head, channel)])
                if cutlass.const_expr(self.has_bias):
                    weights.bias[s] = Float32(
                        ptr.conv_bias[self.offset("conv_bias", part, head, channel)])
        weights.scalars[0] = Float32(ptr.a_log[head])
        weights.scalars[1] = Float32(ptr.dt_bias[self.offset("dt_bias", head, channel)])
        if projecting:
            self.load_projection(ptr.dt_bias, ptr.f_b, head, weights.dt_gate,
                                 weights.fb_words, block, tid)
        weights.scalars[2] = Float32(0.0)
        if tid < self.rows:
            weights.scalars[2] = Float32(
                ptr.norm_weight[cute.arch.block_idx()[0] * self.rows + tid])

    @cute.jit
    def load_projection(self, dt_bias, f_b, head, dt_gate, fb_words, block, tid):
        """The dt_bias values of features 16 block + [0, 16) into dt_gate and their f_b
        mma fragments into fb_words."""
        lane = tid % 32
        group, quarter = lane // 4, lane % 4
        for i in cutlass.range_constexpr(2):
            dt_gate[i] = Float32(dt_bias[self.offset("dt_bias", head,
                                                     16 * block + group + 8 * i)])
        # A fragments of m16n8k16: features 16 block + group (+ 8) in registers 0, 2 (1, 3).
        # The k order is permuted (as the activations' is) so that a thread's ranks of
        # two chunks are 8 contiguous ones, one 16-byte load: chunk 2 p + j holds ranks
        # 32 p + 8 quarter + 4 j + [0, 4), which keeps each rank quarter in its two chunks
        # (gate_mode 1).
        for pair in cutlass.range_constexpr(4):
            for i in cutlass.range_constexpr(2):
                feature = 16 * block + group + 8 * i
                words = load_words(f_b, self.offset("f_b", head, feature,
                                                    32 * pair + 8 * quarter), 4)
                for j in cutlass.range_constexpr(2):
                    fb_words[2 * pair + j, i] = words[2 * j]
                    fb_words[2 * pair + j, 2 + i] = words[2 * j + 1]

    @cute.jit
    def prefetch(self, ptr, num_slots, num_records, request, head, rank, tid):
        """L2 prefetches of the item's small reads, before griddepcontrol.wait, one line a
        lane (`prefetch_rows`): warps 0 and 1 the inputs; warp 2, the one warp that waits
        for a read here, the slot and record row, only to aim the prefetches of the window
        and records (a stale or out-of-range value costs a useless prefetch, never a wrong
        or stray read). Not the state rows: their copy goes out early enough to land
        before the state pass, and their bytes slow a launch that does not overlap its
        predecessor (docs/performance.md)."""
        T: cutlass.Constexpr = self.tokens
        H: cutlass.Constexpr = self.heads
        RQ: cutlass.Constexpr = self.record_tokens
        W: cutlass.Constexpr = self.config.window
        lane, warp = tid % 32, tid // 32
        if warp == 0:  # x [request, t, part, head]: 3 T rows of K
            self.prefetch_rows(ptr.x, self.offset("x", request, 0, 0, head), H * K, 3 * T, K,
                               lane)
        if warp == 1:  # gate [request, t, head, this CTA's rows], f_a [request], beta
            self.prefetch_rows(ptr.gate, self.offset("gate", request, 0, head,
                                                     rank * self.rows), H * K, T,
                               self.rows, lane)
            self.prefetch_rows(ptr.f_a, self.offset("f_a", request), 0, 1, T * K, lane)
            self.prefetch_rows(ptr.beta, self.offset("beta", request, 0, head), H, T, 1,
                               lane)
        if warp == 2:
            slot, rec = load_i32s([(ptr.slots, request), (ptr.record_rows, request)],
                                  speculative=True)
            if (slot > 0) & (slot < num_slots):
                self.prefetch_rows(ptr.conv, self.offset("conv", slot, 0, head), H * K * W, 3,
                                   K * W, lane)
            if (rec >= 0) & (rec < num_records):
                self.prefetch_rows(ptr.corrections, self.offset("corrections", rec, head), 0,
                                   1, RQ * K, lane)
                self.prefetch_rows(ptr.key_gates, self.offset("key_gates", rec, head), 0, 1,
                                   RQ * 2 * K, lane)
                if lane == 0:
                    prefetch_line_l2(ptr.pending + self.offset("pending", rec, head))

    @cute.jit
    def prefetch_rows(self, src, base, stride, rows: cutlass.Constexpr,
                      row_elems: cutlass.Constexpr, lane):
        """prefetch.global.L2 of the lines of `rows` rows of `row_elems` elements at
        src + base + r stride, one line a lane per round: per-lane addresses, where a bulk
        prefetch takes its address from uniform registers, one lane at a time."""
        per_line: cutlass.Constexpr = 128 * 8 // src.dtype.width
        lines: cutlass.Constexpr = (row_elems + per_line - 1) // per_line
        for r in cutlass.range_constexpr((rows * lines + 31) // 32):
            i = lane + 32 * r
            if i < rows * lines:
                prefetch_line_l2(src + (base + wide(i // lines) * stride
                                        + (i % lines) * per_line))

    # === Phase 2 (WAITED): the reads that need no slot, then the item

    @cute.jit
    def load_activations(self, f_a, request, projecting, tid, tile: cutlass.Constexpr = 0):
        """The mma B fragments of f_a (if `projecting`) of mma tile `tile`: token
        8 tile + `group` (mod T up to 8 tokens, else the last past T), chunk 2 p + j
        holding ranks 32 p + 8 quarter + 4 j + [0, 4) as two bf16x2 words (the f_b
        fragments' k order)."""
        T: cutlass.Constexpr = self.tokens
        lane = tid % 32
        group, quarter = lane // 4, lane % 4
        token = group % T if T <= 8 else cutlass.min(8 * tile + group, T - 1)
        token_row = self.offset("f_a", request, token)
        fragments = cute.make_rmem_tensor((8, 2), cutlass.Uint32)
        if projecting:
            for pair in cutlass.range_constexpr(4):
                words = load_words(f_a, token_row + 32 * pair + 8 * quarter, 4)
                for i in cutlass.range_constexpr(4):
                    fragments[2 * pair + i // 2, i % 2] = words[i]
        return fragments

    @cute.jit
    def stage_inputs(self, smem, ptr, request, head, rank, tid):
        """cp.async of the item's token inputs x and its rows' output-gate logits."""
        T: cutlass.Constexpr = self.tokens
        H: cutlass.Constexpr = self.heads
        stage_rows(strided_rows(smem.x_in.iterator, K, ptr.x,
                                self.offset("x", request, 0, 0, head), H * K),
                   3 * T, 2 * K, tid, THREADS)
        stage_rows(strided_rows(smem.gate_in.iterator, self.rows, ptr.gate,
                                self.offset("gate", request, 0, head, rank * self.rows), H * K),
                   T, 2 * self.rows, tid, THREADS)

    @cute.jit
    def resolve(self, ptr, weights, guess, slot, rec, layer, num_slots, num_records,
                num_layers, head, projecting, block, tid):
        """The item after the wait: live where its slot (and layer) are in range, its
        layer's operands, and its weights loaded again where the guess was stale."""
        live = (slot > 0) & (slot < num_slots)
        if cutlass.const_expr(self.stacked):
            in_range = (layer >= 0) & (layer < num_layers)
            live = live & in_range
            ptr = self.at_layer(ptr, cutlass.max(cutlass.min(layer, num_layers - 1),
                                                 Int32(0)), num_slots, num_records)
            if in_range & (layer != guess):
                self.fill_weights(weights, ptr, head, projecting, block, tid)
        return Item(slot, rec, live, (rec >= 0) & (rec < num_records), ptr)

    # === Phases 3-5 (READS_ISSUED .. OPERANDS_ARRIVED): reads; gate projection meanwhile

    @cute.jit
    def issue_reads(self, smem, item, ctas, head, rank, tid):
        """Every read of the item, before anything waits on one: the window and records
        as one cp.async group, the state rows by one bulk copy. The state goes out with
        them where the grid keeps the memory busy (T <= 4 and more than
        CROWDED_CTAS_PER_SM CTAs per SM: more bytes in flight), else once they have
        landed (`await_operands`): a small grid's CTAs start together and each one's
        operands would queue behind all their states. Returns whether it is crowded."""
        T: cutlass.Constexpr = self.tokens
        H: cutlass.Constexpr = self.heads
        RQ: cutlass.Constexpr = self.record_tokens
        RC: cutlass.Constexpr = self.rows
        W: cutlass.Constexpr = self.config.window
        ptr = item.ptr
        if cutlass.const_expr(self.split > 1):
            self.arm(smem.exchange, self.split * T * 4, tid)
        stage_rows(strided_rows(smem.window.iterator, K * W, ptr.conv,
                                self.offset("conv", item.slot, 0, head), H * K * W),
                   3, 2 * K * W, tid, THREADS)
        if item.has_records:
            stage_rows(strided_rows(smem.old_u.iterator, RC, ptr.corrections,
                                    self.offset("corrections", item.rec, head, 0, rank * RC),
                                    K), RQ, 4 * RC, tid, THREADS)
            stage_rows(strided_rows(smem.records_in.iterator, RQ * 2 * K, ptr.key_gates,
                                    self.offset("key_gates", item.rec, head), 0),
                       1, 2 * RQ * 2 * K, tid, THREADS)
        cute.arch.cp_async_commit_group()
        crowded = (ctas > CROWDED_CTAS_PER_SM * cute.arch.nsmid()) & (T <= 4)
        self.arm(smem.state_arrived, RC * K * self.state_bytes, tid)
        if crowded:
            cute.arch.barrier()  # queued behind every thread's small copies, not among them
            if tid == 0:
                self.request_state(smem, ptr.state, item.slot, head, rank)
        return crowded

    @cute.jit
    def request_state(self, smem, state, slot, head, rank):
        """This CTA's state rows (contiguous) into smem.staged by one bulk copy."""
        bulk_copy(smem.staged.iterator,
                  aligned(state, self.offset("state", slot, head, rank * self.rows), 16),
                  self.rows * K * self.state_bytes, smem.state_arrived)

    @cute.jit
    def gate_projection(self, activation_words, f_a, request, fb_words, dt_gate, a_exp,
                        decays_out, raw_gates, gates_arrived, block, tid):
        """raw_g = bf16(f_a . f_b[h]^T) with bf16 mma (this warp: features 16 block +
        [0, 16), tokens as the 8 columns of each tile) into raw_gates, and this step's
        decays into decays_out, pushed to every CTA of the cluster (their
        `gates_arrived`) where split > 1. activation_words: tile 0's fragments, loaded
        early; a later tile's are loaded here (held from the start they would spill)."""
        for tile in cutlass.range_constexpr(self.tiles):
            words = activation_words
            if cutlass.const_expr(tile > 0):
                words = self.load_activations(f_a, request, True, tid, tile)
            self.project_tile(words, fb_words, dt_gate, a_exp, decays_out, raw_gates,
                              gates_arrived, block, tile, tid)

    @cute.jit
    def project_tile(self, activation_words, fb_words, dt_gate, a_exp, decays_out,
                     raw_gates, gates_arrived, block, tile: cutlass.Constexpr, tid):
        """`gate_projection` of the tokens 8 tile + [0, 8) (mod T up to 8 tokens)."""
        T: cutlass.Constexpr = self.tokens
        lane = tid % 32
        group, quarter = lane // 4, lane % 4
        chains: cutlass.Constexpr = 4 if self.gate_mode == 1 else 1
        acc = cute.make_rmem_tensor((chains, 4), Float32)
        acc.fill(0.0)
        for chunk in cutlass.range_constexpr(8):
            chain: cutlass.Constexpr = chunk // 2 if self.gate_mode == 1 else 0
            d = mma_bf16([fb_words[chunk, i] for i in range(4)],
                         [activation_words[chunk, i] for i in range(2)],
                         [acc[chain, e] for e in range(4)])
            for e in cutlass.range_constexpr(4):
                acc[chain, e] = d[e]
        raw = []
        for e in cutlass.range_constexpr(4):
            total = acc[0, e]
            if cutlass.const_expr(self.gate_mode == 1):
                total = ((acc[0, e] + acc[1, e]) + acc[2, e]) + acc[3, e]
            raw.append(round_bf16(total))
        # Lane (group, quarter) holds features 16 block + group + 8 (e // 2) of columns
        # 2 quarter + e % 2, and column c is token c % T. For T = 2 and 4 every value is
        # held twice or four times: each lane takes T / 2 distinct ones (feature half
        # quarter // 2, tokens T / 2 (quarter % 2) + [0, T / 2)), halving the decays.
        per: cutlass.Constexpr = T // 2 if T in (2, 4) else 4
        values, tokens, features, dts = raw, [], [], []
        if cutlass.const_expr(per < 4):
            upper = quarter >= 2
            odd = (quarter % 2) == 1
            values = []
            for i in cutlass.range_constexpr(per):
                if cutlass.const_expr(per == 2):
                    values.append(cutlass.select_(upper, raw[2 + i], raw[i]))
                else:
                    values.append(cutlass.select_(upper, cutlass.select_(odd, raw[3], raw[2]),
                                                  cutlass.select_(odd, raw[1], raw[0])))
                tokens.append(per * (quarter % 2) + i)
                features.append(16 * block + group + 8 * (quarter // 2))
                dts.append(cutlass.select_(upper, dt_gate[1], dt_gate[0]))
        else:
            for e in cutlass.range_constexpr(4):
                tokens.append(8 * tile + 2 * quarter + e % 2)
                features.append(16 * block + group + 8 * (e // 2))
                dts.append(dt_gate[e // 2])
        gates = decays(values, a_exp, dts, self.lower_bound)
        for i in cutlass.range_constexpr(per):
            if tokens[i] < T:  # columns token >= T (T not 2 or 4) repeat another token
                raw_gates[tokens[i], features[i]] = BFloat16(values[i])
                if cutlass.const_expr(self.split > 1):
                    for peer in cutlass.range_constexpr(self.split):
                        push_f32(decays_out.iterator + tokens[i] * K + features[i], gates[i],
                                 gates_arrived, peer)
                else:
                    decays_out[tokens[i], features[i]] = gates[i]

    @cute.jit
    def kept(self, pending):
        """(n, write, base) of a (request, head) from its pending count: n the records it
        replays (pending, or m where it awaits an accept as -(m + 1)), clamped to
        [0, RQ]; write whether S_n goes to the checkpoint (n > 0, and with
        checkpoint_every > 1 only where the records lack room for T more: n + T > RQ);
        base where this verify's T records go (n where it keeps the n, else 0)."""
        RQ: cutlass.Constexpr = self.record_tokens
        n = cutlass.select_(pending < 0, Int32(-1) - pending, pending)
        n = cutlass.max(cutlass.min(n, Int32(RQ)), Int32(0))
        write, base = n > 0, Int32(0)
        if cutlass.const_expr(self.lazy):
            write = n + self.tokens > RQ
            base = cutlass.select_(write, Int32(0), n)
        return n, write, base

    @cute.jit
    def store_tree(self, smem, parent_t, position_t, tid):
        """Tree builds: node tid's parent as the contract reads it (-1 for node 0, a
        parent outside [0, tid) is node 0) and kept token tid's record position, clamped
        into the row, into shared memory."""
        if tid < self.tokens:
            valid = (parent_t >= 0) & (parent_t < tid)
            smem.parents[tid] = cutlass.select_(tid == 0, Int32(-1),
                                                cutlass.select_(valid, parent_t, Int32(0)))
        if tid < self.record_tokens:
            smem.order[tid] = cutlass.max(cutlass.min(position_t,
                                                      Int32(self.record_tokens - 1)), Int32(0))

    @cute.jit
    def await_operands(self, smem, item, crowded, head, rank, tid):
        """The window and records landed; then the state's request where the grid is not
        crowded. The cluster arrival says this CTA has read the old window and records
        and armed its exchange barrier; the peers wait for it only before writing the
        records, so the convolution hides their skew. Relaxed: the copies are waited on
        and the barriers' inits fenced, and a release fence would cost more."""
        cute.arch.cp_async_wait_group(0)
        cute.arch.barrier()
        if cutlass.const_expr(self.split > 1):
            cute.arch.cluster_arrive_relaxed()
        if (tid == 0) & (crowded == False):  # noqa: E712 - a device Boolean
            self.request_state(smem, item.ptr.state, item.slot, head, rank)

    # === Phases 6-7 (CONVOLVED, CLUSTER_SYNCED): convolution; records read, then written

    @cute.jit
    def find_ancestors(self, parents, ancestors, tid):
        """Tree builds: node t's strict ancestors as bits into ancestors[t], by thread
        K + t (section 1: the lighter convolution) walking its path up to the root; read
        once the records are loaded (their barrier)."""
        T: cutlass.Constexpr = self.tokens
        t = tid - K
        if (t >= 0) & (t < T):
            bits, node = Int32(0), parents[t]
            for _ in cutlass.range_constexpr(T - 1):  # a path holds at most T - 1 above t
                up = node >= 0
                bits = cutlass.select_(up, bits | (Int32(1) << cutlass.max(node, Int32(0))),
                                       bits)
                node = cutlass.select_(up, parents[cutlass.max(node, Int32(0))], Int32(-1))
            ancestors[t] = bits

    def ancestor_bits(self, smem):
        """A tree build's nodes' strict ancestors as bits (`find_ancestors`): the [T]
        Int32 shared buffer, read where used (held in registers, T = 16's pair products
        spill); None for a chain."""
        return smem.ancestors if self.trees else None

    def on_path(self, ancestors, t: int, s: int):
        """Whether node s lies on node t's path (s < t: a strict ancestor; s == t: t)."""
        if s == t:
            return True
        return (ancestors[t] & Int32(1 << s)) != Int32(0)

    def path_factor(self, ancestors, t: int, r: int, value):
        """`value` (node r's factor) where node r lies on node t's path or the build
        verifies a chain, else 1: an off-path value is selected away, never used."""
        if ancestors is None or r == t:
            return value
        return cutlass.select_(self.on_path(ancestors, t, r), value, Float32(1.0))

    @cute.jit
    def history_position(self, order, n, i: cutlass.Constexpr):
        """The window position of conv history input i (0..2) of a tree build: that of
        kept token j = n - 3 + i, order[j] + 3, or j + 3 before record 0."""
        j = n - 3 + i
        return cutlass.select_(j >= 0, order[cutlass.max(j, Int32(0))] + 3, j + 3)

    @cute.jit
    def convolve(self, smem, taps, bias, n, base, tid):
        """The short convolution and SiLU of this thread's channel: q and k (section 0,
        parts 0 and 1; sums of squares per warp into norm_sums) or v (section 1, part 2;
        into values_v), from the staged window (whole: staged before n was known) and
        inputs x_in. The history is window[n .. n+2] (a tree build's: the kept path's
        last three inputs, `history_position`); the channel's new window [history,
        x_0 .. x_{T-1}] replaces positions base .. base + T + 2 in place. Where
        `looped_tokens`, the tokens go CONV_TOKENS at a time through a runtime loop
        (`convolve_group`, the SiLUs into x_in): the warps run this code once, and the
        copies of it for every token waited on instruction fetch. Returns the
        activations."""
        T: cutlass.Constexpr = self.tokens
        looped: cutlass.Constexpr = self.looped_tokens()
        window, x_in = smem.window, smem.x_in
        history = [n + i for i in range(3)]
        if cutlass.const_expr(self.trees):
            history = [self.history_position(smem.order, n, i) for i in range(3)]
        channel, section = tid % K, tid // K
        lane, warp = tid % 32, tid // 32
        activations = cute.make_rmem_tensor((2, T), Float32)
        activations.fill(0.0)
        for s in cutlass.range_constexpr(2):
            part = 2 * section + s
            if (section == 0) | (s == 0):
                seq = cute.make_rmem_tensor(T + 3, Float32)
                for i in cutlass.range_constexpr(3):
                    seq[i] = Float32(window[part, channel, history[i]])
                for t in cutlass.range_constexpr(T):
                    seq[3 + t] = Float32(x_in[t, part, channel])
                for i in cutlass.range_constexpr(T + 3):
                    window[part, channel, base + i] = BFloat16(seq[i])
                if cutlass.const_expr(not looped):
                    for t in cutlass.range_constexpr(T):
                        activations[s, t] = self.tap_sum(smem, taps, bias, s, part, base, t,
                                                         [seq[t + i] for i in range(4)], tid)
        if cutlass.const_expr(looped):
            whole: cutlass.Constexpr = T - T % CONV_TOKENS
            for first in cutlass.range(0, whole, CONV_TOKENS, unroll=1):
                self.convolve_group(smem, taps, bias, base, first, CONV_TOKENS, tid)
            if cutlass.const_expr(T % CONV_TOKENS > 0):
                self.convolve_group(smem, taps, bias, base, Int32(whole), T % CONV_TOKENS,
                                    tid)
            for i in cutlass.range_constexpr(2 * T):
                if (section == 0) | (i < T):
                    part = 2 * section + i // T
                    activations[i // T, i % T] = Float32(x_in[i % T, part, channel])
        else:
            # the SiLUs of a thread as one batch (see primitives.quotients)
            if section == 0:
                silus = silus_bf16([activations[s, t] for s in range(2) for t in range(T)])
                for i in cutlass.range_constexpr(2 * T):
                    activations[i // T, i % T] = silus[i]
            else:
                silus = silus_bf16([activations[0, t] for t in range(T)])
                for t in cutlass.range_constexpr(T):
                    activations[0, t] = silus[t]
        if section == 0:
            squares, index, holds = warp_totals(
                [activations[s, t] * activations[s, t] for t in range(T) for s in range(2)],
                lane)
            if holds:
                smem.norm_sums[index // 2, index % 2, warp] = squares
        else:
            for t in cutlass.range_constexpr(T):
                smem.values_v[t, channel] = activations[0, t]
        return activations

    @cute.jit
    def convolve_group(self, smem, taps, bias, base, first, count: cutlass.Constexpr, tid):
        """`convolve`'s loop body: tokens first .. first + count - 1 of this thread's
        parts, their inputs read from the new window's row, their SiLUs (one batch)
        rounded to bf16 into x_in over the group's inputs (read by then)."""
        window, x_in = smem.window, smem.x_in
        channel, section = tid % K, tid // K
        ys = cute.make_rmem_tensor((2, count), Float32)
        for s in cutlass.range_constexpr(2):
            part = 2 * section + s
            if (section == 0) | (s == 0):
                row = [Float32(window[part, channel, base + first + i])
                       for i in range(count + 3)]
                for j in cutlass.range_constexpr(count):
                    ys[s, j] = self.tap_sum(smem, taps, bias, s, part, base, first + j,
                                            row[j:j + 4], tid)
        if section == 0:
            silus = silus_bf16([ys[i // count, i % count] for i in range(2 * count)])
            for i in cutlass.range_constexpr(2 * count):
                x_in[first + i % count, i // count, channel] = BFloat16(silus[i])
        else:
            silus = silus_bf16([ys[0, j] for j in range(count)])
            for j in cutlass.range_constexpr(count):
                x_in[first + j, 2, channel] = BFloat16(silus[j])

    @cute.jit
    def tap_sum(self, smem, taps, bias, s, part, base, t, inputs, tid):
        """Token t's y = bias + sum_i tap_i x_i (rounded products, as the stock loop) of
        part `part` (this thread's part s), inputs its three predecessors' and its own
        raw inputs, oldest first; a tree node's predecessors are its three nearest
        ancestors (then the window's history), read from the window row."""
        window, parents, channel = smem.window, smem.parents, tid % K
        if cutlass.const_expr(self.trees):  # t's three nearest ancestors, then t
            path = [parents[t]]
            for _ in cutlass.range_constexpr(2):
                up = path[-1]
                above = parents[cutlass.max(up, Int32(0))]
                path.append(cutlass.select_(up >= 0, above, up - 1))
            # node u's raw input at window position base + 3 + u, just written, the
            # history's too (u = -3 .. -1)
            inputs = [Float32(window[part, channel, base + 3 + path[2 - i]])
                      for i in range(3)] + [inputs[3]]
        y = bias[s]
        for i in cutlass.range_constexpr(4):
            y = cute.math.add(y, cute.math.mul(taps[s, i], inputs[i], rounding=RN),
                              rounding=RN)
        return y

    @cute.jit
    def load_records(self, smem, a_exp, dt_channel, n, tid):
        """Section 1: the staged recorded keys of the kept tokens in replay order (into
        kp, normalized later), their decays (into old_decays) and the keys' sums of
        squares per warp (old_sums); t >= n (and every t when the request has no record
        row: n = 0) masked. Kept token t's record is at position t, or with trees at
        order[t]."""
        RQ: cutlass.Constexpr = self.record_tokens
        records_in, kp, old_decays = smem.records_in, smem.kp, smem.old_decays
        channel, section = tid % K, tid // K
        lane, warp = tid % 32, tid // 32
        # a tree's decays overwrite records its later tokens may read: one batch of all
        batch: cutlass.Constexpr = RQ if self.trees else 8
        if section == 1:
            at = [smem.order[t] for t in range(RQ)] if self.trees else list(range(RQ))
            # t >= n are masked: their staged bytes may be stale or never staged
            keys = [cutlass.select_(t < n, Float32(records_in[at[t], 0, channel]),
                                    Float32(0.0)) for t in range(RQ)]
            for first in cutlass.range_constexpr(0, RQ, batch):  # decays in batches
                tokens = range(first, min(first + batch, RQ))
                gates = [Float32(cutlass.select_(t < n, Float32(records_in[at[t], 1, channel]),
                                                 Float32(0.0))) for t in tokens]
                # the batch's records read by every thread before its decays overwrite them
                cute.arch.barrier(barrier_id=RECORDS_READ, number_of_threads=K)
                recorded = decays(gates, a_exp, [dt_channel] * len(gates), self.lower_bound)
                for t, d in zip(tokens, recorded):
                    if t < n:
                        kp[t, channel] = keys[t]
                        old_decays[t, channel] = d
            squares, index, holds = warp_totals([key * key for key in keys], lane)
            if holds:
                smem.old_sums[index, warp - 4] = squares

    @cute.jit
    def write_records(self, ptr, activations, smem, item, base, head, rank, tid):
        """Once every CTA of the item has read the old ones, each CTA writes its channel
        share of the new records' keys (section 0) and raw gates (section 1), at
        positions base + t, and of the new window (in shared memory: `convolve`), 16
        bytes a thread, coalesced (a channel's row is W positions: per-channel stores
        would split sectors); then rank 0 leaves the record row awaiting its accept with
        base records kept, and in a tree build each node's parent in `nodes` at its
        record position (every CTA of the item has read the pending count and the kept
        tokens' positions by then)."""
        T: cutlass.Constexpr = self.tokens
        W: cutlass.Constexpr = self.config.window
        share: cutlass.Constexpr = K // self.split
        per_part: cutlass.Constexpr = share * W // 8  # 16-byte vectors of a part's share
        channel, section = tid % K, tid // K
        if item.has_records & (channel // share == rank):
            for t in cutlass.range_constexpr(T):
                at = self.offset("key_gates", item.rec, head, base + t, 0, channel)
                if section == 0:
                    ptr.key_gates[at] = BFloat16(activations[1, t])
                else:
                    ptr.key_gates[at + K] = smem.raw_gates[t, channel]
        for r in cutlass.range_constexpr(-(-3 * per_part // THREADS)):
            i = tid + r * THREADS
            if i < 3 * per_part:
                part, within = i // per_part, (i % per_part) * 8 + rank * share * W
                store_vec(ptr.conv, self.offset("conv", item.slot, part, head) + within,
                          load_vec(smem.window.iterator, part * K * W + within, 8))
        if (tid == 0) & (rank == 0) & item.has_records:
            ptr.pending[self.offset("pending", item.rec, head)] = Int32(AWAITING) - base
        if cutlass.const_expr(self.trees):
            if (tid < T) & (rank == 0) & item.has_records:
                ptr.nodes[self.offset("nodes", item.rec, head, base + tid)] = \
                    smem.parents[tid]

    # === Phase 8 (VECTORS_READY): the token and replay vectors

    @cute.jit
    def vectors(self, smem, activations, n, rank, tid):
        """Section 0: the token vectors and pair products, once the peers' decays are in;
        section 1: the replay vectors and the output gates (`replay_and_output_gates`);
        where `looped_tokens` both sections take nodes of the pair products
        (`looped_vectors`). Then the pair sums, once every CTA's pairs are in
        (`shared_pairs`)."""
        T: cutlass.Constexpr = self.tokens
        if cutlass.const_expr(self.looped_tokens()):
            self.looped_vectors(smem, activations, n, rank, tid)
        elif tid // K == 0:
            if cutlass.const_expr(self.split > 1):
                cute.arch.mbarrier_wait(smem.gates_arrived, 0)
            qs = cute.make_rmem_tensor(T, Float32)
            ks = cute.make_rmem_tensor(T, Float32)
            self.normalized_tokens(activations, smem, ks, qs)
            self.gamma_vectors(ks, qs, smem, tid)
            self.unrolled_pairs(ks, qs, smem.decays, tid % K, self.ancestor_bits(smem), smem,
                                rank, tid)
        else:
            self.replay_and_output_gates(smem, n, tid)
        cute.arch.barrier()
        if tid < T * T:
            if cutlass.const_expr(self.shared_pairs()):
                cute.arch.mbarrier_wait(smem.pairs_arrived, 0)
            smem.pair_sums[tid] = tree_sum([smem.pairs[tid, w] for w in range(4)])

    @cute.jit
    def looped_vectors(self, smem, activations, n, rank, tid):
        """`vectors` where `looped_tokens`: node t of the pair products' loop is CTA t %
        split's and there section (t // split) % 2's. Section 0 normalizes q and k and
        lends them to section 1 in xvec's rows (free until the Gamma vectors), which
        takes them after its replay vectors and output gates; section 0 writes the Gamma
        vectors over them once they are taken."""
        T: cutlass.Constexpr = self.tokens
        xvec, channel, section = smem.xvec, tid % K, tid // K
        qs = cute.make_rmem_tensor(T, Float32)
        ks = cute.make_rmem_tensor(T, Float32)
        if section == 0:
            cute.arch.mbarrier_wait(smem.gates_arrived, 0)
            self.normalized_tokens(activations, smem, ks, qs)
            for t in cutlass.range_constexpr(T):
                xvec[t, channel] = ks[t]
                xvec[T + t, channel] = qs[t]
            cute.arch.barrier_arrive(barrier_id=TOKENS_LENT, number_of_threads=THREADS)
        else:
            self.replay_and_output_gates(smem, n, tid)
            cute.arch.barrier(barrier_id=TOKENS_LENT, number_of_threads=THREADS)
            for t in cutlass.range_constexpr(T):
                ks[t] = xvec[t, channel]
                qs[t] = xvec[T + t, channel]
            cute.arch.barrier_arrive(barrier_id=TOKENS_TAKEN, number_of_threads=THREADS)
            cute.arch.mbarrier_wait(smem.gates_arrived, 0)  # section 1 reads the decays too
        ancestors = self.ancestor_bits(smem)
        for t in cutlass.range(rank + section * self.split, T, 2 * self.split, unroll=1):
            self.looped_node_pairs(t, ks, qs, smem.decays, channel, ancestors, smem, tid)
        if section == 0:
            cute.arch.barrier(barrier_id=TOKENS_TAKEN, number_of_threads=THREADS)
            self.gamma_vectors(ks, qs, smem, tid)

    @cute.jit
    def normalized_tokens(self, activations, smem, ks, qs):
        """Section 0: this channel's normalized k and q (scaled) of every token into the
        registers ks and qs."""
        T: cutlass.Constexpr = self.tokens
        norm_sums = smem.norm_sums
        normalized = divided_by_roots(
            [activations[s, t] for s in range(2) for t in range(T)],
            [tree_sum([norm_sums[t, s, w] for w in range(4)]) + NORM_EPS
             for s in range(2) for t in range(T)], NORM_EPS)
        for t in cutlass.range_constexpr(T):
            qs[t] = normalized[t] * self.scale
            ks[t] = normalized[T + t]

    @cute.jit
    def gamma_vectors(self, ks, qs, smem, tid):
        """Section 0: Gamma_t k_t and Gamma_t q_t of this channel into xvec; a tree
        build's Gamma_t the product of the decays on t's path, root first (a decay off
        it selected away)."""
        T: cutlass.Constexpr = self.tokens
        decays, xvec, channel = smem.decays, smem.xvec, tid % K
        ancestors = self.ancestor_bits(smem)
        gamma = Float32(1.0)
        for t in cutlass.range_constexpr(T):
            if cutlass.const_expr(self.trees):
                gamma = decays[0, channel]
                for r in cutlass.range_constexpr(1, t + 1):
                    gamma = gamma * self.path_factor(ancestors, t, r, decays[r, channel])
            else:
                d = decays[t, channel]
                gamma = d if t == 0 else gamma * d
            xvec[t, channel] = gamma * ks[t]
            xvec[T + t, channel] = gamma * qs[t]

    @cute.jit
    def unrolled_pairs(self, ks, qs, decays, channel, ancestors, smem, rank, tid):
        """Section 0: this channel's terms of the T^2 pair products, summed per warp into
        pairs, unit by unit (`pair_units`), each unit's code its own (T <= UNROLLED_TOKENS
        or split 1), this CTA's own where the cluster shares them (`pair_owner`). A tree
        build takes each product over node t's path: a decay off it is selected away (a
        factor 1), a pair off it is 0."""
        T: cutlass.Constexpr = self.tokens
        by_node = self.pair_units()[0]
        # batches take the decays from registers; nodes read them where used (held, a
        # tree of 16's spill)
        d = None if by_node else [decays[t, channel] for t in range(T)]
        for unit in cutlass.range_constexpr(self.pair_units()[1]):
            if cutlass.const_expr(self.pair_owner(unit) is None):
                self.unit_pairs(unit, ks, qs, d, decays, channel, ancestors, smem, tid)
            else:
                if rank == self.pair_owner(unit):
                    self.unit_pairs(unit, ks, qs, d, decays, channel, ancestors, smem, tid)

    @cute.jit
    def unit_pairs(self, unit: cutlass.Constexpr, ks, qs, d, decays, channel, ancestors,
                   smem, tid):
        """One unit of the pair products: a node's (`node_pairs`, the decays from shared
        memory), or pairs 32 unit + [0, 32) in the order of `pair_index`, each
        `pair_term` (the decays d in registers)."""
        if cutlass.const_expr(self.pair_units()[0]):
            self.node_pairs(unit, ks, qs, decays, channel, ancestors, smem, tid)
        else:
            T: cutlass.Constexpr = self.tokens
            pairs_in_order = [("A", t, s) for t in range(T) for s in range(t)] + [
                ("B", t, s) for t in range(T) for s in range(t + 1)]
            terms = [self.pair_term(ks, qs, d, ancestors, kind, t, s)
                     for kind, t, s in pairs_in_order[32 * unit:32 * unit + 32]]
            total, index, holds = warp_totals(terms, tid % 32)
            self.store_pair(smem, 32 * unit + index, total, holds, tid)

    def pair_term(self, ks, qs, d, ancestors, kind, t: int, s: int):
        """This channel's term of A_ts (kind "A") or B_ts: k_s P(s, t) times k_t or q_t,
        the products in token order; a tree build's over t's path (a decay off it a
        selected 1, a pair off it a selected 0)."""
        weighted = ks[s]
        for r in range(s + 1, t + 1):
            weighted = weighted * self.path_factor(ancestors, t, r, d[r])
        term = weighted * (ks[t] if kind == "A" else qs[t])
        if ancestors is not None and s < t:
            term = cutlass.select_(self.on_path(ancestors, t, s), term, Float32(0.0))
        return term

    @cute.jit
    def node_pairs(self, t: cutlass.Constexpr, ks, qs, decays, channel, ancestors, smem,
                   tid):
        """A large tree's pair products of node t: its 2t + 1 terms (A_ts, s < t, then
        B_ts, s <= t) in one warp reduction, so that t's path's factors die with them
        (batches across nodes spill there). P(s, t) is the suffix product of t's path
        factors down from t, f_{s+1} (f_{s+2} (... f_t)), one product more than P(s + 1,
        t): T^2 / 2 products over the nodes, where `pair_term`'s, in token order from
        k_s, take T^3 / 6. k_s P(s, t) is 0 off t's path (a select: a bad branch's NaN
        stays in it)."""
        T: cutlass.Constexpr = self.tokens
        weighted = [ks[t]] * (t + 1)  # k_s P(s, t)
        suffix = decays[t, channel]  # P(t - 1, t)
        for s in cutlass.range_constexpr(t - 1, -1, -1):
            weighted[s] = cutlass.select_(self.on_path(ancestors, t, s), ks[s] * suffix,
                                          Float32(0.0))
            if cutlass.const_expr(s > 0):
                suffix = suffix * self.path_factor(ancestors, t, s, decays[s, channel])
        terms = [weighted[s] * ks[t] for s in range(t)] + [
            weighted[s] * qs[t] for s in range(t + 1)]
        total, index, holds = warp_totals(terms, tid % 32)
        slot = cutlass.select_(index < t, pair_index(T, t, 0, "A") + index,
                               pair_index(T, t, 0, "B") + index - t)
        self.store_pair(smem, slot, total, holds, tid)

    @cute.jit
    def looped_node_pairs(self, t, ks, qs, decays, channel, ancestors, smem, tid):
        """`looped_vectors`' loop body: node t's pairs (a runtime t) as 2T terms, A_ts
        then B_ts for s = 0 .. T - 1, those past t or off t's path 0 and not stored, in
        one warp reduction; P(s, t) the suffix product of t's path factors, as
        `node_pairs` takes it. The warps run one node's code, where the copies for every
        node waited on instruction fetch."""
        T: cutlass.Constexpr = self.tokens
        k_t, q_t = ks[0], qs[0]
        for s in cutlass.range_constexpr(1, T):
            k_t = cutlass.select_(t == s, ks[s], k_t)
            q_t = cutlass.select_(t == s, qs[s], q_t)
        path = Int32(0)
        if cutlass.const_expr(self.trees):
            path = ancestors[t] | (Int32(1) << t)
        weighted = [Float32(0.0)] * T  # k_s P(s, t)
        suffix = Float32(1.0)
        for s in cutlass.range_constexpr(T - 1, -1, -1):
            on = Int32(s) <= t
            if cutlass.const_expr(self.trees):
                on = on & ((path & Int32(1 << s)) != Int32(0))
            weighted[s] = cutlass.select_(on, ks[s] * suffix, Float32(0.0))
            if cutlass.const_expr(s > 0):
                suffix = suffix * cutlass.select_(on, decays[s, channel], Float32(1.0))
        total, index, holds = warp_totals(
            [weighted[s] * k_t for s in range(T)] + [weighted[s] * q_t for s in range(T)],
            tid % 32)
        a_pair = index < T
        source = cutlass.select_(a_pair, index, index - T)
        slot = cutlass.select_(a_pair, ((t * (t - 1)) >> 1) + source,
                               T * (T - 1) // 2 + ((t * (t + 1)) >> 1) + source)
        stored = cutlass.select_(a_pair, source < t, source <= t)
        self.store_pair(smem, slot, total, holds & stored, tid)

    @cute.jit
    def store_pair(self, smem, slot, total, holds, tid):
        """A warp's total of pair `slot` into pairs [slot, warp % 4]: this CTA's, or with
        `shared_pairs` every CTA's of the cluster (a DSMEM push each, on pairs_arrived).
        Where both sections take nodes (`looped_tokens`) a node is one section's."""
        warp = tid // 32 % 4 if self.looped_tokens() else tid // 32
        if holds:
            if cutlass.const_expr(self.shared_pairs()):
                for peer in cutlass.range_constexpr(self.split):
                    push_f32(smem.pairs.iterator + slot * 4 + warp, total,
                             smem.pairs_arrived, peer)
            else:
                smem.pairs[slot, warp] = total

    @cute.jit
    def replay_and_output_gates(self, smem, n, tid):
        """Section 1: the replay vectors, and here where it waits for section 0 anyway,
        the solve's output gates into old_decays (its column `channel` = row only this
        thread read, and for the last time)."""
        T: cutlass.Constexpr = self.tokens
        self.replay_vectors(smem.kp, smem.old_decays, smem.old_sums, smem.decay_n, n, tid)
        row = tid - K
        if row < self.rows:
            gates = sigmoids([Float32(smem.gate_in[t, row]) for t in range(T)])
            for t in cutlass.range_constexpr(T):
                smem.old_decays[t, row] = gates[t]

    @cute.jit
    def replay_vectors(self, kp, old_decays, old_sums, decay_n, n, tid):
        """Section 1: kp[t] = kn_t * P_t (suffix products of the recorded decays, taken
        from the last token back) and D_n, for t < n; the norms as one batch."""
        RQ: cutlass.Constexpr = self.record_tokens
        channel = tid % K
        # t >= n: a stand-in key of 1 (its bytes may be stale), never stored
        keys = divided_by_roots(
            [cutlass.select_(t < n, kp[t, channel], Float32(1.0)) for t in range(RQ)],
            [tree_sum([old_sums[t, w] for w in range(4)]) + NORM_EPS for t in range(RQ)],
            NORM_EPS)
        suffix = Float32(1.0)
        for r in cutlass.range_constexpr(RQ):
            t: cutlass.Constexpr = RQ - 1 - r
            if t < n:
                kp[t, channel] = keys[t] * suffix
                suffix = suffix * old_decays[t, channel]
        decay_n[channel] = suffix

    @cute.jit
    def low_rank(self, smem, n, write, tid):
        """Whether the state pass takes the keep step's low-rank form (lazy builds: the
        state not written and records kept), S_n x = S_0 (D_n x) + U_n (Kp_n^T x); if so
        kx [t, j] := kp_t . x_j for t < RQ (rows t >= n unused), a warp per share of the
        RQ 2T pairs, a lane per 4 keys."""
        if cutlass.const_expr(not self.lazy):
            return False
        low_rank = (write == False) & (n > 0)  # noqa: E712 - a device Boolean
        if low_rank:
            RQ: cutlass.Constexpr = self.record_tokens
            J: cutlass.Constexpr = 2 * self.tokens
            per_warp: cutlass.Constexpr = -(-RQ * J // (THREADS // 32))
            lane, warp = tid % 32, tid // 32
            for first in cutlass.range_constexpr(0, per_warp, 32):
                count: cutlass.Constexpr = min(32, per_warp - first)
                partial = []
                for i in cutlass.range_constexpr(count):
                    pair = cutlass.min(warp * per_warp + first + i, Int32(RQ * J - 1))
                    k4 = load_vec(smem.kp.iterator, (pair // J) * K + 4 * lane, 4)
                    x4 = load_vec(smem.xvec.iterator, (pair % J) * K + 4 * lane, 4)
                    partial.append(tree_sum([k4[e] * x4[e] for e in range(4)]))
                total, index, holds = warp_totals(partial, lane)
                pair = warp * per_warp + first + index
                if holds & (pair < RQ * J):
                    smem.kx[pair // J, pair % J] = total
        return low_rank

    # === Phase 9 (STATE_ARRIVED .. STATE_PASSED): the state pass

    @cute.jit
    def state_pass(self, state, smem, slot, n, write, low_rank, head, row0, timeline, tid):
        """Per 4-key chunk of this thread's rows: S_n = S_0 D_n + sum_t u_t (kn_t P_t),
        written back if `write`, and the 2T dot products with Gamma k and Gamma q (where
        `low_rank`, S_0 against D_n Gamma k and D_n Gamma q instead: `low_rank`); the
        LANES partial dots of a row are then summed into dots[row]."""
        T: cutlass.Constexpr = self.tokens
        RPT: cutlass.Constexpr = self.rows_per_thread
        LANES: cutlass.Constexpr = self.lanes
        base = self.offset("state", slot, head, row0)
        # where 2T x RPT accumulators fill the registers (T = 5), the rows are loaded
        # after the replay's sums, not before: fewer values live across that loop
        late_rows: cutlass.Constexpr = RPT * 2 * T > 32
        lane_in, row_in = tid % LANES, tid // LANES
        first_row = row_in * RPT  # of this CTA's rows: one vector load of old_u each t
        acc = cute.make_rmem_tensor((RPT, 2 * T), Float32)
        acc.fill(0.0)
        cute.arch.mbarrier_wait(smem.state_arrived, 0)
        self.stamp(timeline, Phase.STATE_ARRIVED, tid)
        for c in cutlass.range_constexpr(self.chunks):
            order = c
            if cutlass.const_expr(LANES < 8):
                # A quarter warp's 16-byte loads cover 128 bytes: with 4 lanes per row that
                # is two rows 512 bytes apart (the same banks) unless they take the
                # chunks in different orders.
                order = c ^ (row_in % 2)
            key = 4 * (lane_in + LANES * order)
            rows = cute.make_rmem_tensor((RPT, 4), Float32)
            if cutlass.const_expr(not late_rows):
                self.load_rows(rows, smem.staged, first_row, key)
            if cutlass.const_expr(self.lazy):
                if low_rank:
                    if cutlass.const_expr(late_rows):
                        self.load_rows(rows, smem.staged, first_row, key)
                    self.add_dots(acc, rows, smem.xvec, key,
                                  load_vec(smem.decay_n.iterator, key, 4))
                else:
                    self.fold(rows, state, smem, n, write, late_rows, base, first_row, key)
                    self.add_dots(acc, rows, smem.xvec, key)
            else:
                self.fold(rows, state, smem, n, write, late_rows, base, first_row, key)
                self.add_dots(acc, rows, smem.xvec, key)
        self.row_dots(smem.dots, acc, first_row, lane_in, tid)

    @cute.jit
    def load_rows(self, rows, staged, first_row, key):
        """rows [RPT, 4] := the staged state rows first_row + r at keys key .. key + 3
        (a bf16 checkpoint's widened exactly)."""
        for r in cutlass.range_constexpr(self.rows_per_thread):
            v = load_vec(staged.iterator, (first_row + r) * K + key, 4)
            for e in cutlass.range_constexpr(4):
                rows[r, e] = Float32(v[e])

    @cute.jit
    def fold(self, rows, state, smem, n, write, late_rows: cutlass.Constexpr, base,
             first_row, key):
        """rows [RPT, 4] := S_n at keys key .. key + 3 (the staged S_0 times D_n plus the
        replayed records), stored to the checkpoint if `write` (a bf16 checkpoint's
        rounded to nearest even there, its one rounding)."""
        RPT: cutlass.Constexpr = self.rows_per_thread
        replayed = self.replayed(smem.kp, smem.old_u, smem.order, n, first_row, key)
        if cutlass.const_expr(late_rows):
            self.load_rows(rows, smem.staged, first_row, key)
        d4 = load_vec(smem.decay_n.iterator, key, 4)
        for r in cutlass.range_constexpr(RPT):
            for e in cutlass.range_constexpr(4):
                rows[r, e] = cute.math.fma(rows[r, e], d4[e], replayed[r, e])
            target = aligned(state, base + (first_row + r) * K + key, 4 * self.state_bytes)
            store = store_bf16x4_if if self.state_bytes == 2 else store_f32x4_if
            store(target, [rows[r, e] for e in range(4)], write)

    @cute.jit
    def replayed(self, kp, old_u, order, n, first_row, key):
        """sum_{t < n} u_t[r] (kn_t P_t)[key .. key + 3] for this thread's rows
        first_row + r: [RPT, 4]; u_t is old_u's row t (a tree build's: order[t])."""
        RPT: cutlass.Constexpr = self.rows_per_thread
        RC: cutlass.Constexpr = self.rows
        replayed = cute.make_rmem_tensor((RPT, 4), Float32)
        if n > 0:  # token 0's products start the sums: no zeroed accumulators
            k4 = load_vec(kp.iterator, key, 4)
            u = load_vec(old_u.iterator, self.record_at(order, 0) * RC + first_row, RPT)
            for r in cutlass.range_constexpr(RPT):
                for e in cutlass.range_constexpr(4):
                    replayed[r, e] = cute.math.fma(u[r], k4[e], Float32(0.0))
        else:
            replayed.fill(0.0)
        for t in range(1, n):
            k4 = load_vec(kp.iterator, t * K + key, 4)
            u = load_vec(old_u.iterator, self.record_at(order, t) * RC + first_row, RPT)
            for r in cutlass.range_constexpr(RPT):
                for e in cutlass.range_constexpr(4):
                    replayed[r, e] = cute.math.fma(u[r], k4[e], replayed[r, e])
        return replayed

    def record_at(self, order, t):
        """The record position of kept token t: t, or a tree build's order[t]."""
        return order[t] if self.trees else t

    @cute.jit
    def add_dots(self, acc, rows, xvec, key, scale=None):
        """acc [RPT, 2T] += rows [RPT, 4] . x_j at keys key .. key + 3 for the 2T vectors
        of xvec, each element times scale [4] where given."""
        for j in cutlass.range_constexpr(2 * self.tokens):
            x4 = load_vec(xvec.iterator, j * K + key, 4)
            xs = [x4[e] for e in range(4)] if scale is None else [
                x4[e] * scale[e] for e in range(4)]
            for r in cutlass.range_constexpr(self.rows_per_thread):
                for e in cutlass.range_constexpr(4):
                    acc[r, j] = cute.math.fma(rows[r, e], xs[e], acc[r, j])

    @cute.jit
    def row_dots(self, dots, acc, first_row, lane_in, tid):
        """The LANES partial sums acc [RPT, 2T] of each (row, dot) meet in one lane of the
        row's group, into dots [first_row + r, j]."""
        T: cutlass.Constexpr = self.tokens
        RPT: cutlass.Constexpr = self.rows_per_thread
        LANES: cutlass.Constexpr = self.lanes
        count: cutlass.Constexpr = RPT * 2 * T
        per_lane: cutlass.Constexpr = -(-count // LANES)
        totals = transpose_sum([acc[r, j] for r in range(RPT) for j in range(2 * T)]
                               + [Float32(0.0)] * (per_lane * LANES - count), tid % 32,
                               LANES)
        for i in cutlass.range_constexpr(per_lane):
            index = lane_in * per_lane + i
            if index < count:
                dots[first_row + index // (2 * T), index % (2 * T)] = totals[i]

    # === Phases 10-11 (SOLVED, NORMED): the T x T solve and the gated RMSNorm

    @cute.jit
    def solve_rows(self, corrections, smem, item, n, low_rank, base, head, row0, tid):
        """Per state row (thread < RC): the T x T forward substitution for u_t, u_t into
        the records at positions base + t; returns the outputs o_t (bf16) and the output
        gates sigmoid(gate_t) of the row, which `vectors` left in old_decays [T, RC]
        (zeros in the other threads). Where `low_rank`, the dots gain the row's rank-n
        term sum_{t < n} u_t[row] kx [t, j]."""
        T: cutlass.Constexpr = self.tokens
        dots, pair_sums, values_v = smem.dots, smem.pair_sums, smem.values_v
        betas, output_gates = smem.betas, smem.old_decays
        outs = cute.make_rmem_tensor(T, Float32)
        outs.fill(0.0)
        gated = cute.make_rmem_tensor(T, Float32)
        gated.fill(0.0)
        if tid < self.rows:
            for t in cutlass.range_constexpr(T):
                gated[t] = output_gates[t, tid]
            row = row0 + tid
            sums = [dots[tid, j] for j in range(2 * T)]  # plus the rank term where low_rank
            if cutlass.const_expr(self.lazy):
                sums = self.with_rank_term(sums, smem, n, low_rank, tid)
            ancestors = self.ancestor_bits(smem)
            us = cute.make_rmem_tensor(T, Float32)
            for t in cutlass.range_constexpr(T):
                total = sums[t]
                for s in cutlass.range_constexpr(t):
                    total = self.on_path_step(ancestors, t, s, total, cute.math.fma(
                        pair_sums[pair_index(T, t, s, "A")], us[s], total))
                us[t] = (values_v[t, row] - total) * betas[t]
                if item.has_records:
                    corrections[self.offset("corrections", item.rec, head, base + t,
                                            row)] = us[t]
            for t in cutlass.range_constexpr(T):
                o = sums[T + t]
                for s in cutlass.range_constexpr(t + 1):
                    o = self.on_path_step(ancestors, t, s, o, cute.math.fma(
                        pair_sums[pair_index(T, t, s, "B")], us[s], o))
                outs[t] = round_bf16(o)
        return outs, gated

    def on_path_step(self, ancestors, t: int, s: int, before, after):
        """`after` (a sum with node s's term added) where node s lies on node t's path or
        the build verifies a chain, else `before`: an off-path u_s (a bad branch's
        NaN) never meets node t's sum, not even times 0."""
        if ancestors is None or s == t:
            return after
        return cutlass.select_(self.on_path(ancestors, t, s), after, before)

    @cute.jit
    def with_rank_term(self, sums, smem, n, low_rank, tid):
        """sums [2T] plus, where `low_rank`, sum_{t < n} u_t[tid] kx [t, j]: the kept
        records' rank-n part of S_n x."""
        rank = cute.make_rmem_tensor(2 * self.tokens, Float32)
        rank.fill(0.0)
        if low_rank:
            for t in range(n):
                u = smem.old_u[t, tid]
                for j in cutlass.range_constexpr(2 * self.tokens):
                    rank[j] = cute.math.fma(u, smem.kx[t, j], rank[j])
        return [sums[j] + rank[j] for j in range(2 * self.tokens)]

    @cute.jit
    def gated_norm(self, out, outs, gated, smem, nw, request, head, rank, tid):
        """out = bf16(o rsqrt(mean(o^2) + eps) norm_weight sigmoid(gate)) over the K value
        rows, from this thread's row's outs and gated (solve_rows); the sums of squares of
        the cluster's CTAs meet in every CTA over DSMEM."""
        T: cutlass.Constexpr = self.tokens
        SPLIT: cutlass.Constexpr = self.split
        RC: cutlass.Constexpr = self.rows
        NW: cutlass.Constexpr = (RC + 31) // 32  # warps holding this CTA's rows
        lane, warp = tid % 32, tid // 32
        out_sums, received, exchange = smem.out_sums, smem.received, smem.exchange
        if tid < NW * 32:
            total, index, holds = warp_totals([outs[t] * outs[t] for t in range(T)], lane)
            if holds:
                out_sums[index, warp] = total
        cute.arch.barrier()
        if cutlass.const_expr(SPLIT > 1):
            if tid < T:
                local = tree_sum([out_sums[tid, w] for w in range(NW)])
                for peer in cutlass.range_constexpr(SPLIT):
                    push_f32(received.iterator + rank * T + tid, local, exchange, peer)
            cute.arch.mbarrier_wait(exchange, 0)
        if tid < RC:
            row = rank * RC + tid
            means = []
            for t in cutlass.range_constexpr(T):
                if cutlass.const_expr(SPLIT > 1):
                    sumsq = tree_sum([received[p, t] for p in range(SPLIT)])
                else:
                    sumsq = tree_sum([out_sums[t, w] for w in range(NW)])
                means.append(sumsq / K + self.eps)
            rstd = divided_by_roots([Float32(1.0)] * T, means, self.eps)
            for t in cutlass.range_constexpr(T):
                where = self.offset("out", request, t, head, row)
                out[where] = BFloat16(outs[t] * rstd[t] * nw * gated[t])
