"""The prompt's state across its chunks (CuTe DSL, sm_90a): the scan of
`jax_kda.prompt_chunks.recurrence` as one kernel, the state rows kept on chip from the
first chunk to the last.

Per chunk, from the chunk's operands (solved for every chunk at once before it runs)
and the state rows S [R, K] this CTA carries (value row, key column):

    u = u_v - w_k S^T,   o = gq S^T + Bm u,   S <- S diag(decay) + u^T tail

A CTA owns R = 32 value rows of one (request, head): 4 CTAs per head, whose chunk
operands w_k, gq, tail and Bm are the same (read once from HBM, then from L2). Its 256
threads are two sides of 128: side 0 computes u and carries the state rows in
registers, side 1 computes o; each side's products are FP32 fused multiply-adds in
register tiles. The next chunk's operands are copied in (cp.async) while this one ends.
"""
from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from jax_kda.config import K
from jax_kda.kernels.primitives import (aligned, cp_async_16, load_vec, row_major,
                                        store_f32, store_vec, wide)

THREADS = 256  # two sides of 128: two warps per scheduler hide each other's latency
SIDE = 128
ROWS = 32  # R: the state's value rows per CTA
PAD = 4  # floats after each row of the state and of u^T: rows 16-byte units apart that
# differ mod 8, so the 8 threads of a 16-byte load phase hit distinct banks
TILE = 4  # tokens and rows per thread of a side's [C, R] products: [C / 16 x 4]


