"""One compile contract for the four kernels.

A kernel object holds its compile-time values only and compares and hashes by them
(`Kernel.key`): it is the compile key. `kernel.signature(*sizes)` gives its operands at
the sizes named by `kernel.dims` (B requests, P prompt tokens, H heads, ...): one shape
contract, which both bindings compile for symbolic sizes, so one binary serves every
batch and prompt. `compiled(kernel)` is the one cache: per kernel, options, arch and
binding, compiled once, its device function named by `Kernel.symbol`. The binding says
how the signature is compiled: `on_fakes`, CuTe DSL's fake tensors (16-byte aligned),
for calls from Python on DLPack tensors (the eager path, the compile table); or the
custom call's (`jax_kda.ffi.lowering.for_xla`). The arch is passed to each compile
(`--gpu-arch`), never set in the environment.
"""
from __future__ import annotations

import functools
import hashlib
import re
from typing import NamedTuple

import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

from jax_kda.kernels.primitives import DTYPES

ARCH = "sm_90a"  # the kernels use Hopper's arch-specific features (clusters, griddepcontrol)


class Signature(NamedTuple):
    """A kernel's operands as (shape, dtype name) pairs, None for an absent optional
    input; the kernel is called as (stream, *inputs, *outputs), less the outputs that
    `aliases` ((input, output) pairs) writes in place of an input (`arguments`)."""

    inputs: tuple
    outputs: tuple
    aliases: tuple = ()

    def arguments(self) -> tuple:
        """The operands the kernel's __call__ takes after the stream, in order."""
        written = {output for _, output in self.aliases}
        return self.inputs + tuple(o for j, o in enumerate(self.outputs) if j not in written)


class Kernel:
    """A kernel as a compile key: equal (and of equal hash) where its class and `key`, its
    compile-time values, are. A subclass names its symbolic sizes (`dims`) and gives its
    `signature` at them."""

    dims: tuple = ()

    def key(self) -> tuple:
        raise NotImplementedError

    def signature(self, *sizes) -> Signature:
        raise NotImplementedError

    def role(self) -> str:
        """What the kernel does, for its `symbol`: its class's name in snake case."""
        return re.sub(r"(?<!^)(?=[A-Z])", "_", type(self).__name__).lower()

    def symbol(self) -> str:
        """How the kernel's name in its binary begins, as profilers and sanitizers show
        it: its `role` and a digest of its `key`, so that no two builds share a name."""
        digest = hashlib.sha256(repr(self.key()).encode()).hexdigest()[:8]
        return f"kda_{self.role()}_{digest}"

    def __eq__(self, other):
        return type(self) is type(other) and self.key() == other.key()

    def __hash__(self):
        return hash((type(self), self.key()))


def fake_tensors(operands) -> list:
    """CuTe DSL fakes of (shape, dtype name) pairs: compact row-major, 16-byte aligned;
    None stays None (an absent operand)."""
    return [None if operand is None else make_fake_compact_tensor(
        DTYPES[operand[1]], operand[0], stride_order=tuple(reversed(range(len(operand[0])))),
        assumed_align=16) for operand in operands]


def on_fakes(kernel: Kernel, arch: str, options: str):
    """`kernel` compiled for `arch` (which `options` names) on fakes of its signature at
    symbolic sizes: a CuTe DSL compiled function, called as (stream,
    *signature.arguments()) on DLPack tensors."""
    signature = kernel.signature(*(cute.sym_int() for _ in kernel.dims))
    return cute.compile(kernel, make_fake_stream(), *fake_tensors(signature.arguments()),
                        options=options)


@functools.lru_cache(maxsize=None)
def compiled(kernel: Kernel, options: str = "", arch: str = ARCH, binding=on_fakes):
    """`kernel` compiled once per (kernel, options, arch, binding) for `arch` by
    `binding` (`on_fakes`, or `jax_kda.ffi.lowering`'s `for_xla`, `binary` and
    `binary_key`, the custom call's object file and its cache key); options: more CuTe DSL
    compile options (e.g. "remarks{ptx}", ptxas' report)."""
    # the DSL's mangled name kept after the symbol: without it ptxas spilled the tree
    # builds of 16 nodes at gate_mode 1, splits 1 and 2 (16-168 bytes)
    type(kernel).kernel.set_name_prefix(kernel.symbol(), remove_cutlass_symbol=True,
                                        keep_mangled_name=True)
    return binding(kernel, arch, f"--gpu-arch {arch} {options}".strip())
