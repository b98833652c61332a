"""The prompt's state across its chunks (CuTe DSL, sm_90a): the scan of
`jax_kda.prompt_chunks.recurrence` as one kernel, the state rows kept on chip from the
first chunk to the last.

Per chunk, from the chunk's operands (solved for every chunk at once before it runs)
and the state rows S [R, K] this CTA carries (value row, key column):

    u = u_v - w_k S^T,   o = gq S^T + Bm u,   S <- S diag(decay) + u^T tail

A CTA owns R = 32 value rows of one (request, head): 4 CTAs per head, whose chunk
operands w_k, gq, tail and Bm are the same (read once from HBM, then from L2). Every
product runs on tensor cores in split TF32 (`primitives.mma_3xtf32`: FP32-faithful, FP32
accumulation), by warp-level mma m16n8k8 tiles. Its 8 warps are two sides of 4: side 0
computes u, side 1 o, a side's warp m over the tokens 16 m .. 16 m + 15; side s carries
the state rows 16 s .. 16 s + 15 in its accumulators, its warp w keys 32 w .. 32 w + 31.
The state and u are kept in shared memory already split, as the operands every warp
reads. The next chunk's operands are copied in (cp.async) while this one ends.

Fragments (PTX's m16n8k8 layouts; lane = 4 g + q): within a k-step of 8 the logical
columns q and q + 4 are the physical ones 2 q and 2 q + 1, so that each pair is one
8-byte load (the sum over k does not depend on its order). The pitches make every such
load of a warp hit distinct banks.
"""
from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from jax_kda.config import K
from jax_kda.kernels.compile import Kernel, Signature
from jax_kda.kernels.primitives import (allocate, load_if, load_vec, mma_3xtf32,
                                        split_tf32, stage_rows, store_vec, strided_rows,
                                        wide)

THREADS = 256  # two sides of 4 warps: one warp of each side per scheduler
SIDE = 128
ROWS = 32  # R: the state's value rows per CTA
# Row pitches (floats): a warp's 8-byte loads of rows g, columns 2 q hit distinct banks
# where pitch = 8 (mod 32); tail's 4-byte loads of rows 2 q, columns g where 4 (mod 16).
KEY_PITCH = K + 8  # w_k, gq and the split state: [rows, K]
TOKEN_PITCH = 72  # Bm and the split u^T: [rows, C <= 64]
ROW_PITCH = ROWS + 8  # u_v: [C, R]
TAIL_PITCH = K + 4  # tail: [C, K]
UNROLL = 4  # k-steps per loop iteration


@cute.jit
def store_pair(ptr, offset, x, y):
    """x, y to ptr + offset, + 1: one 8-byte store."""
    pair = cute.make_rmem_tensor(2, Float32)
    pair[0], pair[1] = x, y
    store_vec(ptr, offset, pair.load())