class ChunkStates:
    """The kernel for chunks of C tokens (a multiple of 16, at most 64); `__call__`
    launches it on a stream with the inputs, then the outputs, of `shapes`."""

    def __init__(self, chunk: int):
        if chunk % 16 or not 16 <= chunk <= 64:
            raise ValueError(f"chunk: expected a multiple of 16 in [16, 64], got {chunk}")
        self.chunk = chunk

    def shapes(self, B, H, N):
        """The operands for B requests, H heads and N chunks, all FP32 and row-major:
        (inputs u_v, w_k, gq, tail [B, H, N, C, K], decay [B, H, N, K], bm
        [B, H, N, C, C], state [B, H, K, K]; outputs o [B, H, N, C, K], state_out
        [B, H, K, K])."""
        tokens, state = (B, H, N, self.chunk, K), (B, H, K, K)
        return ([tokens] * 4 + [(B, H, N, K), (B, H, N, self.chunk, self.chunk), state],
                [tokens, state])

    def buffers(self):
        """The CTA's shared buffers, in allocation order: name -> shape (FP32); tokens
        holds w_k (side 0's) and gq (side 1's); u_v's rows are padded by 2 PAD so that a
        warp's scalar reads of 4 tokens x 8 rows hit 32 distinct banks."""
        C = self.chunk
        return {"tokens": (2, C, K), "tail": (C, K), "bm": (C, C),
                "u_v": (C, ROWS + 2 * PAD), "decay": (K,), "s": (ROWS, K + PAD),
                "ut": (ROWS, C + PAD)}

    @cute.jit
    def __call__(self, stream: cuda.CUstream, u_v: cute.Tensor, w_k: cute.Tensor,
                 gq: cute.Tensor, tail: cute.Tensor, decay: cute.Tensor, bm: cute.Tensor,
                 state: cute.Tensor, o: cute.Tensor, state_out: cute.Tensor):
        self.kernel(u_v.iterator, w_k.iterator, gq.iterator, tail.iterator, decay.iterator,
                    bm.iterator, state.iterator, o.iterator, state_out.iterator,
                    Int32(w_k.shape[2])).launch(
            grid=(K // ROWS, state.shape[1], state.shape[0]), block=(THREADS, 1, 1),
            stream=stream)

    @cute.kernel
    def kernel(self, u_v, w_k, gq, tail, decay, bm, state, o, state_out, chunks: Int32):
        tid, _, _ = cute.arch.thread_idx()
        block, head, request = cute.arch.block_idx()
        side, lane = tid // SIDE, tid % SIDE
        item = wide(request) * cute.arch.grid_dim()[1] + head
        first = block * ROWS  # this CTA's first value row
        smem = self.shared_memory()
        rows = self.load_state(state, smem, item, first, side, lane)
        operands = (u_v, w_k, gq, tail, decay, bm)
        self.stage_products(smem, operands, item * chunks, first, tid)
        self.stage_updates(smem, operands, item * chunks, tid)
        for n in cutlass.range(chunks):
            cute.arch.cp_async_wait_group(1)  # this chunk's products' operands
            cute.arch.barrier()
            dots = self.products(smem, side, lane)  # w_k S^T (side 0), gq S^T (side 1)
            if side == 0:
                self.corrections(smem, dots, lane)
            cute.arch.cp_async_wait_group(0)  # and its updates'
            cute.arch.barrier()
            if n + 1 < chunks:  # the next chunk's products' operands, while this one ends
                self.stage_products(smem, operands, item * chunks + n + 1, first, tid)
            if side == 0:
                self.advance(smem, rows, lane)
            else:
                self.output(smem, dots, o, (item * chunks + n) * self.chunk, first, lane)
            cute.arch.barrier()
            if n + 1 < chunks:
                self.stage_updates(smem, operands, item * chunks + n + 1, tid)
        if side == 0:
            for j in cutlass.range_constexpr(ROWS // 4):
                at = (item * K + first + lane // 32 + 4 * j) * K + (lane % 32) * 4
                for q in cutlass.range_constexpr(4):
                    store_f32(state_out, at + q, rows[j * 4 + q])

    @cute.jit
    def shared_memory(self):
        smem = cutlass.memory.SmemAllocator()
        return {name: smem.allocate_tensor(Float32, row_major(*shape), byte_alignment=16)
                for name, shape in self.buffers().items()}

    @cute.jit
    def load_state(self, state, smem, item, first, side, lane):
        """Side 0's state entries (rows lane / 32 + 4 j, keys 4 (lane % 32) + 0..3) in
        registers and in shared memory."""
        rows = cute.make_rmem_tensor(ROWS, Float32)
        if side == 0:
            for j in cutlass.range_constexpr(ROWS // 4):
                r = lane // 32 + 4 * j
                vec = load_vec(state, (item * K + first + r) * K + (lane % 32) * 4, 4)
                for q in cutlass.range_constexpr(4):
                    rows[j * 4 + q] = vec[q]
                store_vec(smem["s"].iterator, r * (K + PAD) + (lane % 32) * 4, vec)
        cute.arch.barrier()
        return rows

    @cute.jit
    def stage_products(self, smem, operands, chunk, first, tid):
        """cp.async of what `products` and `corrections` read of chunk `chunk` (w_k, gq,
        this CTA's u_v columns), one commit group."""
        u_v, w_k, gq = operands[:3]
        C: cutlass.Constexpr = self.chunk
        tokens = smem["tokens"]
        self.copy_rows(tokens.iterator, K, w_k, chunk * (C * K), K, C, K, tid)
        self.copy_rows(tokens.iterator + C * K, K, gq, chunk * (C * K), K, C, K, tid)
        self.copy_rows(smem["u_v"].iterator, ROWS + 2 * PAD, u_v, chunk * (C * K) + first, K,
                       C, ROWS, tid)
        cute.arch.cp_async_commit_group()

    @cute.jit
    def stage_updates(self, smem, operands, chunk, tid):
        """cp.async of what `output` and `advance` read (tail, decay, Bm), one group."""
        tail, decay, bm = operands[3:]
        C: cutlass.Constexpr = self.chunk
        self.copy_rows(smem["tail"].iterator, K, tail, chunk * (C * K), K, C, K, tid)
        self.copy_rows(smem["decay"].iterator, K, decay, chunk * K, K, 1, K, tid)
        self.copy_rows(smem["bm"].iterator, C, bm, chunk * (C * C), C, C, C, tid)
        cute.arch.cp_async_commit_group()

    @cute.jit
    def copy_rows(self, dst, pitch: cutlass.Constexpr, src, base, stride,
                  rows: cutlass.Constexpr, width: cutlass.Constexpr, tid):
        """cp.async of `rows` rows of `width` floats from src + base + r stride to
        dst + r pitch, 16 bytes a thread."""
        per_row: cutlass.Constexpr = width // 4
        count: cutlass.Constexpr = rows * per_row
        for i in cutlass.range_constexpr(-(-count // THREADS)):
            index = tid + THREADS * i
            if index < count:
                r, j = index // per_row, index % per_row
                cp_async_16(dst + (r * pitch + j * 4),
                            aligned(src, base + r * stride + j * 4, 16))

    @cute.jit
    def products(self, smem, side, lane):
        """The side's tokens (w_k or gq) times S^T for this thread's tile: tokens
        lane / 8 + 16 i, rows lane % 8 + 8 j."""
        C: cutlass.Constexpr = self.chunk
        I: cutlass.Constexpr = C // 16
        dots = cute.make_rmem_tensor(I * TILE, Float32)
        for a in cutlass.range_constexpr(I * TILE):
            dots[a] = Float32(0.0)
        tokens = smem["tokens"].iterator + side * (C * K)
        for c in cutlass.range(0, K, 4, unroll=4):
            keys = [load_vec(smem["s"].iterator, (lane % 8 + 8 * j) * (K + PAD) + c, 4)
                    for j in range(TILE)]
            lines = [load_vec(tokens, (lane // 8 + 16 * i) * K + c, 4) for i in range(I)]
            for q in cutlass.range_constexpr(4):  # independent accumulators back to back
                for i in cutlass.range_constexpr(I):
                    for j in cutlass.range_constexpr(TILE):
                        dots[i * TILE + j] = dots[i * TILE + j] + lines[i][q] * keys[j][q]
        return dots

    @cute.jit
    def corrections(self, smem, dots, lane):
        """u = u_v - w_k S^T of side 0's tile into u^T (shared)."""
        for i in cutlass.range_constexpr(self.chunk // 16):
            t = lane // 8 + 16 * i
            for j in cutlass.range_constexpr(TILE):
                r = lane % 8 + 8 * j
                smem["ut"][r, t] = smem["u_v"][t, r] - dots[i * TILE + j]

    @cute.jit
    def output(self, smem, inter, o, at, first, lane):
        """o = gq S^T + Bm u for side 1's tile, to global memory (FP32) from token row
        `at` on."""
        C: cutlass.Constexpr = self.chunk
        I: cutlass.Constexpr = C // 16
        for s in cutlass.range(0, C, 4, unroll=2):
            us = [load_vec(smem["ut"].iterator, (lane % 8 + 8 * j) * (C + PAD) + s, 4)
                  for j in range(TILE)]
            pairs = [load_vec(smem["bm"].iterator, (lane // 8 + 16 * i) * C + s, 4)
                     for i in range(I)]
            for q in cutlass.range_constexpr(4):
                for i in cutlass.range_constexpr(I):
                    for j in cutlass.range_constexpr(TILE):
                        inter[i * TILE + j] = inter[i * TILE + j] + pairs[i][q] * us[j][q]
        for i in cutlass.range_constexpr(I):
            t = lane // 8 + 16 * i
            for j in cutlass.range_constexpr(TILE):
                store_f32(o, (at + t) * K + first + lane % 8 + 8 * j, inter[i * TILE + j])

    @cute.jit
    def advance(self, smem, rows, lane):
        """S <- S diag(decay) + u^T tail for side 0's entries, in registers and in shared
        memory (read by the next chunk's `products`)."""
        C: cutlass.Constexpr = self.chunk
        col = (lane % 32) * 4
        decay = load_vec(smem["decay"].iterator, col, 4)
        for j in cutlass.range_constexpr(ROWS // 4):
            for q in cutlass.range_constexpr(4):
                rows[j * 4 + q] = rows[j * 4 + q] * decay[q]
        for t in cutlass.range(0, C, 4, unroll=2):
            keys = [load_vec(smem["tail"].iterator, (t + p) * K + col, 4) for p in range(4)]
            us = [load_vec(smem["ut"].iterator, (lane // 32 + 4 * j) * (C + PAD) + t, 4)
                  for j in range(ROWS // 4)]
            for p in cutlass.range_constexpr(4):
                for j in cutlass.range_constexpr(ROWS // 4):
                    for q in cutlass.range_constexpr(4):
                        rows[j * 4 + q] = rows[j * 4 + q] + us[j][p] * keys[p][q]
        for j in cutlass.range_constexpr(ROWS // 4):
            for q in cutlass.range_constexpr(4):
                smem["s"][lane // 32 + 4 * j, col + q] = rows[j * 4 + q]
