"""Does racecheck see a CTA barrier after a named barrier that only some warps take?

The fused verify's section 1 (warps 4-7) takes a named barrier of its own in
`load_records`; racecheck then reports RAW hazards between section 1's shared stores and
section 0's loads across later CTA barriers. This kernel has that shape and nothing
else: section 1 stores, a CTA barrier, section 0 loads what it stored. With `--named`,
section 1 first takes barrier 1 of 128 threads. The hardware's barrier 0 is another
barrier than barrier 1, so both forms are race-free; a hazard that racecheck reports with
`--named` alone is racecheck's.

    compute-sanitizer --tool racecheck python tools/kernel_lab/named_barrier.py [--named]
"""
import argparse

import cutlass
import cutlass.cute as cute
import torch
from cutlass.cute.runtime import from_dlpack

THREADS = 256
HALF = THREADS // 2


@cute.kernel
def handoff(out: cute.Tensor, named: cutlass.Constexpr):
    """Section 1 stores its thread index into slot tid - HALF; section 0 reads slot tid."""
    tid, _, _ = cute.arch.thread_idx()
    smem = cutlass.utils.SmemAllocator()
    slots = smem.allocate_tensor(cutlass.Int32, cute.make_layout(HALF), byte_alignment=16)
    if cutlass.const_expr(named):
        if tid >= HALF:
            cute.arch.barrier(barrier_id=1, number_of_threads=HALF)
    cute.arch.barrier()
    if tid >= HALF:
        slots[tid - HALF] = tid
    cute.arch.barrier()
    if tid < HALF:
        out[tid] = slots[tid]


@cute.jit
def launch(out: cute.Tensor, named: cutlass.Constexpr):
    handoff(out, named).launch(grid=[1, 1, 1], block=[THREADS, 1, 1], smem=HALF * 4 + 64)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--named", action="store_true",
                        help="section 1 takes a named barrier of its own first")
    named = parser.parse_args().named
    out = torch.full((HALF,), -1, dtype=torch.int32, device="cuda")
    launch(from_dlpack(out), named)
    torch.cuda.synchronize()
    expected = torch.arange(HALF, THREADS, dtype=torch.int32, device="cuda")
    assert torch.equal(out, expected), out
    print(f"named={named}: section 0 read every store of section 1")


if __name__ == "__main__":
    main()
