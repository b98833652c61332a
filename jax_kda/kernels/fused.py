"""The fused verify kernel (SPEC.md sections 3 and 4): one pass over each request's FP32
state replays the accepted tokens of the last verify into the checkpoint (closed form),
verifies this step's T tokens from it in chunked (WY) form and records them.

Layout: a cluster of `split` CTAs of 256 threads per (request, head); CTA `rank` owns
the state rows [rank RC, (rank + 1) RC), RC = 128 / split, and every CTA of the item
recomputes the shared per-token operands (convolution, norms, pair products); the gate
projection is shared instead: each CTA projects the features of its channel share,
reading 1 / split of f_b[h], and pushes their decays to every CTA of the item over
distributed shared memory. Thread (g, l) of the state pass holds rows RPT g + r
(r < RPT) and the 4-key chunks l + LANES c (c < KCH) of them, LANES threads per row
(RPT = 4 where the accumulators fit: each Gamma k / Gamma q vector read from shared
memory then feeds 4 rows). The small operands of an item are all requested before any
is waited on (latency, not bandwidth, bounds a CTA's life), by cp.async into shared
memory, while the gate projection runs; the CTA's state rows (contiguous) by one bulk
copy on an mbarrier, with them in a crowded grid, else once they have landed
(`CROWDED_CTAS_PER_SM`). The IEEE divisions and roots of a thread go in branch-free
batches (primitives.quotients, divided_by_roots) so that ptxas can overlap them, each
batch's range test on the fewest values that bound it. The gated RMSNorm's sums
of squares cross the cluster through distributed shared memory. CTA `rank` writes the
per-item records (keys, raw gates) and the convolution window of channels
[rank K / split, (rank + 1) K / split), right after the prologue, once a cluster barrier
shows that every CTA of the item has read the old ones.

Before `griddepcontrol.wait` the kernel reads only the weights: under XLA the kernel
that runs just before it may write any other operand (an `accept` scatter, a copy). A
grid small enough to wait there as a whole also reads the slot and record row, only to
aim L2 prefetches of the item's rows (`prefetch`: hints, whatever the values).

Operand order (cutlass_call's (stream, *inputs, *outputs)): x [B, T, 3, H, K] bf16,
f_a [B, T, K] bf16, beta [B, T, H] bf16, gate [B, T, H, K] bf16, slots [B] i32,
record_rows [B] i32, conv_weight [3, 4, H, K], conv_bias [3, H, K] or None, a_log [H],
dt_bias [H, K], f_b [H, K, K] bf16, norm_weight [K], state [S, H, K, K] f32,
conv [S, 3, H, K, RQ + 2] bf16, corrections [R, H, RQ, K] f32,
key_gates [R, H, RQ, 2, K] bf16, pending [R] i32 (the cache, updated in place), then
out [B, T, H, K] bf16. All row-major; every array is addressed from its base pointer.
"""
from __future__ import annotations

import math

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64

from jax_kda.config import K
from jax_kda.layer import NORM_EPS
from jax_kda.kernels.primitives import (RN, aligned, bulk_copy, cp_async_16, decays,
                                        divided_by_roots, exp, load_i32_pair, load_if,
                                        load_vec, load_words, mma_bf16, prefetch_line_l2,
                                        push_f32, round_bf16, sigmoids, silus_bf16,
                                        store_f32x4_if, transpose_sum, tree_sum,
                                        warp_totals, wide)

THREADS = 256
SOLO_SHARED = 120 * 1024  # over half an SM's 228 KB: a solo CTA shares its SM with none
CROWDED_CTAS_PER_SM = 8  # above it (at T <= 4) the state is requested with the operands
PHASES = 13  # timeline stamps per CTA (see `stamp`)
STAMPS = 16


def pair_index(T, t, s, kind):
    """Position of A_ts (kind "A", s < t) or B_ts (kind "B", s <= t) in the T^2 pairs."""
    if kind == "A":
        return t * (t - 1) // 2 + s
    return T * (T - 1) // 2 + t * (t + 1) // 2 + s


def row_major(*shape):
    return cute.make_ordered_layout(shape, order=tuple(reversed(range(len(shape)))))


