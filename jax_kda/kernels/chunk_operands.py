"""The prompt's chunk operands (CuTe DSL, sm_90a): what
`jax_kda.prompt_chunks.chunk_operands` computes in XLA, one CTA per (chunk, head,
request), from the convolution's outputs and the raw gates as the layer leaves them
(token-major, bf16), with the chunk's tiles on chip.

Per chunk of C = 64 tokens (sub-chunks of 16 with middle token m = 7): the norms of q
and k, the decays d and betas, then per key channel products of decays only:
R_t = prod_{m<r<=t} d_r (t > m) or 1 / prod_{t<r<=m} d_r (t < m), its reciprocal
Rinv, so that a pair of one sub-chunk decays by P(s, t) = R_t Rinv_s, and a pair of
sub-chunks i > j by R_t f_ij Rinv_s with f_ij = L_m,i (prod of the sub-chunks between)
E_m,j (L_m,i = prod_{start_i<=r<=m_i} d_r, E_m,j = prod_{m_j<r<end_j} d_r): every
factor within 2^+-60 where `prompt_chunks.subchunk` allows sub-chunks of 16 (lower_bound
>= -5.2).

    A = tril_<((k R) (k Rinv)^T . f),  Bm = tril_<=((q R) (k Rinv)^T . f)
    (I + diag(beta) A) [u_v | w_k] = diag(beta) [v | Gamma k]   (forward substitution)
    gq = Gamma q,  tail = k prod_{r>t} d_r,  decay = Gamma_C

Threads: 288 (9 warps). Norms: a warp per 8 tokens. Vectors: a thread per (channel,
half of the chunk). Pairs: a thread per 4 x 4 tile of A or Bm on or below the diagonal
(2 x 136). Solve: a thread per column of [v | Gamma k] (256).
"""
from __future__ import annotations

import functools

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from jax_kda.config import K, NORM_EPS
from jax_kda.prompt_chunks import CHUNK, SUBCHUNK as SUB, subchunk
from jax_kda.kernels.compile import Kernel, Signature
from jax_kda.kernels.primitives import (FAST_HIGH, FAST_LOW, aligned, all_of, allocate,
                                        cp_async_16, decays, exp, load_if, load_vec,
                                        quotients, sigmoids, stage_rows, store_f32, store_vec,
                                        warp_totals, wide)

MID = SUB // 2 - 1  # a sub-chunk's reference token
SUBS = CHUNK // SUB
TILES = CHUNK // 4  # 4 x 4 tiles along each side of A and Bm
LOWER = TILES * (TILES + 1) // 2  # tiles of A (or Bm) on or below the diagonal: 136
THREADS = 288  # 2 LOWER tiles, one a thread; 256 threads in the other phases
COLUMNS = 2 * K  # the solve's right-hand sides: v and Gamma k
PAD = 4  # floats after each row of a transposed operand: 16-byte stores of 8 lanes at
# rows 17 units apart hit distinct banks
PAIRS = SUBS * (SUBS - 1) // 2  # sub-chunk pairs i > j; factor row PAIRS is all ones
STAGED = ("q", "k", "v", "g")  # the staged bf16 rows: q, k, v after the conv, raw gates


