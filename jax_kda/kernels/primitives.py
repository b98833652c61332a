"""Device helpers of the KDA kernels (CuTe DSL, sm_90a): shared buffers, memory access by
raw element offsets, cp.async and the row staging on it, bf16 and split-TF32
tensor-core mma, warp reductions, DSMEM pushes and the pointwise math at the stock
rounding points.

Global arrays are addressed as `base pointer + Int64 element offset` computed by the
caller from the static sizes (H, K, RQ), so that one compiled kernel serves any number
of requests, slots and record rows. Pointwise math uses the IEEE-rounded operations
(div.rn, sqrt.rn, the accurate exp) so that the bf16 roundings the stock layer makes
flip as rarely as possible against the JAX references.
"""
from __future__ import annotations

import functools
import operator

import cutlass
import cutlass.cute as cute
import numpy
from cutlass import BFloat16, Boolean, Float32, Int32, Int64, Uint32

RN = cute.math.RoundingMode.NEAREST_EVEN
DTYPES = {"float32": Float32, "bfloat16": BFloat16, "int32": Int32, "int64": Int64,
          "uint32": Uint32}  # CuTe DSL's type of a dtype name


def aligned(ptr, offset, align):
    """`ptr + offset` (elements) with the caller's promise of `align`-byte alignment."""
    return cute.make_ptr(ptr.dtype, (ptr + offset).toint(), ptr.memspace, assumed_align=align)


def row_major(*shape):
    """The row-major layout of `shape` (the last index fastest)."""
    return cute.make_ordered_layout(shape, order=tuple(reversed(range(len(shape)))))


def allocate(smem, buffers, byte_alignment=16):
    """Row-major shared tensors of the buffers {name: (dtype name, shape)}, in order, from
    the `cutlass.memory.SmemAllocator` smem: {name: tensor}."""
    return {name: smem.allocate_tensor(DTYPES[dtype], row_major(*shape),
                                       byte_alignment=byte_alignment)
            for name, (dtype, shape) in buffers.items()}