class ChunkStates(Kernel):
    """The kernel for chunks of C tokens (a multiple of 16, at most 64); `__call__`
    launches it on a stream with the inputs, then the outputs, of `signature`."""

    dims = ("B", "H", "N")

    def __init__(self, chunk: int):
        if chunk % 16 or not 16 <= chunk <= 64:
            raise ValueError(f"chunk: expected a multiple of 16 in [16, 64], got {chunk}")
        self.chunk = chunk

    def key(self):
        return (self.chunk,)

    def signature(self, B, H, N):
        """The operands for B requests, H heads and N chunks, row-major: inputs u_v, w_k,
        gq, tail [B, H, N, C, K], decay [B, H, N, K], bm [B, H, N, C, C], state
        [B, H, K, K] (FP32) and lengths [B] (int32: each request's tokens; its chunks
        from ceil(length / C) on are neither read nor written); outputs o
        [B, H, N, C, K], state_out [B, H, K, K] (FP32)."""
        tokens, state = (B, H, N, self.chunk, K), (B, H, K, K)
        inputs = [tokens] * 4 + [(B, H, N, K), (B, H, N, self.chunk, self.chunk), state]
        return Signature(tuple((shape, "float32") for shape in inputs) + (((B,), "int32"),),
                         ((tokens, "float32"), (state, "float32")))

    def buffers(self):
        """The CTA's shared buffers, in allocation order: name -> (dtype, shape); tokens
        holds w_k (side 0's) and gq (side 1's); s and ut hold the state and u^T as TF32
        words, hi [0] and lo [1]."""
        C = self.chunk
        return {"tokens": ("float32", (2, C, KEY_PITCH)),
                "tail": ("float32", (C, TAIL_PITCH)), "bm": ("float32", (C, TOKEN_PITCH)),
                "u_v": ("float32", (C, ROW_PITCH)), "decay": ("float32", (K,)),
                "s": ("uint32", (2, ROWS, KEY_PITCH)),
                "ut": ("uint32", (2, ROWS, TOKEN_PITCH))}

    @cute.jit
    def __call__(self, stream: cuda.CUstream, u_v: cute.Tensor, w_k: cute.Tensor,
                 gq: cute.Tensor, tail: cute.Tensor, decay: cute.Tensor, bm: cute.Tensor,
                 state: cute.Tensor, lengths: cute.Tensor, o: cute.Tensor,
                 state_out: cute.Tensor):
        self.kernel(u_v.iterator, w_k.iterator, gq.iterator, tail.iterator, decay.iterator,
                    bm.iterator, state.iterator, lengths.iterator, o.iterator,
                    state_out.iterator, Int32(w_k.shape[2])).launch(
            grid=(K // ROWS, state.shape[1], state.shape[0]), block=(THREADS, 1, 1),
            stream=stream)

    @cute.kernel
    def kernel(self, u_v, w_k, gq, tail, decay, bm, state, lengths, o, state_out,
               chunks: Int32):
        tid, _, _ = cute.arch.thread_idx()
        block, head, request = cute.arch.block_idx()
        side, warp, lane = tid // SIDE, tid // 32 % 4, tid % 32
        item = wide(request) * cute.arch.grid_dim()[1] + head
        first = block * ROWS  # this CTA's first value row
        smem = allocate(cutlass.memory.SmemAllocator(), self.buffers())
        rows = self.load_state(state, smem, item, first, side, warp, lane)
        operands = (u_v, w_k, gq, tail, decay, bm)
        # the chunks up to the request's last token; those after it are identities
        live = cutlass.min((cutlass.max(load_if(lengths, request, True), Int32(0))
                            + self.chunk - 1) // self.chunk, chunks)
        if live > 0:
            self.stage_products(smem, operands, item * chunks, first, tid)
            self.stage_updates(smem, operands, item * chunks, tid)
        for n in cutlass.range(live):
            cute.arch.cp_async_wait_group(1)  # this chunk's products' operands
            cute.arch.barrier()
            dots = cute.make_rmem_tensor((ROWS // 8, 4), Float32)
            if warp < self.chunk // 16:  # the warp has tokens (a chunk of C / 16 m-blocks)
                self.products(smem, dots, side, warp, lane)  # w_k S^T, gq S^T
                if side == 0:
                    self.corrections(smem, dots, warp, lane)
            cute.arch.cp_async_wait_group(0)  # and its updates'
            cute.arch.barrier()
            if n + 1 < live:  # the next chunk's products' operands, while this one ends
                self.stage_products(smem, operands, item * chunks + n + 1, first, tid)
            if (side == 1) & (warp < self.chunk // 16):
                self.output(smem, dots, o, (item * chunks + n) * self.chunk, first, warp,
                            lane)
            self.advance(smem, rows, side, warp, lane)
            cute.arch.barrier()
            if n + 1 < live:
                self.stage_updates(smem, operands, item * chunks + n + 1, tid)
        for nb, h in self.state_tiles():
            row, key = self.state_entry(nb, h, side, warp, lane)
            store_pair(state_out, (item * K + first + row) * K + key, rows[nb, h, 0],
                       rows[nb, h, 1])

    @staticmethod
    def state_tiles():
        """A warp's accumulator entries of S, two floats each: (n-block nb of 8 keys,
        half h: rows + 8 h) of its side's 16 rows."""
        return [(nb, h) for nb in range(4) for h in range(2)]

    @staticmethod
    def state_entry(nb, h, side, warp, lane):
        """(row, key) of an accumulator pair: side s holds rows 16 s .. 16 s + 15, its
        warp w keys 32 w .. 32 w + 31."""
        return 16 * side + lane // 4 + 8 * h, 8 * (4 * warp + nb) + 2 * (lane % 4)

    @cute.jit
    def load_state(self, state, smem, item, first, side, warp, lane):
        """The thread's accumulator entries of S from global memory, and the split S
        into shared memory."""
        rows = cute.make_rmem_tensor((4, 2, 2), Float32)
        for nb, h in self.state_tiles():
            row, key = self.state_entry(nb, h, side, warp, lane)
            pair = load_vec(state, (item * K + first + row) * K + key, 2)
            for e in cutlass.range_constexpr(2):
                rows[nb, h, e] = pair[e]
        self.store_split_state(smem, rows, side, warp, lane)
        cute.arch.barrier()
        return rows

    @cute.jit
    def store_split_state(self, smem, rows, side, warp, lane):
        """S's split words into smem.s (hi, lo) from the accumulators."""
        for nb, h in self.state_tiles():
            row, key = self.state_entry(nb, h, side, warp, lane)
            words = [split_tf32(rows[nb, h, e]) for e in range(2)]
            for part in cutlass.range_constexpr(2):
                for e in cutlass.range_constexpr(2):
                    smem["s"][part, row, key + e] = words[e][part]

    @cute.jit
    def stage_products(self, smem, operands, chunk, first, tid):
        """cp.async of what `products` and `corrections` read of chunk `chunk` (w_k, gq,
        this CTA's u_v columns), one commit group."""
        u_v, w_k, gq = operands[:3]
        C: cutlass.Constexpr = self.chunk
        tokens = smem["tokens"]
        at = chunk * (C * K)  # the chunk's first row of w_k, gq and u_v
        stage_rows(strided_rows(tokens.iterator, KEY_PITCH, w_k, at, K), C, 4 * K, tid,
                   THREADS)
        stage_rows(strided_rows(tokens.iterator + C * KEY_PITCH, KEY_PITCH, gq, at, K), C,
                   4 * K, tid, THREADS)
        stage_rows(strided_rows(smem["u_v"].iterator, ROW_PITCH, u_v, at + first, K), C,
                   4 * ROWS, tid, THREADS)
        cute.arch.cp_async_commit_group()

    @cute.jit
    def stage_updates(self, smem, operands, chunk, tid):
        """cp.async of what `output` and `advance` read (tail, decay, Bm), one group."""
        tail, decay, bm = operands[3:]
        C: cutlass.Constexpr = self.chunk
        stage_rows(strided_rows(smem["tail"].iterator, TAIL_PITCH, tail, chunk * (C * K), K),
                   C, 4 * K, tid, THREADS)
        stage_rows(strided_rows(smem["decay"].iterator, K, decay, chunk * K, K), 1, 4 * K,
                   tid, THREADS)
        stage_rows(strided_rows(smem["bm"].iterator, TOKEN_PITCH, bm, chunk * (C * C), C),
                   C, 4 * C, tid, THREADS)
        cute.arch.cp_async_commit_group()

    @cute.jit
    def a_split(self, buffer, pitch: cutlass.Constexpr, row0, col, lane):
        """The split A fragment (hi, lo: 4 words each) of the FP32 rows row0 + g (+ 8),
        physical columns col + 2 q (+ 1) of `buffer`."""
        g, q = lane // 4, lane % 4
        top = load_vec(buffer, (row0 + g) * pitch + col + 2 * q, 2)
        bottom = load_vec(buffer, (row0 + g + 8) * pitch + col + 2 * q, 2)
        words = [split_tf32(v) for v in (top[0], bottom[0], top[1], bottom[1])]
        return [w[0] for w in words], [w[1] for w in words]

    @cute.jit
    def b_words(self, split, pitch: cutlass.Constexpr, n0, col, lane):
        """The B fragment (hi, lo: 2 words each) of B [k, n] = split [part, n0 + n, col + k]
        from a split buffer: row n0 + g, physical columns col + 2 q (+ 1)."""
        at = (n0 + lane // 4) * pitch + col + 2 * (lane % 4)
        hi = load_vec(split.iterator, at, 2)
        lo = load_vec(split.iterator + ROWS * pitch, at, 2)
        return [hi[0], hi[1]], [lo[0], lo[1]]

    @cute.jit
    def accumulate(self, acc, tiles):
        """acc [j, 0..3] += A_j B_j for the tiles (a_hi, a_lo, b_hi, b_lo) j (split
        TF32)."""
        d = mma_3xtf32([tile + ([acc[j, e] for e in range(4)],)
                        for j, tile in enumerate(tiles)])
        for j in cutlass.range_constexpr(len(tiles)):
            for e in cutlass.range_constexpr(4):
                acc[j, e] = d[j][e]

    @cute.jit
    def products(self, smem, dots, side, warp, lane):
        """dots := the side's tokens (w_k or gq) times S^T for warp m's tile [16 tokens,
        R rows]: 4 accumulators of 4 floats, n-block j holding rows 8 j + 2 q (+ 1) of
        tokens 16 m + g (+ 8)."""
        tokens = smem["tokens"].iterator + side * (self.chunk * KEY_PITCH)
        dots.fill(0.0)
        for col in cutlass.range(0, K, 8, unroll=UNROLL):
            a = self.a_split(tokens, KEY_PITCH, 16 * warp, col, lane)
            self.accumulate(dots, [a + self.b_words(smem["s"], KEY_PITCH, 8 * j, col, lane)
                                   for j in range(ROWS // 8)])

    @cute.jit
    def corrections(self, smem, dots, warp, lane):
        """u = u_v - w_k S^T of side 0's tile, split, into ut (u^T)."""
        for j in cutlass.range_constexpr(ROWS // 8):
            for h in cutlass.range_constexpr(2):
                t = 16 * warp + lane // 4 + 8 * h
                r = 8 * j + 2 * (lane % 4)
                for e in cutlass.range_constexpr(2):
                    words = split_tf32(smem["u_v"][t, r + e] - dots[j, 2 * h + e])
                    for part in cutlass.range_constexpr(2):
                        smem["ut"][part, r + e, t] = words[part]

    @cute.jit
    def output(self, smem, inter, o, at, first, warp, lane):
        """o = gq S^T + Bm u for side 1's tile, to global memory (FP32) from token row
        `at` on."""
        for col in cutlass.range(0, self.chunk, 8, unroll=UNROLL):
            a = self.a_split(smem["bm"].iterator, TOKEN_PITCH, 16 * warp, col, lane)
            self.accumulate(inter, [a + self.b_words(smem["ut"], TOKEN_PITCH, 8 * j, col,
                                                     lane) for j in range(ROWS // 8)])
        for j in cutlass.range_constexpr(ROWS // 8):
            for h in cutlass.range_constexpr(2):
                t = 16 * warp + lane // 4 + 8 * h
                store_pair(o, (at + t) * K + first + 8 * j + 2 * (lane % 4),
                           inter[j, 2 * h], inter[j, 2 * h + 1])

    @cute.jit
    def advance(self, smem, rows, side, warp, lane):
        """S <- S diag(decay) + u^T tail for the thread's accumulators (side s: rows
        16 s .. 16 s + 15, its warp w keys 32 w .. 32 w + 31), then split into shared
        memory for the next chunk."""
        g, q = lane // 4, lane % 4
        for nb, h in self.state_tiles():
            _, key = self.state_entry(nb, h, side, warp, lane)
            decay = load_vec(smem["decay"].iterator, key, 2)
            for e in cutlass.range_constexpr(2):
                rows[nb, h, e] = rows[nb, h, e] * decay[e]
        for col in cutlass.range(0, self.chunk, 8, unroll=UNROLL):
            top_hi, top_lo = self.b_words(smem["ut"], TOKEN_PITCH, 16 * side, col, lane)
            bottom_hi, bottom_lo = self.b_words(smem["ut"], TOKEN_PITCH, 16 * side + 8, col,
                                                lane)
            a_hi = [top_hi[0], bottom_hi[0], top_hi[1], bottom_hi[1]]  # A = u^T: a_split's
            a_lo = [top_lo[0], bottom_lo[0], top_lo[1], bottom_lo[1]]  # order, pre-split
            tiles = []
            for nb in cutlass.range_constexpr(4):
                key = 8 * (4 * warp + nb) + g
                words = [split_tf32(smem["tail"][col + 2 * q + e, key]) for e in range(2)]
                tiles.append((a_hi, a_lo, [w[0] for w in words], [w[1] for w in words],
                              [rows[nb, e // 2, e % 2] for e in range(4)]))
            d = mma_3xtf32(tiles)
            for nb in cutlass.range_constexpr(4):
                for e in cutlass.range_constexpr(4):
                    rows[nb, e // 2, e % 2] = d[nb][e]
        self.store_split_state(smem, rows, side, warp, lane)
