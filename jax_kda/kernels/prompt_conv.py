"""The prompt's short convolution and SiLU (CuTe DSL, sm_90a): what
`jax_kda.layer.convolve` computes for a prefill's q, k and v, as one streaming pass.

Each thread owns WIDTH channels of the 3 H K (an 8-byte piece of a token row) over RUN
consecutive tokens: it loads the three inputs before its first token (the history
for the prompt's first run, else the tokens before it), then each token's row once,
keeping the last three in registers. y_t = bias + w_0 s_t + w_1 s_{t+1} + w_2 s_{t+2}
+ w_3 s_{t+3} over s = [history, x], each product and sum rounded in FP32 in that
order (the stock loop's), then SiLU (IEEE division) rounded to bf16.
"""
from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32

from jax_kda.config import CONV_TAPS, K
from jax_kda.kernels.compile import Kernel, Signature
from jax_kda.kernels.primitives import RN, load_vec, silus_bf16, store_vec, wide

THREADS = 128
WIDTH = 4  # channels a thread: 80 registers, six CTAs an SM (docs/performance.md)
BATCH = 8  # tokens loaded together (their loads in flight at once)
RUN = 32  # tokens a thread: the history's reload is 3 / RUN of the reads
HISTORY = CONV_TAPS - 1


class PromptConvolution(Kernel):
    """The kernel (no compile-time values: it serves every prompt, batch and head
    count); `__call__` launches it on a stream with the operands of `signature`."""

    dims = ("B", "P", "H")

    def key(self):
        return ()

    @staticmethod
    def signature(B, P, H):
        """Inputs x [B, P, 3, H, K] bf16 (the raw q, k, v), history [B, 3, 3, H, K] bf16
        (the three inputs before x_0, position-major as x), weight [4, 3, H, K] f32 (tap
        first), bias [3, H, K] f32; output y [B, P, 3, H, K] bf16."""
        return Signature((((B, P, 3, H, K), "bfloat16"), ((B, HISTORY, 3, H, K), "bfloat16"),
                          ((CONV_TAPS, 3, H, K), "float32"), ((3, H, K), "float32")),
                         (((B, P, 3, H, K), "bfloat16"),))

    @cute.jit
    def __call__(self, stream: cuda.CUstream, x: cute.Tensor, history: cute.Tensor,
                 weight: cute.Tensor, bias: cute.Tensor, y: cute.Tensor):
        B, P, heads = x.shape[0], x.shape[1], x.shape[3]
        vectors = 3 * heads * (K // WIDTH)  # row pieces of a token
        self.kernel(x.iterator, history.iterator, weight.iterator, bias.iterator, y.iterator,
                    Int32(P), Int32(vectors)).launch(
            grid=((vectors + THREADS - 1) // THREADS, (P + RUN - 1) // RUN, B),
            block=(THREADS, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, x, history, weight, bias, y, prompt: Int32, vectors: Int32):
        tid, _, _ = cute.arch.thread_idx()
        block, run, request = cute.arch.block_idx()
        piece = block * THREADS + tid
        if piece < vectors:
            row = vectors * WIDTH  # elements of a token row: 3 H K
            channel = piece * WIDTH
            taps = [self.channels(weight, i * row + channel) for i in range(CONV_TAPS)]
            shift = self.channels(bias, channel)
            first = run * RUN
            window = self.window(x, history, request, first, prompt, row, channel)
            for batch in cutlass.range_constexpr(RUN // BATCH):
                start = first + batch * BATCH
                # tokens past the prompt read its last one and are not stored
                rows = [load_vec(x, (wide(request) * prompt
                                     + cutlass.min(start + j, prompt - 1)) * row + channel,
                                 WIDTH) for j in range(BATCH)]
                for j in cutlass.range_constexpr(BATCH):
                    window.append([Float32(rows[j][e]) for e in range(WIDTH)])
                    total = [shift[e] for e in range(WIDTH)]
                    for i in cutlass.range_constexpr(CONV_TAPS):
                        for e in cutlass.range_constexpr(WIDTH):
                            total[e] = cute.math.add(
                                total[e], cute.math.mul(taps[i][e], window[i][e], rounding=RN),
                                rounding=RN)
                    window.pop(0)
                    out = cute.make_rmem_tensor(WIDTH, BFloat16)
                    for e, value in enumerate(silus_bf16(total)):
                        out[e] = BFloat16(value)
                    if start + j < prompt:
                        store_vec(y, (wide(request) * prompt + start + j) * row + channel,
                                  out.load())

    @cute.jit
    def channels(self, tensor, offset):
        """WIDTH f32 at `offset`, as a list."""
        quads = [load_vec(tensor, offset + i, 4) for i in range(0, WIDTH, 4)]
        return [quad[e] for quad in quads for e in range(4)]

    @cute.jit
    def window(self, x, history, request, first, prompt, row, channel):
        """The three inputs before token `first` at this thread's channels: the history
        at the prompt's start, else x's tokens first - 3 .. first - 1."""
        window = []
        for i in cutlass.range_constexpr(HISTORY):
            before = cutlass.max(first - HISTORY + i, Int32(0))
            inside = load_vec(x, (wide(request) * prompt + before) * row + channel, WIDTH)
            held = load_vec(history, (wide(request) * HISTORY + i) * row + channel, WIDTH)
            window.append([cutlass.select_(first > 0, Float32(inside[e]), Float32(held[e]))
                           for e in range(WIDTH)])
        return window
