"""What the fused verify compiles to, phase by phase, without a GPU: each point's timeline
build (whose thread 0 reads the SM clock at every `Phase`) compiled for sm_90a, its
cubin disassembled by nvdisasm, and the instructions between two clock reads counted
as the phase that the second one ends. The counts are static: a runtime loop's body
counts once (the state pass's loops over its rows' chunks), and a phase counts the code
of every warp role (the sections, the projecting warps). They show which code grows with
T, with a tree and with the state's dtype; `timeline.py` times the phases on a GPU.

    python tools/kernel_lab/sass.py [--nvdisasm PATH] [T,SPLIT[,tree][,bf16] ...]

nvdisasm: on PATH, or from the nvidia-cuda-nvdisasm wheel.
"""
import argparse
import collections
import importlib.util
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

DUMPS = pathlib.Path(tempfile.mkdtemp(prefix="kda_sass_"))
os.environ.update(CUTE_DSL_ARCH="sm_90a", CUTE_DSL_KEEP="cubin", CUTE_DSL_DUMP_DIR=str(DUMPS))

import jax.numpy as jnp  # noqa: E402 - CuTe DSL reads the settings above at import

from jax_kda import KdaConfig  # noqa: E402
from jax_kda.kernels import compile_verify  # noqa: E402
from jax_kda.kernels.fused import Phase  # noqa: E402

INSTRUCTION = re.compile(r"\s+/\*[0-9a-f]+\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)")
# opcode families worth telling apart: the FP32 math, the selects a tree adds, the
# warp reductions, shared memory
FAMILIES = {"FFMA": ("FFMA",), "FMUL+FADD": ("FMUL", "FADD"), "MUFU": ("MUFU",),
            "SEL": ("SEL", "FSEL"), "SHFL": ("SHFL",), "LDS": ("LDS", "LDSM"),
            "STS": ("STS",)}


def nvdisasm_path(given):
    """nvdisasm: `given`, else on PATH, else the nvidia-cuda-nvdisasm wheel's."""
    if given or shutil.which("nvdisasm"):
        return given or shutil.which("nvdisasm")
    spec = importlib.util.find_spec("nvidia")
    for root in spec.submodule_search_locations if spec else ():
        for found in pathlib.Path(root).glob("cu*/bin/nvdisasm"):
            return str(found)
    sys.exit("nvdisasm not found: pip install nvidia-cuda-nvdisasm, or pass --nvdisasm")


def opcodes(point, nvdisasm):
    """(opcode, line) of a point's timeline build, in code order."""
    T, split, *flags = point.split(",")
    config = KdaConfig(heads=32, tokens=int(T), trees="tree" in flags,
                       state_dtype=jnp.bfloat16 if "bf16" in flags else jnp.float32)
    compile_verify(config, int(split), True, "float32", "float32", timeline=True)
    (cubin,) = DUMPS.glob("*.cubin")
    sass = subprocess.run([nvdisasm, "-c", str(cubin)], capture_output=True, text=True,
                          check=True).stdout
    cubin.unlink()
    return [(m.group(2), line) for line in sass.splitlines()
            if (m := INSTRUCTION.match(line))]


def phases(code):
    """Per phase (the one its code ends), a Counter of its opcodes; the code after the
    last clock read (the padding row, the exit) is "after"."""
    names = [phase.name.lower() for phase in Phase]
    counts, current = collections.defaultdict(collections.Counter), 0
    for opcode, line in code:
        if "SR_CLOCKLO" in line:
            current += 1
        counts[names[current] if current < len(names) else "after"][opcode] += 1
    return counts


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--nvdisasm", default=None)
    parser.add_argument("points", nargs="*", default=["8,1", "16,2", "8,1,tree", "16,2,tree"])
    args = parser.parse_args()
    nvdisasm = nvdisasm_path(args.nvdisasm)
    table = {point: phases(opcodes(point, nvdisasm)) for point in args.points}
    rows = ["start"] + [phase.name.lower() for phase in Phase][1:] + ["after"]
    width = max(12, *(len(p) + 1 for p in args.points))
    print("static instructions per phase (each ends at its clock read)")
    print(f"{'phase':<18}" + "".join(f"{p:>{width}}" for p in args.points))
    for row in rows:
        print(f"{row:<18}" + "".join(f"{sum(table[p][row].values()):>{width}}"
                                     for p in args.points))
    print(f"{'total':<18}" + "".join(
        f"{sum(sum(c.values()) for c in table[p].values()):>{width}}" for p in args.points))
    print("opcode families, whole kernel")
    for family, names in FAMILIES.items():
        print(f"{family:<18}" + "".join(
            f"{sum(c[n] for c in table[p].values() for n in names):>{width}}"
            for p in args.points))
    shutil.rmtree(DUMPS, ignore_errors=True)


if __name__ == "__main__":
    main()