def load_vec(ptr, offset, width):
    """`width` consecutive elements from `ptr + offset`, one vector load (16 B aligned)."""
    view = cute.make_tensor(aligned(ptr, offset, width * ptr.dtype.width // 8),
                            cute.make_layout(width))
    return view.load()


def store_vec(ptr, offset, values):
    """`values` (a vector `load_vec` returns) to `ptr + offset`, one vector store."""
    width = values.shape[0] if isinstance(values.shape, tuple) else values.shape
    view = cute.make_tensor(aligned(ptr, offset, width * ptr.dtype.width // 8),
                            cute.make_layout(width))
    view.store(values)


def store_f32(ptr, offset, value):
    """One Float32 to `ptr + offset`."""
    cute.make_tensor(aligned(ptr, offset, 4), cute.make_layout(1))[0] = value


def load_words(ptr, offset, count):
    """2 count bf16 at `ptr + offset` (4 count bytes aligned) as `count` Uint32 (2 or 4:
    one vector load), the lower index in each word's low half."""
    word = cute.make_ptr(Uint32, (ptr + offset).toint(), ptr.memspace,
                         assumed_align=4 * count)
    words = cute.make_tensor(word, cute.make_layout(count)).load()
    return [words[i] for i in range(count)]


def load_i32s(places, speculative=False):
    """The Int32s at each (ptr, offset) of `places`, all issued before any is used:
    volatile, so that ptxas cannot sink a later one into the branch that uses it (which
    would wait for the first load before issuing it). speculative: values that may be
    stale, read cached in L2 only (an L1 line of them would outlive the read)."""
    op = "ld.global.cg" if speculative else "ld.volatile.global"
    text = "\n\t".join(f"{op}.b32 {{$w{i}}}, [{{$r{i}}}];" for i in range(len(places)))
    loaded = cute.arch.inline_ptx(
        text, write_only_types=[Int32] * len(places),
        read_only_args=[aligned(ptr, offset, 4) for ptr, offset in places])
    return list(loaded) if len(places) > 1 else [loaded]


def load_if(ptr, offset, predicate):
    """The Int32 or BFloat16 (as Float32) at `ptr + offset` if `predicate`, else 0, by one
    volatile load: issued where it stands, so that the caller can issue other reads
    before the first use waits for it (no branch for ptxas to sink it into)."""
    bits = ptr.dtype.width
    word = cute.arch.inline_ptx(
        f"{{ .reg .pred p; setp.ne.b32 p, {{$r1}}, 0; mov.b32 {{$w0}}, 0;\n\t"
        f"@p ld.volatile.global.u{bits} {{$w0}}, [{{$r0}}]; }}",
        write_only_types=[Uint32],
        read_only_args=[aligned(ptr, offset, bits // 8), Int32(predicate)])
    if ptr.dtype is BFloat16:
        return (word << 16).bitcast(Float32)
    return word.bitcast(Int32)


def cp_async_16(smem_ptr, gmem_ptr):
    """cp.async.cg of 16 bytes, global -> shared; the caller commits and waits."""
    cute.arch.inline_ptx("cp.async.cg.shared.global [{$r0}], [{$r1}], 16;",
                         read_only_args=[smem_ptr, gmem_ptr])


def strided_rows(dst, pitch, src, base, stride):
    """The copy of `stage_rows` that takes 16-byte piece j of row r from src + base +
    r stride to the shared dst + r pitch (strides in elements)."""
    per = 128 // src.dtype.width  # elements per piece
    return lambda r, j: cp_async_16(dst + (r * pitch + j * per),
                                    aligned(src, base + r * stride + j * per, 16))


@cute.jit
def stage_rows(copy: cutlass.Constexpr, rows: cutlass.Constexpr,
               row_bytes: cutlass.Constexpr, tid, threads: cutlass.Constexpr):
    """cp.async staging of `rows` rows of `row_bytes` bytes (a multiple of 16), their
    16-byte pieces dealt to the CTA's `threads` in turn: copy(r, j) issues piece j of
    row r (`strided_rows`); the caller commits the group."""
    pieces: cutlass.Constexpr = row_bytes // 16
    count: cutlass.Constexpr = rows * pieces
    for i in cutlass.range_constexpr(-(-count // threads)):
        index = tid + threads * i
        if index < count:
            copy(index // pieces, index % pieces)


def bulk_copy(smem_ptr, gmem_ptr, size, barrier_ptr):
    """cp.async.bulk of `size` bytes (16-byte multiples, aligned) global -> this CTA's
    shared memory, completing `size` tx bytes on the mbarrier at `barrier_ptr`."""
    cute.arch.inline_ptx(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes "
        "[{$r0}], [{$r1}], {$r2}, [{$r3}];",
        read_only_args=[smem_ptr, gmem_ptr, Int32(size), barrier_ptr])


def prefetch_line_l2(gmem_ptr):
    """prefetch.global.L2 of the line holding `gmem_ptr` (any alignment)."""
    cute.arch.inline_ptx("prefetch.global.L2 [{$r0}];", read_only_args=[gmem_ptr])


def store_f32x4_if(gmem_ptr, values, predicate):
    """One st.global.v4.f32 of `values` under `predicate` (no branch)."""
    cute.arch.inline_ptx("st.global.v4.f32 [{$r0}], {{$r1}, {$r2}, {$r3}, {$r4}};",
                         read_only_args=[gmem_ptr, *values], predicate=Boolean(predicate))


def bf16x2(low, high):
    """Two FP32 values rounded to bf16 (nearest even) in one Uint32, `low` in its low half
    (the lower address in memory)."""
    return cute.arch.inline_ptx("cvt.rn.bf16x2.f32 {$w0}, {$r1}, {$r0};",
                                write_only_types=[Uint32], read_only_args=[low, high])


def store_bf16x4_if(gmem_ptr, values, predicate):
    """The 4 FP32 `values` rounded to bf16 (nearest even), one st.global.v2.b32 under
    `predicate` (no branch)."""
    words = [bf16x2(values[0], values[1]), bf16x2(values[2], values[3])]
    cute.arch.inline_ptx("st.global.v2.b32 [{$r0}], {{$r1}, {$r2}};",
                         read_only_args=[gmem_ptr, *words], predicate=Boolean(predicate))


def mma(shape_types, a, b, c):
    """D = A B + C by one warp-level `mma.sync.aligned.<shape_types>` of 4 A words, 2 B
    words and 4 FP32 accumulators (m16n8k16 bf16, m16n8k8 tf32) -> 4 Float32."""
    return cute.arch.inline_ptx(
        f"mma.sync.aligned.{shape_types} {{{{$w0}}, {{$w1}}, {{$w2}}, {{$w3}}}}, "
        "{{$r0}, {$r1}, {$r2}, {$r3}}, {{$r4}, {$r5}}, {{$r6}, {$r7}, {$r8}, {$r9}};",
        write_only_types=[Float32] * 4, read_only_args=[*a, *b, *c])


def mma_bf16(a, b, c):
    """D = A B + C, m16n8k16: a 4 Uint32 (bf16x2), b 2 Uint32, c 4 Float32 -> 4 Float32."""
    return mma("m16n8k16.row.col.f32.bf16.bf16.f32", a, b, c)


def split_tf32(x):
    """(hi, lo) TF32 words of the FP32 x with hi + lo = x exactly: hi its top 19 bits, lo
    the rest as an FP32 word, whose bits past TF32's the tensor cores ignore (lo is below
    2^-10 |x|: what is lost is below 2^-20 |x|)."""
    return cute.arch.inline_ptx(
        "{ .reg .f32 h, l; and.b32 {$w0}, {$r0}, 0xffffe000; mov.b32 h, {$w0}; "
        "sub.f32 l, {$r0}, h; mov.b32 {$w1}, l; }",
        write_only_types=[Uint32, Uint32], read_only_args=[x])


def mma_tf32(a, b, c):
    """D = A B + C, m16n8k8: a 4 Uint32 (TF32), b 2 Uint32, c 4 Float32 -> 4 Float32."""
    return mma("m16n8k8.row.col.f32.tf32.tf32.f32", a, b, c)


def mma_3xtf32(tiles):
    """D = A B + C of each tile (a_hi, a_lo, b_hi, b_lo, c) in split TF32 (`split_tf32`
    words): a_lo b_hi + a_hi b_lo + a_hi b_hi, small terms first, into FP32 accumulators
    (a_lo b_lo, below 2^-20 |a b|, is left out: each product within 2^-18 |a b|); term by
    term across the tiles, so that independent mma issue back to back. Returns the D of
    each."""
    acc = [tile[4] for tile in tiles]
    for term in range(3):
        for i, (a_hi, a_lo, b_hi, b_lo, _) in enumerate(tiles):
            a, b = (a_lo, b_hi) if term == 0 else (a_hi, b_lo) if term == 1 else (a_hi, b_hi)
            acc[i] = mma_tf32(a, b, acc[i])
    return acc


def transpose_sum(values, lane, width=32):
    """Sums each of P = len(values) lane-values over aligned groups of `width` lanes (a
    power of two <= 32; P a power of two <= width or a multiple of width) by recursive
    halving, about P shuffles where butterflies take P log2(width). Returns the
    m = max(1, P / width) totals this lane holds: indices [b m, (b + 1) m) with
    b = (lane % width) min(P, width) / width."""
    offset = width // 2
    while len(values) > 1 and offset >= 1:
        half = len(values) // 2
        upper = (lane & offset) != 0
        kept = []
        for i in range(half):
            keep = Float32(cutlass.select_(upper, values[half + i], values[i]))
            send = Float32(cutlass.select_(upper, values[i], values[half + i]))
            kept.append(keep + cute.arch.shuffle_sync_bfly(send, offset=offset))
        values, offset = kept, offset // 2
    while offset >= 1:  # fewer values than lanes: the rest by butterflies
        values = [values[0] + cute.arch.shuffle_sync_bfly(values[0], offset=offset)]
        offset //= 2
    return values


def warp_totals(values, lane):
    """The sums over the warp of each of a thread's P <= 32 values by one transpose_sum
    (about P shuffles, not 5 P): (total, index, holds), where this lane holds the sum of
    values[index] if holds."""
    count = 1 << (len(values) - 1).bit_length()
    total = transpose_sum(list(values) + [Float32(0.0)] * (count - len(values)), lane)[0]
    stride = 32 // count
    index = lane // stride
    return total, index, (lane % stride == 0) & (index < len(values))


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


# IEEE division and square root compile to a fast path and a range check that calls a
# slow subroutine; ptxas does not schedule across those calls, so a thread's divisions
# ran one after another. The batches below take the fast path for every element with no
# branch, and redo the whole batch with the IEEE operations (one branch) unless every
# operand and result lies in [2^-100, 2^100] in magnitude, where the fast path is bitwise
# the IEEE result (its checks pass: nothing in the sequence can underflow or overflow).
# Each caller tests the fewest values that bound all of them, ahead of the arithmetic where
# it can, and a root and its quotient share one test: testing every operand and result
# was slower at B = 1 and T = 8 (docs/performance.md).
FAST_LOW, FAST_HIGH = 2.0**-100, 2.0**100
ROOT_FLOOR = 2.0**-20  # divided_by_roots' radicand bound: roots in [2^-10, 2^50]


def all_of(flags):
    """The conjunction of a list of Booleans."""
    return functools.reduce(operator.and_, flags)


def fast_quotient(x, y):
    """x / y by div.rn's fast path: the reciprocal refined once, one remainder step."""
    return cute.arch.inline_ptx(
        "{ .reg .f32 r, e, n, q, m;\n\tneg.f32 n, {$r1};\n\t"
        "rcp.approx.ftz.f32 r, {$r1};\n\tfma.rn.f32 e, r, n, 0f3F800000;\n\t"
        "fma.rn.f32 r, r, e, r;\n\tfma.rn.f32 q, {$r0}, r, 0f00000000;\n\t"
        "fma.rn.f32 m, q, n, {$r0};\n\tfma.rn.f32 {$w0}, r, m, q; }",
        write_only_types=[Float32], read_only_args=[Float32(x), Float32(y)])


def fast_root(x):
    """sqrt(x) by sqrt.rn's fast path: x rsqrt(x) corrected once by the residual."""
    return cute.arch.inline_ptx(
        "{ .reg .f32 r, s, h, e, n;\n\trsqrt.approx.ftz.f32 r, {$r0};\n\t"
        "mul.ftz.f32 s, {$r0}, r;\n\tmul.ftz.f32 h, r, 0f3F000000;\n\t"
        "neg.f32 n, s;\n\tfma.rn.f32 e, n, s, {$r0};\n\tfma.rn.f32 {$w0}, e, h, s; }",
        write_only_types=[Float32], read_only_args=[Float32(x)])


@cute.jit
def quotients(nums, dens, in_band):
    """[n / d] with IEEE rounding, for lists of Float32 (see the note above). in_band: a
    Boolean that holds only where every n, d and n / d lies in the fast path's band."""
    count: cutlass.Constexpr = len(nums)
    out = cute.make_rmem_tensor(count, Float32)
    for i in cutlass.range_constexpr(count):
        out[i] = fast_quotient(nums[i], dens[i])
    slow = ~in_band
    if slow:
        for i in cutlass.range_constexpr(count):
            out[i] = nums[i] / dens[i]
    return [out[i] for i in range(count)]


@cute.jit
def divided_by_roots(values, radicands, floor: cutlass.Constexpr):
    """[v / sqrt(r)] with IEEE roots and quotients, for radicands r that are at least
    `floor` (a sum of squares plus an epsilon) or NaN. Where ROOT_FLOOR <= r <= 2^100 and
    2^-50 <= |v| <= 2^40, sqrt(r) lies in [2^-10, 2^50] and |v / sqrt(r)| in
    [2^-100, 2^50]: one test and one fallback for both operations (r >= ROOT_FLOOR is
    tested only where `floor`, in FP32, does not imply it)."""
    count: cutlass.Constexpr = len(values)
    out = cute.make_rmem_tensor(count, Float32)
    in_band = Boolean(True)
    for i in cutlass.range_constexpr(count):
        out[i] = fast_quotient(values[i], fast_root(radicands[i]))
        magnitude = cute.math.abs(values[i])
        in_band = (in_band & (radicands[i] <= FAST_HIGH) & (magnitude >= 2.0**-50)
                   & (magnitude <= 2.0**40))
        if cutlass.const_expr(float(numpy.float32(floor)) < ROOT_FLOOR):
            in_band = in_band & (radicands[i] >= ROOT_FLOOR)
    slow = ~in_band
    if slow:
        for i in cutlass.range_constexpr(count):
            out[i] = values[i] / cute.math.sqrt(radicands[i])
    return [out[i] for i in range(count)]


def sigmoids(values):
    """[1 / (1 + exp(-x))], IEEE division. The denominator is at least 1 (or NaN), so where
    it is at most 2^100 the quotient lies in [2^-100, 1]."""
    dens = [Float32(1.0) + exp(-x) for x in values]
    return quotients([Float32(1.0)] * len(values), dens,
                     all_of([d <= FAST_HIGH for d in dens]))


def silus_bf16(values):
    """The convolution's SiLU [y / (1 + exp(-y))], each rounded to bf16. For y in
    [-64, 2^100] with |y| >= 2^-98 the denominator lies in [1, 2^93] and the quotient's
    magnitude in [2^-99, 2^100] (|y| / (1 + e^|y|) is least at the ends of the negative
    range): tested on y, ahead of the exponentials."""
    in_band = all_of([(y >= -64.0) & (y <= FAST_HIGH) & (cute.math.abs(y) >= 2.0**-98)
                      for y in values])
    return [round_bf16(q) for q in
            quotients(values, [Float32(1.0) + exp(-y) for y in values], in_band)]


def decays(raw_gates, a_exp, dts, lower_bound):
    """[exp(lower_bound * sigmoid(exp(a_log) * (raw_g + dt_bias)))], a_exp = exp(a_log).
    No IEEE fallback where |lower_bound| <= 2^60: a denominator d past 2^100 puts the
    sigmoid below 2^-100 and |lower_bound sigmoid| below 2^-40, whose exp is 1.0 as exp(0)
    is (the GPU tests check both on the device), so the sigmoid is taken as 0 there
    (a NaN d stays NaN); within 2^100 the fast quotient is the IEEE one. lower_bound None
    (a build-time choice): the softplus gate (`softplus_decays`)."""
    if lower_bound is None:
        return softplus_decays([g + dt for g, dt in zip(raw_gates, dts)], a_exp)
    inputs = [a_exp * (g + dt) for g, dt in zip(raw_gates, dts)]
    if abs(lower_bound) > 2.0**60:  # a build-time float
        return [exp(lower_bound * s) for s in sigmoids(inputs)]
    dens = [Float32(1.0) + exp(-x) for x in inputs]
    return [exp(lower_bound * Float32(cutlass.select_(d > FAST_HIGH, Float32(0.0),
                                                      fast_quotient(Float32(1.0), d))))
            for d in dens]


def softplus_decays(inputs, a_exp):
    """[exp(-(a_exp * softplus(x)))] with softplus(x) = max(x, 0) + log1p(exp(-|x|)),
    XLA's logaddexp(x, 0) step for step (a NaN x stays NaN, x = inf gives 0)."""
    return [exp(-(a_exp * (cutlass.select_(x > 0.0, x, Float32(0.0))
                           + cute.math.log1p(exp(-cute.math.abs(x))))))
            for x in inputs]


def wide(i):
    """An Int64 copy of an index (offsets into the cache can pass 2**31 elements)."""
    return Int64(i)
