"""Device helpers of the KDA kernels (CuTe DSL, sm_90a): memory access by raw element
offsets, cp.async, bf16 tensor-core mma, warp reductions, DSMEM pushes and the
pointwise math at the stock rounding points.

Global arrays are addressed as `base pointer + Int64 element offset` computed by the
caller from the static sizes (H, K, RQ), so that one compiled kernel serves any number
of requests, slots and record rows. Pointwise math uses the IEEE-rounded operations
(div.rn, sqrt.rn, the accurate exp) so that the bf16 roundings the stock layer makes
flip as rarely as possible against the JAX references.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Boolean, Float32, Int32, Int64, Uint32

RN = cute.math.RoundingMode.NEAREST_EVEN


def aligned(ptr, offset, align):
    """`ptr + offset` (elements) with the caller's promise of `align`-byte alignment."""
    return cute.make_ptr(ptr.dtype, (ptr + offset).toint(), ptr.memspace, assumed_align=align)


def load_vec(ptr, offset, width):
    """`width` consecutive elements from `ptr + offset`, one vector load (16 B aligned)."""
    view = cute.make_tensor(aligned(ptr, offset, width * ptr.dtype.width // 8),
                            cute.make_layout(width))
    return view.load()


def load_words(ptr, offset):
    """Four bf16 at `ptr + offset` (8 B aligned) as two Uint32, lower index in the low half."""
    word = cute.make_ptr(Uint32, (ptr + offset).toint(), ptr.memspace, assumed_align=8)
    pair = cute.make_tensor(word, cute.make_layout(2)).load()
    return pair[0], pair[1]


def load_i32_pair(ptr_a, offset_a, ptr_b, offset_b):
    """The Int32s at `ptr_a + offset_a` and `ptr_b + offset_b`, both issued before either
    is used: volatile, so that ptxas cannot sink the second into the branch that uses it
    (which would wait for the first load before issuing it)."""
    return cute.arch.inline_ptx(
        "ld.volatile.global.b32 {$w0}, [{$r0}];\n\tld.volatile.global.b32 {$w1}, [{$r1}];",
        write_only_types=[Int32, Int32],
        read_only_args=[aligned(ptr_a, offset_a, 4), aligned(ptr_b, offset_b, 4)])


def cp_async_16(smem_ptr, gmem_ptr):
    """cp.async.cg of 16 bytes, global -> shared; the caller commits and waits."""
    cute.arch.inline_ptx("cp.async.cg.shared.global [{$r0}], [{$r1}], 16;",
                         read_only_args=[smem_ptr, gmem_ptr])


def store_f32x4_if(gmem_ptr, values, predicate):
    """One st.global.v4.f32 of `values` under `predicate` (no branch)."""
    cute.arch.inline_ptx("st.global.v4.f32 [{$r0}], {{$r1}, {$r2}, {$r3}, {$r4}};",
                         read_only_args=[gmem_ptr, *values], predicate=Boolean(predicate))


def mma_bf16(a, b, c):
    """D = A B + C, m16n8k16: a 4 Uint32 (bf16x2), b 2 Uint32, c 4 Float32 -> 4 Float32."""
    return cute.arch.inline_ptx(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {{$w0}, {$w1}, {$w2}, {$w3}}, "
        "{{$r0}, {$r1}, {$r2}, {$r3}}, {{$r4}, {$r5}}, {{$r6}, {$r7}, {$r8}, {$r9}};",
        write_only_types=[Float32] * 4, read_only_args=[*a, *b, *c])


@cute.jit
def butterfly_sum(value: Float32, width: cutlass.Constexpr) -> Float32:
    """Sum over aligned groups of `width` lanes (a power of two <= 32), offsets 1, 2, ..."""
    for i in cutlass.range_constexpr((width - 1).bit_length()):
        value = value + cute.arch.shuffle_sync_bfly(value, offset=1 << i)
    return value


def transpose_sum(values, lane):
    """Sums each of P = len(values) (a power of two <= 32) lane-values over the warp in
    P - 1 + log2(32 / P) shuffles (recursive halving instead of P butterflies): returns
    the total of value index lane >> log2(32 / P), held by every lane."""
    offset = 16
    while len(values) > 1:
        half = len(values) // 2
        upper = (lane & offset) != 0
        kept = []
        for i in range(half):
            keep = Float32(cutlass.select_(upper, values[half + i], values[i]))
            send = Float32(cutlass.select_(upper, values[i], values[half + i]))
            kept.append(keep + cute.arch.shuffle_sync_bfly(send, offset=offset))
        values, offset = kept, offset // 2
    total = values[0]
    while offset >= 1:
        total = total + cute.arch.shuffle_sync_bfly(total, offset=offset)
        offset //= 2
    return total


def tree_sum(values):
    """A fixed pairwise tree over a list (length a power of two)."""
    while len(values) > 1:
        values = [values[i] + values[i + 1] for i in range(0, len(values), 2)]
    return values[0]


def push_f32(dst_smem_ptr, value, barrier_ptr, peer):
    """st.async one f32 into `dst_smem_ptr`'s twin in CTA `peer` of the cluster (4 tx bytes
    on `barrier_ptr`'s twin there); the DSMEM store takes i32, hence the bitcast."""
    cute.arch.store_async_dsmem(dst_smem_ptr, value.bitcast(Int32), barrier_ptr, peer)


def round_bf16(x):
    """x rounded to bf16 (nearest even), kept as Float32."""
    return Float32(BFloat16(x))


def exp(x):
    """e^x, the DSL's accurate expansion (not a bare ex2.approx)."""
    return cute.math.exp(x)


def sigmoid(x):
    """1 / (1 + exp(-x)) with an IEEE division."""
    return Float32(1.0) / (Float32(1.0) + exp(-x))


def silu_bf16(y):
    """The convolution's SiLU y / (1 + exp(-y)), rounded to bf16."""
    return round_bf16(y / (Float32(1.0) + exp(-y)))


def inv_sqrt(x):
    """1 / sqrt(x), both IEEE-rounded."""
    return Float32(1.0) / cute.math.sqrt(x)


def decay(raw_g, a_exp, dt, lower_bound):
    """exp(lower_bound * sigmoid(exp(a_log) * (raw_g + dt_bias))), a_exp = exp(a_log)."""
    return exp(lower_bound * sigmoid(a_exp * (raw_g + dt)))


def wide(i):
    """An Int64 copy of an index (offsets into the cache can pass 2**31 elements)."""
    return Int64(i)
