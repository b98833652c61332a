"""The ceiling of the fused verify's layout: a kernel that only moves the state, with the
verify's grid, block and residency, timed as the verify is (`timeline.Point`'s graph)
next to the verify itself. Per CTA: griddepcontrol.wait, the slot (one round trip), the
CTA's state rows by one bulk copy into shared memory, and the same rows written back
from there (every request has pending tokens: the verify writes its rows too). No other
operand is read: the verify's other bytes (window, records, inputs, output, weights;
about 13% of its total at T = 4) are left out, and the percentages are of the state's
bytes alone. The copy bandwidth is the benchmark's (`measure.copy_bandwidth`).
`resident` CTAs per SM are forced by padding shared memory (2: the verify's own 90 KB at
T = 4) and by the register cap.

    JAX_PLATFORMS=cpu python tools/kernel_lab/ceiling.py [B,T,SPLIT ...]
"""
import argparse
import json
import sys

import torch

from jax_kda import kernel_abi
from jax_kda.kernels import compile_verify  # imports CuTe DSL first
import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int64
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream
from jax_kda.kernels.fused import THREADS
from jax_kda.kernels.fused_layout import FusedLayout
from jax_kda.kernels.primitives import aligned, bulk_copy, load_vec, row_major, wide
import bench_path  # noqa: F401 - benchmarks/ on sys.path
import measure
from graphs import Point

SHARED_PER_SM = 227 * 1024  # what the CTAs of one SM may share on sm_90


class StateOnly:
    """Grid (split, H, B) of 256 threads; CTA `rank` moves rows [rank RC, (rank + 1) RC)
    of state[slots[b], h] through `shared_bytes` of shared memory and back."""

    def __init__(self, heads, split, resident, shared_bytes):
        self.heads, self.split, self.resident = heads, split, resident
        self.rows = 128 // split
        self.padding = shared_bytes - self.rows * 128 * 4 - 16

    @cute.jit
    def __call__(self, stream: cuda.CUstream, slots: cute.Tensor, state: cute.Tensor):
        self.kernel(slots.iterator, state.iterator).launch(
            grid=(self.split, self.heads, slots.shape[0]), block=(THREADS, 1, 1),
            stream=stream, use_pdl=True, min_blocks_per_mp=self.resident,
            preferred_smem_carveout=100)

    @cute.kernel
    def kernel(self, slots, state):
        RC: cutlass.Constexpr = self.rows
        tid, _, _ = cute.arch.thread_idx()
        rank, head, request = cute.arch.block_idx()
        smem = cutlass.memory.SmemAllocator()
        staged = smem.allocate_tensor(Float32, row_major(RC, 128), byte_alignment=128)
        smem.allocate(self.padding, byte_alignment=16)
        arrived = smem.allocate_array(Int64, 1, byte_alignment=8)
        cute.arch.griddepcontrol_wait()
        slot = slots[request]
        base = ((wide(slot) * self.heads + head) * 128 + rank * RC) * 128
        if tid == 0:
            cute.arch.mbarrier_init(arrived, 1)
            cute.arch.mbarrier_init_fence()
            cute.arch.mbarrier_arrive_and_expect_tx(arrived, RC * 128 * 4)
            bulk_copy(staged.iterator, aligned(state, base, 16), RC * 128 * 4, arrived)
        cute.arch.barrier()
        cute.arch.mbarrier_wait(arrived, 0)
        for i in cutlass.range_constexpr(RC * 32 // THREADS):
            index = 4 * (tid + THREADS * i)
            v = load_vec(staged.iterator, index, 4)
            cute.make_tensor(aligned(state, base + index, 16), cute.make_layout(4)).store(v)
        cute.arch.griddepcontrol_launch_dependents()


def fakes(heads):
    """Symbolic slots [B] and state [S, H, K, K] (one binary for every point)."""
    return [make_fake_compact_tensor(cutlass.Int32, (cute.sym_int(),), stride_order=(0,),
                                     assumed_align=16),
            make_fake_compact_tensor(Float32, (cute.sym_int(), heads, 128, 128),
                                     stride_order=(3, 2, 1, 0), assumed_align=16)]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("points", nargs="*", default=["64,4,1", "256,4,1", "1,4,2"])
    args = parser.parse_args()
    bandwidth = measure.copy_bandwidth(torch)["tbps"] * 1e12
    print(f"{torch.cuda.get_device_name(0)}; copy {bandwidth / 1e12:.3f} TB/s", flush=True)
    picked = [kernel_abi.NAMES.index("slots"), kernel_abi.NAMES.index("state")]
    rows = []
    for text in args.points:
        B, T, split = (int(v) for v in text.split(","))
        point = Point(B, T, split)
        verify_us = point.graph_time(compile_verify(point.config, split, True, "float32",
                                                    "float32", solo=point.solo))
        floor_us = 2 * B * point.config.heads * 128 * 128 * 4 / bandwidth * 1e6
        row = dict(B=B, T=T, split=split, verify_us=verify_us, state_floor_us=floor_us)
        verify_shared = FusedLayout(point.config, split).shared_bytes()
        for resident in (2, 3):
            shared = verify_shared if resident == 2 else SHARED_PER_SM // 3 - 1024
            kernel = StateOnly(point.config.heads, split, resident, shared)
            compiled = cute.compile(kernel, make_fake_stream(), *fakes(point.config.heads))
            row[f"state_only_{resident}_us"] = point.graph_time(
                compiled, sets=[[s[i] for i in picked] for s in point.sets])
        rows.append(row)
        print(json.dumps(row), flush=True)
        del point
        torch.cuda.empty_cache()
    print(f"\n{'point':>10} {'floor':>8} {'verify':>8} {'moves, 2/SM':>12} "
          f"{'moves, 3/SM':>12}   (us; % = state floor / time)")
    for r in rows:
        cells = [r["verify_us"], r["state_only_2_us"], r["state_only_3_us"]]
        print(f"{r['B']:>4},{r['T']},{r['split']:<3} {r['state_floor_us']:8.1f} "
              + " ".join(f"{c:7.1f} {100 * r['state_floor_us'] / c:3.0f}%" for c in cells))


if __name__ == "__main__":
    sys.exit(main())