class ChunkOperands(Kernel):
    """The kernel at a config's lower_bound (one whose sub-chunks are of SUB tokens:
    `prompt_chunks.subchunk`) and query scale; `__call__` launches it on a stream with
    the inputs, then the outputs, of `signature`."""

    dims = ("B", "P", "H", "N")

    def __init__(self, lower_bound: float, scale: float):
        if subchunk(lower_bound) != SUB:
            raise ValueError(f"lower_bound: {lower_bound} needs sub-chunks of "
                             f"{subchunk(lower_bound)} tokens; the kernel's are {SUB}")
        self.lower_bound, self.scale = float(lower_bound), float(scale)

    def key(self):
        return (self.lower_bound, self.scale)

    @staticmethod
    def signature(B, P, H, N):
        """Inputs y [B, P, 3, H, K] bf16 (q, k, v after the convolution), raw_g
        [B, P, H, K] bf16, beta [B, P, H] bf16 logits, lengths [B] int32, a_log [H] f32,
        dt_bias [H, K] f32; outputs u_v, w_k, gq, tail [B, H, N, C, K], decay
        [B, H, N, K], bm [B, H, N, C, C], all f32 (`ChunkStates.signature`'s inputs), for
        N = ceil(P / C) chunks; a chunk wholly past its request's length is not
        written."""
        tokens = (B, H, N, CHUNK, K)
        return Signature(
            (((B, P, 3, H, K), "bfloat16"), ((B, P, H, K), "bfloat16"),
             ((B, P, H), "bfloat16"), ((B,), "int32"), ((H,), "float32"),
             ((H, K), "float32")),
            ((tokens, "float32"),) * 4 + (((B, H, N, K), "float32"),
                                          ((B, H, N, CHUNK, CHUNK), "float32")))

    @staticmethod
    def buffers():
        """The CTA's shared buffers, in allocation order: name -> (dtype, shape).
        staged: the chunk's rows as read; x: k R and q R, y: k Rinv, transposed
        (channel, token); rhs_w: beta Gamma k; n: diag(beta) A; factors: f_ij per
        channel (row PAIRS ones); stats: per sub-chunk and channel its total product,
        L_m and E_m."""
        return {"staged": ("bfloat16", (len(STAGED), CHUNK, K)),
                "x": ("float32", (2, K, CHUNK + PAD)), "y": ("float32", (K, CHUNK + PAD)),
                "rhs_w": ("float32", (CHUNK, K)), "n": ("float32", (CHUNK, CHUNK)),
                "factors": ("float32", (PAIRS + 1, K)), "stats": ("float32", (3, SUBS, K)),
                "roots": ("float32", (2, CHUNK)), "betas": ("float32", (CHUNK,))}

    @cute.jit
    def __call__(self, stream: cuda.CUstream, y: cute.Tensor, raw_g: cute.Tensor,
                 beta: cute.Tensor, lengths: cute.Tensor, a_log: cute.Tensor,
                 dt_bias: cute.Tensor, u_v: cute.Tensor, w_k: cute.Tensor, gq: cute.Tensor,
                 tail: cute.Tensor, decay: cute.Tensor, bm: cute.Tensor):
        self.kernel(y.iterator, raw_g.iterator, beta.iterator, lengths.iterator,
                    a_log.iterator, dt_bias.iterator, u_v.iterator, w_k.iterator,
                    gq.iterator, tail.iterator, decay.iterator, bm.iterator,
                    Int32(y.shape[1])).launch(
            grid=(u_v.shape[2], u_v.shape[1], u_v.shape[0]), block=(THREADS, 1, 1),
            stream=stream)

    @cute.kernel
    def kernel(self, y, raw_g, beta, lengths, a_log, dt_bias, u_v, w_k, gq, tail, decay, bm,
               prompt: Int32):
        tid, _, _ = cute.arch.thread_idx()
        chunk, head, request = cute.arch.block_idx()
        heads = cute.arch.grid_dim()[1]
        item = (wide(request) * heads + head) * cute.arch.grid_dim()[0] + chunk
        smem = allocate(cutlass.memory.SmemAllocator(), self.buffers())
        first = chunk * CHUNK
        length = cutlass.max(cutlass.min(load_if(lengths, request, True), prompt), Int32(0))
        live = length - first  # tokens t < live are the prompt's, the rest identities
        if live > 0:  # a chunk wholly past the prompt is left unwritten: no scan reads it
            self.stage(smem, y, raw_g, request, head, heads, first, prompt, tid)
            self.zero_upper_tiles(bm, item, tid)
            cute.arch.cp_async_wait_group(0)
            cute.arch.barrier()
            self.norms_and_betas(smem, beta, request, head, heads, first, prompt, live, tid)
            decayed = self.decays(smem, a_log, dt_bias, head, live, tid)
            cute.arch.barrier()
            self.vectors(smem, decayed, gq, tail, decay, item, live, tid)
            cute.arch.barrier()
            self.pairs(smem, bm, item, tid)
            cute.arch.barrier()
            self.solve(smem, u_v, w_k, item, live, tid)

    @cute.jit
    def stage(self, smem, y, raw_g, request, head, heads, first, prompt, tid):
        """cp.async of the chunk's rows of q, k, v and the raw gates (tokens past the
        prompt read its last one: masked later), one commit group."""
        for a in cutlass.range_constexpr(len(STAGED)):
            stage_rows(functools.partial(self.copy_piece, smem["staged"].iterator, y, raw_g, a,
                                         request, head, heads, first, prompt),
                       CHUNK, 2 * K, tid, THREADS)
        cute.arch.cp_async_commit_group()

    @cute.jit
    def copy_piece(self, staged, y, raw_g, a: cutlass.Constexpr, request, head, heads, first,
                   prompt, t, j):
        """cp.async of 16-byte piece j of token t's row of staged part a (q, k, v of y
        [B, P, 3, H, K], or raw_g [B, P, H, K])."""
        token = wide(request) * prompt + cutlass.min(first + t, prompt - 1)
        if cutlass.const_expr(a < 3):
            src = aligned(y, ((token * 3 + a) * heads + head) * K + 8 * j, 16)
        else:
            src = aligned(raw_g, (token * heads + head) * K + 8 * j, 16)
        cp_async_16(staged + (a * CHUNK + t) * K + 8 * j, src)

    @cute.jit
    def zero_upper_tiles(self, bm, item, tid):
        """Zeros into Bm's 4 x 4 tiles above the diagonal (120, a thread each): row p
        with row 14 - p, then row 7."""
        if tid < TILES * (TILES - 1) // 2:
            p, k = tid // TILES, tid % TILES
            first_row = k < TILES - 1 - p
            row = cutlass.select_(first_row, p, TILES - 2 - p)
            col = cutlass.select_(first_row, p + 1 + k, k)
            zeros = cute.make_rmem_tensor(4, Float32)
            for e in cutlass.range_constexpr(4):
                zeros[e] = Float32(0.0)
            for a in cutlass.range_constexpr(4):
                store_vec(bm, (item * CHUNK + 4 * row + a) * CHUNK + 4 * col, zeros.load())

    @cute.jit
    def norms_and_betas(self, smem, beta, request, head, heads, first, prompt, live, tid):
        """Warps 0-7: sqrt(sum x^2 + 1e-6) of q and k for their 8 tokens each (a lane
        per 4 channels; tokens t >= live are zero). Warp 8: the betas (0 past live)."""
        lane, warp = tid % 32, tid // 32
        staged = smem["staged"]
        if warp < 8:
            squares = []
            for t8 in cutlass.range_constexpr(8):
                t = 8 * warp + t8
                for part in cutlass.range_constexpr(2):
                    total = Float32(0.0)
                    for e in cutlass.range_constexpr(4):
                        x = cutlass.select_(t < live, Float32(staged[part, t, 4 * lane + e]),
                                            Float32(0.0))
                        total = total + x * x
                    squares.append(total)
            total, index, holds = warp_totals(squares, lane)
            if holds:
                smem["roots"][index % 2, 8 * warp + index // 2] = cute.math.sqrt(
                    total + NORM_EPS)
        else:
            for half in cutlass.range_constexpr(2):
                t = lane + 32 * half
                token = wide(request) * prompt + cutlass.min(first + t, prompt - 1)
                logit = load_if(beta, token * heads + head, t < live)
                smem["betas"][t] = cutlass.select_(t < live, sigmoids([logit])[0],
                                                   Float32(0.0))

    @cute.jit
    def decays(self, smem, a_log, dt_bias, head, live, tid):
        """Threads 0-255, channel tid % 128, tokens 32 (tid / 128) + [0, 32): the decays
        (1 past live) in registers, and per sub-chunk the stats (total, L_m, E_m)."""
        decayed = cute.make_rmem_tensor(2 * SUB, Float32)
        if tid < 2 * K:
            channel, half = tid % K, tid // K
            a_exp = exp(load_vec(a_log, head, 1)[0])
            dt = load_vec(dt_bias, head * K + channel, 1)[0]
            for s in cutlass.range_constexpr(2):
                base = (2 * half + s) * SUB
                gates = [Float32(smem["staged"][3, base + r, channel]) for r in range(SUB)]
                values = decays(gates, a_exp, [dt] * SUB, self.lower_bound)
                for r in cutlass.range_constexpr(SUB):
                    decayed[s * SUB + r] = cutlass.select_(base + r < live, values[r],
                                                           Float32(1.0))
                # L_m and E_m; the total as L_m E_m
                low = decayed[s * SUB]
                for r in cutlass.range_constexpr(1, MID + 1):
                    low = low * decayed[s * SUB + r]
                high = decayed[s * SUB + SUB - 1]
                for r in cutlass.range_constexpr(SUB - 2, MID, -1):
                    high = high * decayed[s * SUB + r]
                i = 2 * half + s
                smem["stats"][0, i, channel] = low * high
                smem["stats"][1, i, channel] = low
                smem["stats"][2, i, channel] = high
        return decayed

    @cute.jit
    def vectors(self, smem, decayed, gq, tail, decay, item, live, tid):
        """Threads 0-255 (as `decays`): q and k normalized, R and Rinv, k R, q R, k Rinv
        (transposed, shared), Gamma q and the tails (global), beta Gamma k (shared);
        threads 0-127 also the pair factors and the chunk's decay."""
        if tid < 2 * K:
            channel, half = tid % K, tid // K
            stats = smem["stats"]
            totals = [stats[0, i, channel] for i in range(SUBS)]
            if half == 0:
                self.factors(smem, totals, channel)
                store_f32(decay, item * K + channel,
                          ((totals[0] * totals[1]) * totals[2]) * totals[3])
            for s in cutlass.range_constexpr(2):
                self.sub_chunk(smem, decayed, s, half, channel, totals, gq, tail, item, live)

    @cute.jit
    def factors(self, smem, totals, channel):
        """f_ij = (L_m,i prod_{j<q<i} T_q) E_m,j for this channel, row i (i - 1) / 2 + j,
        and the ones row."""
        stats = smem["stats"]
        for i in cutlass.range_constexpr(1, SUBS):
            for j in cutlass.range_constexpr(i):
                f = stats[1, i, channel]
                for q in cutlass.range_constexpr(i - 1, j, -1):
                    f = f * totals[q]
                smem["factors"][i * (i - 1) // 2 + j, channel] = f * stats[2, j, channel]
        smem["factors"][PAIRS, channel] = Float32(1.0)

    @cute.jit
    def sub_chunk(self, smem, decayed, s, half, channel, totals, gq, tail, item, live):
        """One sub-chunk of this thread's channel: everything `vectors` lists."""
        base = (2 * half + s) * SUB
        # prod_{j<i} T_j and prod_{j>i} T_j of sub-chunk i = 2 half + s
        before = cutlass.select_(half == 0, Float32(1.0) if s == 0 else totals[0],
                                 (totals[0] * totals[1]) if s == 0
                                 else (totals[0] * totals[1]) * totals[2])
        after = cutlass.select_(half == 0,
                                ((totals[3] * totals[2]) * totals[1]) if s == 0
                                else totals[3] * totals[2],
                                totals[3] if s == 0 else Float32(1.0))
        d = [decayed[s * SUB + r] for r in range(SUB)]
        staged = smem["staged"]
        roots = smem["roots"]
        qs = [cutlass.select_(base + r < live, Float32(staged[0, base + r, channel]),
                              Float32(0.0)) for r in range(SUB)]
        ks = [cutlass.select_(base + r < live, Float32(staged[1, base + r, channel]),
                              Float32(0.0)) for r in range(SUB)]
        q_roots = [roots[0, base + r] for r in range(SUB)]
        k_roots = [roots[1, base + r] for r in range(SUB)]
        qn = [x * self.scale for x in
              quotients(qs, q_roots, self.normal_band(qs, q_roots))]
        kn = quotients(ks, k_roots, self.normal_band(ks, k_roots))
        # R (t > m: products forward from m) and Rinv (t < m: backward), reciprocals
        up = [Float32(1.0)] * SUB
        for r in cutlass.range_constexpr(MID + 1, SUB):
            up[r] = d[r] if r == MID + 1 else up[r - 1] * d[r]
        for r in cutlass.range_constexpr(MID - 1, -1, -1):
            up[r] = d[r + 1] if r == MID - 1 else up[r + 1] * d[r + 1]
        others = [up[r] for r in range(SUB) if r != MID]
        flipped = quotients([Float32(1.0)] * (SUB - 1), others,
                            all_of([(x >= FAST_LOW) & (x <= FAST_HIGH) for x in others]))
        flipped.insert(MID, Float32(1.0))
        R = [up[r] if r > MID else flipped[r] for r in range(SUB)]
        Rinv = [flipped[r] if r > MID else up[r] for r in range(SUB)]
        # L (inclusive prefix) and E (exclusive suffix) within the sub-chunk
        L = [d[0]] * SUB
        for r in cutlass.range_constexpr(1, SUB):
            L[r] = L[r - 1] * d[r]
        E = [Float32(1.0)] * SUB
        for r in cutlass.range_constexpr(SUB - 2, -1, -1):
            E[r] = E[r + 1] * d[r + 1]
        betas = smem["betas"]
        for r4 in cutlass.range_constexpr(0, SUB, 4):
            row = channel * (CHUNK + PAD) + base + r4
            x, y, span = smem["x"].iterator + row, smem["y"].iterator + row, range(r4, r4 + 4)
            for at, values in ((x, [kn[r] * R[r] for r in span]),
                               (x + K * (CHUNK + PAD), [qn[r] * R[r] for r in span]),
                               (y, [kn[r] * Rinv[r] for r in span])):
                vec = cute.make_rmem_tensor(4, Float32)
                for e in cutlass.range_constexpr(4):
                    vec[e] = values[e]
                store_vec(at, 0, vec.load())
        for r in cutlass.range_constexpr(SUB):
            t = base + r
            gamma = before * L[r]
            at = (item * CHUNK + t) * K + channel
            store_f32(gq, at, gamma * qn[r])
            store_f32(tail, at, kn[r] * (E[r] * after))
            smem["rhs_w"][t, channel] = betas[t] * (gamma * kn[r])

    @staticmethod
    def normal_band(values, roots):
        """Where every quotient value / root is the fast path's IEEE one: roots within
        [2^-10, 2^50] (>= sqrt(1e-6) always) and values 0 or within [2^-50, 2^40]."""
        flags = []
        for x, root in zip(values, roots):
            magnitude = cute.math.abs(x)
            flags.append((root <= 2.0**50) & ((magnitude == 0.0) | (
                (magnitude >= 2.0**-50) & (magnitude <= 2.0**40))))
        return all_of(flags)

    @cute.jit
    def pairs(self, smem, bm, item, tid):
        """A (into n, times beta_t) and Bm (global), a 4 x 4 tile a thread: tile rows p
        and 15 - p of one matrix share 17 threads."""
        if tid < 2 * LOWER:
            matrix, r = tid // LOWER, tid % LOWER
            p, k = r // (TILES + 1), r % (TILES + 1)
            first_row = k <= p
            row = cutlass.select_(first_row, p, TILES - 1 - p)
            col = cutlass.select_(first_row, k, k - p - 1)
            i, j = row // (SUB // 4), col // (SUB // 4)
            pair = cutlass.select_(i == j, Int32(PAIRS), i * (i - 1) // 2 + j)
            acc = self.tile_products(smem, matrix, pair, row, col)
            t0, s0 = 4 * row, 4 * col
            if matrix == 0:
                for a in cutlass.range_constexpr(4):
                    vec = cute.make_rmem_tensor(4, Float32)
                    beta_t = smem["betas"][t0 + a]
                    for b in cutlass.range_constexpr(4):
                        vec[b] = cutlass.select_(s0 + b < t0 + a, beta_t * acc[a * 4 + b],
                                                 Float32(0.0))
                    store_vec(smem["n"].iterator, (t0 + a) * CHUNK + s0, vec.load())
            else:
                for a in cutlass.range_constexpr(4):
                    vec = cute.make_rmem_tensor(4, Float32)
                    for b in cutlass.range_constexpr(4):
                        vec[b] = cutlass.select_(s0 + b <= t0 + a, acc[a * 4 + b],
                                                 Float32(0.0))
                    store_vec(bm, (item * CHUNK + t0 + a) * CHUNK + s0, vec.load())

    @cute.jit
    def tile_products(self, smem, matrix, pair, row, col):
        """sum_c x[matrix, c, 4 row + a] (y[c, 4 col + b] f[pair, c]) for a, b < 4."""
        acc = cute.make_rmem_tensor(16, Float32)
        for e in cutlass.range_constexpr(16):
            acc[e] = Float32(0.0)
        stride: cutlass.Constexpr = CHUNK + PAD
        lhs = smem["x"].iterator + matrix * (K * stride)
        rhs = smem["y"].iterator
        factors = smem["factors"].iterator
        for c in cutlass.range(0, K, 4, unroll=2):
            f = load_vec(factors, pair * K + c, 4)
            for q in cutlass.range_constexpr(4):
                xs = load_vec(lhs, (c + q) * stride + 4 * row, 4)
                ys = load_vec(rhs, (c + q) * stride + 4 * col, 4)
                scaled = [ys[b] * f[q] for b in range(4)]
                for a in cutlass.range_constexpr(4):
                    for b in cutlass.range_constexpr(4):
                        acc[a * 4 + b] = acc[a * 4 + b] + xs[a] * scaled[b]
        return acc

    @cute.jit
    def solve(self, smem, u_v, w_k, item, live, tid):
        """(I + N) x = rhs by forward substitution, a column a thread: columns
        0-127 beta v (u_v), 128-255 beta Gamma k (w_k)."""
        if tid < COLUMNS:
            column = tid % K
            x = cute.make_rmem_tensor(CHUNK, Float32)
            if tid < K:
                for t in cutlass.range(CHUNK, unroll_full=True):
                    v = cutlass.select_(t < live, Float32(smem["staged"][2, t, column]),
                                        Float32(0.0))
                    x[t] = smem["betas"][t] * v
            else:
                for t in cutlass.range(CHUNK, unroll_full=True):
                    x[t] = smem["rhs_w"][t, column]
            n = smem["n"].iterator
            for t in cutlass.range(1, CHUNK, unroll_full=True):
                partial = cute.make_rmem_tensor(4, Float32)  # four chains: 1/4 the depth
                for e in cutlass.range_constexpr(4):
                    partial[e] = Float32(0.0)
                for s4 in cutlass.range(0, t, 4, unroll_full=True):
                    row = load_vec(n, t * CHUNK + s4, 4)
                    for e in cutlass.range_constexpr(4):
                        # -0.0: the identity of +, which the compiler drops (0.0 is not)
                        partial[e] = partial[e] + cutlass.select_(
                            s4 + e < t, row[e] * x[s4 + e], Float32(-0.0))
                x[t] = x[t] - ((partial[0] + partial[1]) + (partial[2] + partial[3]))
            if tid < K:
                for t in cutlass.range(CHUNK, unroll_full=True):
                    store_f32(u_v, (item * CHUNK + t) * K + column, x[t])
            else:
                for t in cutlass.range(CHUNK, unroll_full=True):
                    store_f32(w_k, (item * CHUNK + t) * K + column, x[t])