def footprint(buffers):
    """Bytes of the (dtype, shape) buffers laid out one after another, 16-byte aligned."""
    return sum(-(-math.prod(shape) * dtype.width // 128) * 16 for dtype, shape in buffers)


def carve(base, buffers):
    """Row-major tensors for the (dtype, shape) buffers, one after another from the byte
    pointer `base` (16-byte aligned each)."""
    tensors, offset = [], 0
    for dtype, shape in buffers:
        tensors.append(cute.make_tensor(cute.recast_ptr(base + offset, dtype=dtype),
                                        row_major(*shape)))
        offset += footprint([(dtype, shape)])
    return tensors


class FusedVerify:
    """The kernel for one static configuration; `__call__` launches it on a stream.

    heads, tokens, record_tokens: H, T, RQ. gate_mode: the gate projection's FP32 chain
    order. has_bias: whether conv_bias is given. split: CTAs per (request, head).
    lower_bound, scale, eps: the layer's scalars, compiled in. timeline: the diagnostic
    build (`stamp`; tests/gpu_timeline.py), whose `__call__` takes one more operand, a
    [CTAs, STAMPS] int64 tensor. solo: each CTA asks for SOLO_SHARED bytes of shared
    memory, so that no other CTA shares its SM (jax_kda.ffi.solo_ctas says where).
    """

    def __init__(self, heads, tokens, record_tokens, gate_mode, has_bias, split,
                 lower_bound, scale, eps, timeline=False, solo=False):
        self.timeline, self.solo = timeline, solo
        self.heads, self.tokens, self.record_tokens = heads, tokens, record_tokens
        self.gate_mode, self.has_bias, self.split = gate_mode, has_bias, split
        self.lower_bound, self.scale, self.eps = lower_bound, scale, eps
        self.rows = K // split  # RC: state rows per CTA
        # RPT: 4 rows per thread where the 2T x 4 dot accumulators fit the registers
        # (T <= 5), else 2; at most 32 threads per row (splits >= 4)
        self.rows_per_thread = min(4 if 2 * tokens * 4 <= 40 else 2,
                                   self.rows * 32 // THREADS)
        self.lanes = THREADS * self.rows_per_thread // self.rows  # threads per row
        self.chunks = K // (4 * self.lanes)  # KCH: 4-key chunks per thread and row

    def staged_shape(self):
        """This CTA's state rows as they lie in global memory: [RC, K] f32."""
        return (self.rows, K)

    def early_buffers(self):
        """Staged operands read before the state pass: the window [3, K, RQ + 2], the
        inputs x [T, 3, K] and the records [RQ, 2, K]."""
        T, RQ = self.tokens, self.record_tokens
        return [(BFloat16, (3, K, RQ + 2)), (BFloat16, (T, 3, K)), (BFloat16, (RQ, 2, K))]

    def late_buffers(self):
        """Written from the state pass on: Gamma k and Gamma q [2T, K] and the rows' dots
        [RC, 2T + 1]."""
        T, RC = self.tokens, self.rows
        return [(Float32, (2 * T, K)), (Float32, (RC, 2 * T + 1))]

    def scratch_bytes(self):
        return max(footprint(self.early_buffers()), footprint(self.late_buffers()))

    def shared_buffers(self):
        """The other shared buffers, in allocation order: name -> (dtype, shape)."""
        T, RQ, RC, NP = self.tokens, self.record_tokens, self.rows, self.tokens ** 2
        return {"gate_in": (BFloat16, (T, RC)), "kp": (Float32, (RQ, K)),
                "old_decays": (Float32, (RQ, K)), "decay_n": (Float32, (K,)),
                "old_u": (Float32, (RQ, RC)), "decays": (Float32, (T, K)),
                "raw_gates": (BFloat16, (T, K)), "values_v": (Float32, (T, K)),
                "norm_sums": (Float32, (T, 2, 4)), "old_sums": (Float32, (RQ, 4)),
                "pairs": (Float32, (NP, 4)), "pair_sums": (Float32, (NP,)),
                "betas": (Float32, (T,)), "out_sums": (Float32, (T, 4)),
                "received": (Float32, (self.split, T))}

    def shared_bytes(self):
        """Dynamic shared memory per CTA (an upper bound: every alignment padded)."""
        staged = footprint([(Float32, self.staged_shape())])
        return (staged + 128 + self.scratch_bytes() + 128
                + footprint(self.shared_buffers().values()) + 16 + 3 * 8)

    @cute.jit
    def __call__(self, stream: cuda.CUstream, x: cute.Tensor, f_a: cute.Tensor,
                 beta: cute.Tensor, gate: cute.Tensor, slots: cute.Tensor,
                 record_rows: cute.Tensor, conv_weight: cute.Tensor, conv_bias,
                 a_log: cute.Tensor, dt_bias: cute.Tensor, f_b: cute.Tensor,
                 norm_weight: cute.Tensor, state: cute.Tensor, conv: cute.Tensor,
                 corrections: cute.Tensor, key_gates: cute.Tensor, pending: cute.Tensor,
                 out: cute.Tensor, timeline=None):
        if cutlass.const_expr(conv_bias is None):
            conv_bias = conv_weight  # never read: has_bias is False
        if cutlass.const_expr(timeline is None):
            timeline = out  # never written: self.timeline is False
        cluster = (self.split, 1, 1) if self.split > 1 else None
        self.kernel(x.iterator, f_a.iterator, beta.iterator, gate.iterator, slots.iterator,
                    record_rows.iterator, conv_weight.iterator, conv_bias.iterator,
                    a_log.iterator, dt_bias.iterator, f_b.iterator, norm_weight.iterator,
                    state.iterator, conv.iterator, corrections.iterator, key_gates.iterator,
                    pending.iterator, out.iterator, timeline.iterator, Int32(state.shape[0]),
                    Int32(pending.shape[0])).launch(
            grid=(self.split, self.heads, slots.shape[0]), block=(THREADS, 1, 1),
            cluster=cluster, stream=stream, use_pdl=True, min_blocks_per_mp=2,
            smem=max(self.shared_bytes(), SOLO_SHARED) if self.solo else None,
            preferred_smem_carveout=100)

    @cute.kernel
    def kernel(self, x, f_a, beta, gate, slots, record_rows, conv_weight, conv_bias,
               a_log, dt_bias, f_b, norm_weight, state, conv, corrections, key_gates,
               pending, out, timeline, num_slots: Int32, num_records: Int32):
        T: cutlass.Constexpr = self.tokens
        RQ: cutlass.Constexpr = self.record_tokens
        H: cutlass.Constexpr = self.heads
        SPLIT: cutlass.Constexpr = self.split
        RC: cutlass.Constexpr = self.rows
        NP: cutlass.Constexpr = T * T
        tid, _, _ = cute.arch.thread_idx()
        rank, head, request = cute.arch.block_idx()
        section = tid // K  # 0: the q and k channels, 1: v and the replay operands
        row0 = rank * RC

        smem = cutlass.memory.SmemAllocator()
        staged = smem.allocate_tensor(Float32, row_major(*self.staged_shape()),
                                      byte_alignment=128)
        # The item's small operands, staged by cp.async and read before the state pass,
        # share their bytes with the state pass's vectors and the rows' dots.
        scratch = smem.allocate(self.scratch_bytes(), byte_alignment=128)
        window_in, x_in, records_in = carve(scratch, self.early_buffers())
        xvec, dots = carve(scratch, self.late_buffers())
        (gate_in, kp, old_decays, decay_n, old_u, decays, raw_gates, values_v, norm_sums,
         old_sums, pairs, pair_sums, betas, out_sums, received) = [
            smem.allocate_tensor(dtype, row_major(*shape), byte_alignment=16)
            for dtype, shape in self.shared_buffers().values()]
        exchange = smem.allocate_array(Int64, 1, byte_alignment=8)
        state_arrived = smem.allocate_array(Int64, 1, byte_alignment=8)
        gates_arrived = smem.allocate_array(Int64, 1, byte_alignment=8)
        self.stamp(timeline, 0, tid)
        # f_b is read once per cluster: the last 8 / split warps of CTA `rank` project the
        # 16-feature blocks of its channel share (rank 8 / split + [0, 8 / split)) and
        # push the decays to every CTA of the item (gate_projection). The last warps:
        # section 1's convolution is the lighter one.
        PW: cutlass.Constexpr = 8 // SPLIT
        block = tid // 32 - (8 - PW) + rank * PW
        projecting = True if SPLIT == 1 else tid // 32 >= 8 - PW
        if cutlass.const_expr(SPLIT > 1):
            if tid == 0:
                cute.arch.mbarrier_init(gates_arrived, 1)
                cute.arch.mbarrier_init_fence()
                cute.arch.mbarrier_arrive_and_expect_tx(gates_arrived, T * K * 4)
            # waited on before the pushes: the peers' barriers are armed by then
            cute.arch.cluster_arrive_relaxed()

        # The weights: the only operands no earlier op of the program can be writing.
        taps, bias, dt_gate, fb_words, a_log_h, dt_channel, nw = self.load_weights(
            conv_weight, conv_bias, a_log, dt_bias, f_b, norm_weight, head, projecting,
            block, tid)
        ctas = cute.arch.grid_dim()[2] * (H * SPLIT)
        if 2 * ctas <= (1 if self.solo else 2) * cute.arch.nsmid():
            # The next launch's CTAs all fit beside this one's, so every CTA starts while
            # the previous launch runs and sits in griddepcontrol.wait: that time warms
            # L2 with the item's operands, which then take L2's latency, not HBM's.
            self.prefetch(x, f_a, beta, gate, slots, record_rows, conv, corrections,
                          key_gates, pending, num_slots, num_records, request, head, row0,
                          tid)
        self.stamp(timeline, 1, tid)
        cute.arch.griddepcontrol_wait()
        self.stamp(timeline, 2, tid)

        slot, rec = load_i32_pair(slots, request, record_rows, request)
        # While the slot is on its way: every read that does not depend on it (loaded
        # here, used only once every other read of the item is in flight).
        activation_words = self.load_activations(f_a, request, projecting, tid)
        beta_t = load_if(beta, wide(request * T + cutlass.min(tid, T - 1)) * H + head,
                         tid < T)
        self.stage(x_in, x, (wide(request) * 3 * T * H + head) * K, H * K, 3 * T, K, tid)
        self.stage(gate_in, gate, (wide(request) * T * H + head) * K + row0, H * K, T, RC,
                   tid)
        live = (slot > 0) & (slot < num_slots)
        has_records = (rec >= 0) & (rec < num_records)
        if live:
            pending_n = load_if(pending, rec, has_records)
            if cutlass.const_expr(SPLIT > 1):
                if tid == 0:
                    cute.arch.mbarrier_init(exchange, 1)
                    cute.arch.mbarrier_init_fence()
                    cute.arch.mbarrier_arrive_and_expect_tx(exchange, SPLIT * T * 4)

            # Every read of the item is issued here, before anything waits on one: the
            # small operands as one cp.async group, the state rows by one bulk copy.
            W: cutlass.Constexpr = RQ + 2
            self.stage(window_in, conv, self.window_base(slot, 0, head, 0), H * K * W, 3,
                       K * W, tid)
            if has_records:
                self.stage(old_u, corrections, (wide(rec) * H + head) * RQ * K + row0, K,
                           RQ, RC, tid)
                self.stage(records_in, key_gates, (wide(rec) * H + head) * RQ * 2 * K, 0, 1,
                           RQ * 2 * K, tid)
            cute.arch.cp_async_commit_group()
            # The state rows go out now where the grid keeps the memory busy (T <= 4 and
            # more than CROWDED_CTAS_PER_SM CTAs per SM: more bytes in flight), else once
            # the small operands have landed: a small grid's CTAs start together and each
            # one's operands would queue behind all their states, and at T > 4 the state
            # waits for the pass anyway (tests/GPU_RESULTS.md, 2026-11-30 16:38-16:54).
            crowded = (ctas > CROWDED_CTAS_PER_SM * cute.arch.nsmid()) & (T <= 4)
            if tid == 0:
                cute.arch.mbarrier_init(state_arrived, 1)
                cute.arch.mbarrier_init_fence()
                cute.arch.mbarrier_arrive_and_expect_tx(state_arrived, RC * K * 4)
            if crowded:
                # queued behind every thread's small copies rather than among them
                cute.arch.barrier()
                if tid == 0:
                    self.request_state(staged, state, state_arrived, slot, head, row0)
            self.stamp(timeline, 3, tid)
            a_exp = exp(a_log_h)
            if cutlass.const_expr(SPLIT > 1):
                cute.arch.cluster_wait()
            if projecting:
                self.gate_projection(activation_words, fb_words, dt_gate, a_exp, decays,
                                     raw_gates, gates_arrived, block, tid)
            # the pending count and beta arrive behind the slot: used only now
            n = cutlass.max(cutlass.min(pending_n, Int32(RQ)), Int32(0))
            if tid < T:
                betas[tid] = sigmoids([beta_t])[0]
            self.stamp(timeline, 4, tid)
            cute.arch.cp_async_wait_group(0)
            cute.arch.barrier()
            if cutlass.const_expr(SPLIT > 1):
                # This CTA has read the old window and records, and its exchange barrier
                # is armed; the peers wait for it only before writing the records, so the
                # convolution hides their skew. Relaxed: the reads have completed (the
                # copies waited on) and the barrier's init is fenced, so no release is
                # needed, and its GPU-scope fence cost 0.3 us at B = 1. (Before the
                # state's request: after it, the peers waited 0.7 us longer at B = 1.)
                cute.arch.cluster_arrive_relaxed()
            if (tid == 0) & (crowded == False):  # noqa: E712 - a device Boolean
                self.request_state(staged, state, state_arrived, slot, head, row0)
            self.stamp(timeline, 5, tid)
            activations, history, inputs = self.convolve(window_in, x_in, taps, bias,
                                                         values_v, norm_sums, n, tid)
            self.load_records(records_in, kp, old_decays, old_sums, a_exp, dt_channel, n,
                              tid)
            cute.arch.griddepcontrol_launch_dependents()
            cute.arch.barrier()
            self.stamp(timeline, 6, tid)
            if cutlass.const_expr(SPLIT > 1):
                cute.arch.cluster_wait()
            self.stamp(timeline, 7, tid)
            # every CTA of the item computed every channel: each writes its share
            if (tid % K) // (K // SPLIT) == rank:
                self.write_records(key_gates, conv, activations, raw_gates, history, inputs,
                                   rec, has_records, slot, head, tid)

            if section == 0:
                if cutlass.const_expr(SPLIT > 1):
                    cute.arch.mbarrier_wait(gates_arrived, 0)
                self.token_vectors(activations, norm_sums, decays, xvec, pairs, tid)
            else:
                self.replay_vectors(kp, old_decays, old_sums, decay_n, n, tid)
                # The solve's output gates, here where section 1 waits for section 0
                # rather than on the path after the state pass: into old_decays, whose
                # column `channel` (= row) only this thread read, and for the last time.
                row = tid - K
                if row < RC:
                    gates = sigmoids([Float32(gate_in[t, row]) for t in range(T)])
                    for t in cutlass.range_constexpr(T):
                        old_decays[t, row] = gates[t]
            cute.arch.barrier()
            if tid < NP:
                pair_sums[tid] = tree_sum([pairs[tid, w] for w in range(4)])
            self.stamp(timeline, 8, tid)

            self.state_pass(state, staged, state_arrived, xvec, kp, old_u, decay_n, dots,
                            slot, n, head, row0, timeline, tid)
            cute.arch.barrier()
            self.stamp(timeline, 10, tid)
            outs, gated = self.solve_rows(corrections, dots, pair_sums, values_v, betas,
                                          old_decays, rec, has_records, head, row0, tid)
            self.stamp(timeline, 11, tid)
            self.gated_norm(out, outs, gated, out_sums, received, exchange, nw, request,
                            head, rank, row0, tid)
            self.stamp(timeline, 12, tid)
        else:
            if cutlass.const_expr(SPLIT > 1):
                cute.arch.cluster_wait()  # this thread's arrival is matched
            cute.arch.cp_async_commit_group()
            cute.arch.cp_async_wait_group(0)  # no copy may land after the CTA is gone
            if tid < RC:
                for t in cutlass.range_constexpr(T):
                    out[wide((request * T + t) * H + head) * K + row0 + tid] = BFloat16(0.0)
            cute.arch.griddepcontrol_launch_dependents()

    @cute.jit
    def load_weights(self, conv_weight, conv_bias, a_log, dt_bias, f_b, norm_weight,
                     head, projecting, block, tid):
        """Conv taps and bias of this thread's channel (q and k, or v), exp(a_log), the
        dt_bias values it needs, the f_b mma fragments of feature block `block` if its warp
        is `projecting`, its row's norm weight."""
        H: cutlass.Constexpr = self.heads
        channel, section = tid % K, tid // K
        taps = cute.make_rmem_tensor((2, 4), Float32)
        bias = cute.make_rmem_tensor(2, Float32)
        bias.fill(0.0)
        for s in cutlass.range_constexpr(2):
            part = 2 * section + s  # 0 q, 1 k, 2 v (s = 1 unused in section 1)
            if (section == 0) | (s == 0):
                for i in cutlass.range_constexpr(4):
                    taps[s, i] = Float32(conv_weight[((part * 4 + i) * H + head) * K + channel])
                if cutlass.const_expr(self.has_bias):
                    bias[s] = Float32(conv_bias[(part * H + head) * K + channel])
        a_log_h = Float32(a_log[head])
        dt_channel = Float32(dt_bias[head * K + channel])
        dt_gate = cute.make_rmem_tensor(2, Float32)
        fb_words = cute.make_rmem_tensor((8, 4), cutlass.Uint32)
        if projecting:
            self.load_projection(dt_bias, f_b, head, dt_gate, fb_words, block, tid)
        nw = Float32(0.0)
        if tid < self.rows:
            nw = Float32(norm_weight[cute.arch.block_idx()[0] * self.rows + tid])
        return taps, bias, dt_gate, fb_words, a_log_h, dt_channel, nw

    @cute.jit
    def load_projection(self, dt_bias, f_b, head, dt_gate, fb_words, block, tid):
        """The dt_bias values of features 16 block + [0, 16) into dt_gate and their f_b
        mma fragments into fb_words."""
        lane = tid % 32
        group, quarter = lane // 4, lane % 4
        for i in cutlass.range_constexpr(2):
            dt_gate[i] = Float32(dt_bias[head * K + 16 * block + group + 8 * i])
        # A fragments of m16n8k16: features 16 block + group (+ 8) in registers 0, 2 (1, 3).
        # The k order is permuted (as the activations' is) so that a thread's ranks of
        # two chunks are 8 contiguous ones, one 16-byte load: chunk 2 p + j holds ranks
        # 32 p + 8 quarter + 4 j + [0, 4), which keeps each rank quarter in its two chunks
        # (gate_mode 1).
        for pair in cutlass.range_constexpr(4):
            for i in cutlass.range_constexpr(2):
                feature = head * K + 16 * block + group + 8 * i
                words = load_words(f_b, wide(feature) * K + 32 * pair + 8 * quarter, 4)
                for j in cutlass.range_constexpr(2):
                    fb_words[2 * pair + j, i] = words[2 * j]
                    fb_words[2 * pair + j, 2 + i] = words[2 * j + 1]

    @cute.jit
    def prefetch(self, x, f_a, beta, gate, slots, record_rows, conv, corrections, key_gates,
                 pending, num_slots, num_records, request, head, row0, tid):
        """L2 prefetches of the item's small reads, before griddepcontrol.wait, one line a
        lane (`prefetch_rows`): warps 0 and 1 the inputs; warp 2, the one warp that waits
        for a read here, the slot and record row, only to aim the prefetches of the window
        and records (a stale or out-of-range value costs a useless prefetch, never a wrong
        or stray read). Not the state rows: their copy goes out early enough to land
        before the state pass anyway, and their 32 KB a CTA made a launch that does not
        overlap its predecessor (under XLA) 4% longer (benchmarks/NOTES.md, change 22)."""
        T: cutlass.Constexpr = self.tokens
        H: cutlass.Constexpr = self.heads
        RQ: cutlass.Constexpr = self.record_tokens
        W: cutlass.Constexpr = RQ + 2
        lane, warp = tid % 32, tid // 32
        if warp == 0:  # x [request, t, part, head]: 3 T rows of K
            self.prefetch_rows(x, (wide(request) * 3 * T * H + head) * K, H * K, 3 * T, K,
                               lane)
        if warp == 1:  # gate [request, t, head, this CTA's rows], f_a [request], beta
            self.prefetch_rows(gate, (wide(request) * T * H + head) * K + row0, H * K, T,
                               self.rows, lane)
            self.prefetch_rows(f_a, wide(request) * T * K, 0, 1, T * K, lane)
            self.prefetch_rows(beta, wide(request) * T * H + head, H, T, 1, lane)
        if warp == 2:
            slot, rec = load_i32_pair(slots, request, record_rows, request, speculative=True)
            if (slot > 0) & (slot < num_slots):
                self.prefetch_rows(conv, self.window_base(slot, 0, head, 0), H * K * W, 3,
                                   K * W, lane)
            if (rec >= 0) & (rec < num_records):
                self.prefetch_rows(corrections, (wide(rec) * H + head) * RQ * K, 0, 1,
                                   RQ * K, lane)
                self.prefetch_rows(key_gates, (wide(rec) * H + head) * RQ * 2 * K, 0, 1,
                                   RQ * 2 * K, lane)
                if lane == 0:
                    prefetch_line_l2(pending + rec)

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

    @cute.jit
    def request_state(self, staged, state, state_arrived, slot, head, row0):
        """This CTA's state rows (contiguous) into `staged` by one bulk copy."""
        H: cutlass.Constexpr = self.heads
        bulk_copy(staged.iterator, aligned(state, ((wide(slot) * H + head) * K + row0) * K, 16),
                  self.rows * K * 4, state_arrived)

    @cute.jit
    def stamp(self, timeline, index: cutlass.Constexpr, tid):
        """Diagnostics (timeline=True): thread 0 writes the SM clock at phase `index` of
        its CTA into timeline [CTAs, STAMPS] int64, after the SM id and the global timer
        at phase 0, the global timer again at the last phase."""
        if cutlass.const_expr(self.timeline):
            if tid == 0:
                rank, head, request = cute.arch.block_idx()
                row = wide((request * self.heads + head) * self.split + rank) * STAMPS
                if cutlass.const_expr(index == 0):
                    timeline[row] = Int64(cute.arch.smid())
                    timeline[row + 1] = cute.arch.globaltimer()
                timeline[row + 3 + index] = cute.arch.clock64()
                if cutlass.const_expr(index == PHASES - 1):
                    timeline[row + 2] = cute.arch.globaltimer()

    @cute.jit
    def stage(self, dst, src, base, stride, rows: cutlass.Constexpr,
              row_elems: cutlass.Constexpr, tid):
        """cp.async `rows` rows of `row_elems` elements (a multiple of 16 bytes) from
        src + base + r stride into the contiguous shared tensor dst, 16 bytes a thread."""
        per: cutlass.Constexpr = 128 // src.dtype.width  # elements per copy
        row_copies: cutlass.Constexpr = row_elems // per
        count: cutlass.Constexpr = rows * row_copies
        for i in cutlass.range_constexpr(-(-count // THREADS)):
            index = tid + THREADS * i
            if index < count:
                r, j = index // row_copies, index % row_copies
                cp_async_16(dst.iterator + (r * row_elems + j * per),
                            aligned(src, base + r * stride + j * per, 16))

    @cute.jit
    def window_base(self, slot, part, head, channel):
        """Offset of window[slot, part, head, channel, 0]."""
        W: cutlass.Constexpr = self.record_tokens + 2
        return (((wide(slot) * 3 + part) * self.heads + head) * K + channel) * W

    @cute.jit
    def convolve(self, window_in, x_in, taps, bias, values_v, norm_sums, n, tid):
        """The short convolution and SiLU of this thread's channel: q and k (section 0,
        rows 0 and 1; sums of squares per warp into norm_sums) or v (section 1, row 0;
        into values_v), from the staged window (whole: staged before n was known) and
        inputs. The history is window[o .. o+2], o = max(n - 1, 0). Returns the
        activations, the history's last two values and the raw inputs (the new window)."""
        T: cutlass.Constexpr = self.tokens
        channel, section = tid % K, tid // K
        lane, warp = tid % 32, tid // 32
        offset = cutlass.max(n - 1, Int32(0))
        activations = cute.make_rmem_tensor((2, T), Float32)
        history = cute.make_rmem_tensor((2, 2), Float32)
        inputs = cute.make_rmem_tensor((2, T), Float32)
        activations.fill(0.0)
        history.fill(0.0)
        inputs.fill(0.0)
        for s in cutlass.range_constexpr(2):
            part = 2 * section + s
            if (section == 0) | (s == 0):
                seq = cute.make_rmem_tensor(T + 3, Float32)
                for i in cutlass.range_constexpr(3):
                    seq[i] = Float32(window_in[part, channel, offset + i])
                for t in cutlass.range_constexpr(T):
                    inputs[s, t] = Float32(x_in[t, part, channel])
                    seq[3 + t] = inputs[s, t]
                for i in cutlass.range_constexpr(2):
                    history[s, i] = seq[1 + i]
                for t in cutlass.range_constexpr(T):
                    y = bias[s]
                    for i in cutlass.range_constexpr(4):  # rounded products, as the stock loop
                        y = cute.math.add(y, cute.math.mul(taps[s, i], seq[t + i], rounding=RN),
                                          rounding=RN)
                    activations[s, t] = y
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
                norm_sums[index // 2, index % 2, warp] = squares
        else:
            for t in cutlass.range_constexpr(T):
                values_v[t, channel] = activations[0, t]
        return activations, history, inputs

    @cute.jit
    def load_records(self, records_in, kp, old_decays, old_sums, a_exp, dt_channel, n,
                     tid):
        """Section 1: the staged recorded keys (into kp, normalized later), their decays
        and the keys' sums of squares per warp; t >= n (and every t when the request
        has no record row: n = 0) masked."""
        RQ: cutlass.Constexpr = self.record_tokens
        channel, section = tid % K, tid // K
        lane, warp = tid % 32, tid // 32
        if section == 1:
            # t >= n are masked: their staged bytes may be stale or never staged
            keys = [cutlass.select_(t < n, Float32(records_in[t, 0, channel]), Float32(0.0))
                    for t in range(RQ)]
            for first in cutlass.range_constexpr(0, RQ, 8):  # decays in batches of 8
                tokens = range(first, min(first + 8, RQ))
                gates = [Float32(cutlass.select_(t < n, Float32(records_in[t, 1, channel]),
                                                 Float32(0.0))) for t in tokens]
                recorded = decays(gates, a_exp, [dt_channel] * len(gates), self.lower_bound)
                for t, d in zip(tokens, recorded):
                    if t < n:
                        kp[t, channel] = keys[t]
                        old_decays[t, channel] = d
            squares, index, holds = warp_totals([key * key for key in keys], lane)
            if holds:
                old_sums[index, warp - 4] = squares

    @cute.jit
    def load_activations(self, f_a, request, projecting, tid):
        """The mma B fragments of f_a (if `projecting`): token `group` (mod T), chunk 2 p + j
        holding ranks 32 p + 8 quarter + 4 j + [0, 4) as two bf16x2 words (the f_b
        fragments' k order)."""
        T: cutlass.Constexpr = self.tokens
        lane = tid % 32
        group, quarter = lane // 4, lane % 4
        token_row = wide(request * T + group % T) * K
        fragments = cute.make_rmem_tensor((8, 2), cutlass.Uint32)
        if projecting:
            for pair in cutlass.range_constexpr(4):
                words = load_words(f_a, token_row + 32 * pair + 8 * quarter, 4)
                for i in cutlass.range_constexpr(4):
                    fragments[2 * pair + i // 2, i % 2] = words[i]
        return fragments

    @cute.jit
    def gate_projection(self, activation_words, fb_words, dt_gate, a_exp, decays_out,
                        raw_gates, gates_arrived, block, tid):
        """raw_g = bf16(f_a . f_b[h]^T) with bf16 mma (this warp: features 16 block +
        [0, 16), tokens as the 8 columns) into raw_gates, and this step's decays into
        decays_out, pushed to every CTA of the cluster (their `gates_arrived`) where
        split > 1."""
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
                tokens.append(2 * quarter + e % 2)
                features.append(16 * block + group + 8 * (e // 2))
                dts.append(dt_gate[e // 2])
        gates = decays(values, a_exp, dts, self.lower_bound)
        for i in cutlass.range_constexpr(per):
            if tokens[i] < T:  # columns token >= T (T not 2 or 4) repeat token % T
                raw_gates[tokens[i], features[i]] = BFloat16(values[i])
                if cutlass.const_expr(self.split > 1):
                    for peer in cutlass.range_constexpr(self.split):
                        push_f32(decays_out.iterator + tokens[i] * K + features[i], gates[i],
                                 gates_arrived, peer)
                else:
                    decays_out[tokens[i], features[i]] = gates[i]

    @cute.jit
    def token_vectors(self, activations, norm_sums, decays, xvec, pairs, tid):
        """Section 0: normalized q (scaled) and k of this channel; Gamma_t k_t and
        Gamma_t q_t into xvec; the channel's terms of the T^2 pair products, summed per
        warp into pairs."""
        T: cutlass.Constexpr = self.tokens
        NP: cutlass.Constexpr = T * T
        channel, lane, warp = tid % K, tid % 32, tid // 32
        qs = cute.make_rmem_tensor(T, Float32)
        ks = cute.make_rmem_tensor(T, Float32)
        normalized = divided_by_roots(
            [activations[s, t] for s in range(2) for t in range(T)],
            [tree_sum([norm_sums[t, s, w] for w in range(4)]) + NORM_EPS
             for s in range(2) for t in range(T)], NORM_EPS)
        gamma = Float32(1.0)
        for t in cutlass.range_constexpr(T):
            qs[t] = normalized[t] * self.scale
            ks[t] = normalized[T + t]
            d = decays[t, channel]
            gamma = d if t == 0 else gamma * d
            xvec[t, channel] = gamma * ks[t]
            xvec[T + t, channel] = gamma * qs[t]
        d = [decays[t, channel] for t in range(T)]
        pairs_in_order = [("A", t, s) for t in range(T) for s in range(t)] + [
            ("B", t, s) for t in range(T) for s in range(t + 1)]
        for first in cutlass.range_constexpr(0, NP, 32):  # 32 pairs per warp_totals
            terms = []
            for kind, t, s in pairs_in_order[first:first + 32]:
                weighted = ks[s]  # k_s P(s, t), the products in token order
                for r in cutlass.range_constexpr(s + 1, t + 1):
                    weighted = weighted * d[r]
                terms.append(weighted * (ks[t] if kind == "A" else qs[t]))
            total, index, holds = warp_totals(terms, lane)
            if holds:
                pairs[first + index, warp] = total

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
    def state_pass(self, state, staged, state_arrived, xvec, kp, old_u, decay_n, dots,
                   slot, n, head, row0, timeline, tid):
        """Per 4-key chunk of this thread's rows: S_n = S_0 D_n + sum_t u_t (kn_t P_t),
        written back if n > 0, and the 2T dot products with Gamma k and Gamma q; the
        LANES partial dots of a row are then summed into dots[row]."""
        T: cutlass.Constexpr = self.tokens
        H: cutlass.Constexpr = self.heads
        RPT: cutlass.Constexpr = self.rows_per_thread
        LANES: cutlass.Constexpr = self.lanes
        RC: cutlass.Constexpr = self.rows
        base = (wide(slot) * H + head) * K + row0
        lane_in, row_in = tid % LANES, tid // LANES
        first_row = row_in * RPT  # of this CTA's rows: one vector load of old_u each t
        acc = cute.make_rmem_tensor((RPT, 2 * T), Float32)
        acc.fill(0.0)
        cute.arch.mbarrier_wait(state_arrived, 0)
        self.stamp(timeline, 9, tid)
        for c in cutlass.range_constexpr(self.chunks):
            order = c
            if cutlass.const_expr(LANES < 8):
                # A quarter warp's 16-byte loads cover 128 bytes: with 4 lanes per row that
                # is two rows 512 bytes apart (the same banks) unless they take the
                # chunks in different orders.
                order = c ^ (row_in % 2)
            key = 4 * (lane_in + LANES * order)
            rows = cute.make_rmem_tensor((RPT, 4), Float32)
            replayed = cute.make_rmem_tensor((RPT, 4), Float32)
            for r in cutlass.range_constexpr(RPT):
                v = load_vec(staged.iterator, (first_row + r) * K + key, 4)
                for e in cutlass.range_constexpr(4):
                    rows[r, e] = v[e]
            if n > 0:  # token 0's products start the sums: no zeroed accumulators
                k4 = load_vec(kp.iterator, key, 4)
                u = load_vec(old_u.iterator, first_row, RPT)
                for r in cutlass.range_constexpr(RPT):
                    for e in cutlass.range_constexpr(4):
                        replayed[r, e] = cute.math.fma(u[r], k4[e], Float32(0.0))
            else:
                replayed.fill(0.0)
            for t in range(1, n):
                k4 = load_vec(kp.iterator, t * K + key, 4)
                u = load_vec(old_u.iterator, t * RC + first_row, RPT)
                for r in cutlass.range_constexpr(RPT):
                    for e in cutlass.range_constexpr(4):
                        replayed[r, e] = cute.math.fma(u[r], k4[e], replayed[r, e])
            d4 = load_vec(decay_n.iterator, key, 4)
            for r in cutlass.range_constexpr(RPT):
                for e in cutlass.range_constexpr(4):
                    rows[r, e] = cute.math.fma(rows[r, e], d4[e], replayed[r, e])
                target = aligned(state, (base + first_row + r) * K + key, 16)
                store_f32x4_if(target, [rows[r, e] for e in range(4)], n > 0)
            for j in cutlass.range_constexpr(2 * T):
                x4 = load_vec(xvec.iterator, j * K + key, 4)
                for r in cutlass.range_constexpr(RPT):
                    for e in cutlass.range_constexpr(4):
                        acc[r, j] = cute.math.fma(rows[r, e], x4[e], acc[r, j])
        # the LANES partial sums of each (row, dot) meet in one lane of the row's group
        count: cutlass.Constexpr = RPT * 2 * T
        per_lane: cutlass.Constexpr = -(-count // LANES)
        totals = transpose_sum([acc[r, j] for r in range(RPT) for j in range(2 * T)]
                               + [Float32(0.0)] * (per_lane * LANES - count), tid % 32,
                               LANES)
        for i in cutlass.range_constexpr(per_lane):
            index = lane_in * per_lane + i
            if index < count:
                dots[first_row + index // (2 * T), index % (2 * T)] = totals[i]

    @cute.jit
    def solve_rows(self, corrections, dots, pair_sums, values_v, betas, output_gates, rec,
                   has_records, head, row0, tid):
        """Per state row (thread < RC): the T x T forward substitution for u_t, u_t into
        the records; returns the outputs o_t (bf16) and the output gates sigmoid(gate_t)
        of the row, taken from output_gates [T, RC] (zeros in the other threads)."""
        T: cutlass.Constexpr = self.tokens
        H: cutlass.Constexpr = self.heads
        outs = cute.make_rmem_tensor(T, Float32)
        outs.fill(0.0)
        gated = cute.make_rmem_tensor(T, Float32)
        gated.fill(0.0)
        if tid < self.rows:
            for t in cutlass.range_constexpr(T):
                gated[t] = output_gates[t, tid]
            row = row0 + tid
            us = cute.make_rmem_tensor(T, Float32)
            for t in cutlass.range_constexpr(T):
                total = dots[tid, t]
                for s in cutlass.range_constexpr(t):
                    total = cute.math.fma(pair_sums[pair_index(T, t, s, "A")], us[s], total)
                us[t] = (values_v[t, row] - total) * betas[t]
                if has_records:
                    corrections[((wide(rec) * H + head) * self.record_tokens + t) * K
                                + row] = us[t]
            for t in cutlass.range_constexpr(T):
                o = dots[tid, T + t]
                for s in cutlass.range_constexpr(t + 1):
                    o = cute.math.fma(pair_sums[pair_index(T, t, s, "B")], us[s], o)
                outs[t] = round_bf16(o)
        return outs, gated

    @cute.jit
    def gated_norm(self, out, outs, gated, out_sums, received, exchange, nw, request, head,
                   rank, row0, tid):
        """out = bf16(o rsqrt(mean(o^2) + eps) norm_weight sigmoid(gate)) over the K value
        rows, from this thread's row's outs and gated (solve_rows); the sums of squares of
        the cluster's CTAs meet in every CTA over DSMEM."""
        T: cutlass.Constexpr = self.tokens
        H: cutlass.Constexpr = self.heads
        SPLIT: cutlass.Constexpr = self.split
        RC: cutlass.Constexpr = self.rows
        NW: cutlass.Constexpr = (RC + 31) // 32  # warps holding this CTA's rows
        lane, warp = tid % 32, tid // 32
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
            row = row0 + tid
            means = []
            for t in cutlass.range_constexpr(T):
                if cutlass.const_expr(SPLIT > 1):
                    sumsq = tree_sum([received[p, t] for p in range(SPLIT)])
                else:
                    sumsq = tree_sum([out_sums[t, w] for w in range(NW)])
                means.append(sumsq / K + self.eps)
            rstd = divided_by_roots([Float32(1.0)] * T, means, self.eps)
            for t in cutlass.range_constexpr(T):
                where = wide((request * T + t) * H + head) * K + row
                out[where] = BFloat16(outs[t] * rstd[t] * nw * gated[t])

    @cute.jit
    def write_records(self, key_gates, conv, activations, raw_gates, history, inputs, rec,
                      has_records, slot, head, tid):
        """Once every CTA of the item has read the old ones: the new records' keys
        (section 0) and raw gates (section 1), and the window
        [history[1], history[2], x_0 .. x_{T-1}] of this thread's channels."""
        T: cutlass.Constexpr = self.tokens
        H: cutlass.Constexpr = self.heads
        channel, section = tid % K, tid // K
        if has_records:
            for t in cutlass.range_constexpr(T):
                base = ((wide(rec) * H + head) * self.record_tokens + t) * 2 * K + channel
                if section == 0:
                    key_gates[base] = BFloat16(activations[1, t])
                else:
                    key_gates[base + K] = raw_gates[t, channel]
        for s in cutlass.range_constexpr(2):
            if (section == 0) | (s == 0):
                base = self.window_base(slot, 2 * section + s, head, channel)
                for i in cutlass.range_constexpr(2):
                    conv[base + i] = BFloat16(history[s, i])
                for t in cutlass.range_constexpr(T):
                    conv[base + 2 + t] = BFloat16(inputs[s, t])
