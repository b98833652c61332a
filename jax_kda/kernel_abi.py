"""The fused verify kernel's ABI: its operands, one table in launch order. The kernel's
signature (`FusedVerify.signature`, from which both bindings compile it), the custom
call's operand tuple and aliases (`jax_kda.ffi.verify_call`), the eager path's fields
(`jax_kda.ffi.eager`), the kernel's own view of them (`FusedVerify.__call__`), its
addresses (`jax_kda.kernels.fused_layout`) and docs/design.md's table are all derived
from it.

A shape is a tuple of sizes and symbols: B requests, T tokens, H heads, S slots, R
record rows, RQ record tokens, W window positions (K = 128 and the conv's 4 taps are
numbers). The weights and the cache of a stacked call carry a leading L as well. An
optional operand is there in the builds of one flag (`Operand.needs`): conv_bias with a
bias, layer when stacked, parents and nodes with trees.
"""
from __future__ import annotations

import dataclasses

from jax_kda.config import CONV_TAPS, K

READ, READ_WRITE, WRITE = "read", "read-write", "write"
OWN_DTYPE = "float32 or bfloat16"  # conv_weight's, norm_weight's and state's own, compiled in


@dataclasses.dataclass(frozen=True)
class Operand:
    """One operand: `name` is its field in `tree` ("inputs", "params", "cache"; "layer"
    the stacked call's layer index, "out" the output); `needs` the build flag without
    which it is absent ("has_bias", "stacked", "trees"; None: always there); `like`
    names the operand whose dtype it shares when its own is OWN_DTYPE."""

    name: str
    tree: str
    dims: tuple
    dtype: str
    access: str = READ
    needs: str | None = None
    like: str | None = None

    @property
    def optional(self) -> bool:
        return self.needs is not None

    @property
    def stacks(self) -> bool:
        """Whether a stacked call gives it a leading layer axis."""
        return self.tree in ("params", "cache")


OPERANDS = (
    Operand("x", "inputs", ("B", "T", 3, "H", K), "bfloat16"),
    Operand("f_a", "inputs", ("B", "T", K), "bfloat16"),
    Operand("beta", "inputs", ("B", "T", "H"), "bfloat16"),
    Operand("gate", "inputs", ("B", "T", "H", K), "bfloat16"),
    Operand("slots", "inputs", ("B",), "int32"),
    Operand("record_rows", "inputs", ("B",), "int32"),
    Operand("parents", "inputs", ("B", "T"), "int32", needs="trees"),
    Operand("layer", "layer", (1,), "int32", needs="stacked"),
    Operand("conv_weight", "params", (3, CONV_TAPS, "H", K), OWN_DTYPE),
    Operand("conv_bias", "params", (3, "H", K), OWN_DTYPE, needs="has_bias",
            like="conv_weight"),
    Operand("a_log", "params", ("H",), "float32"),
    Operand("dt_bias", "params", ("H", K), "float32"),
    Operand("f_b", "params", ("H", K, K), "bfloat16"),
    Operand("norm_weight", "params", (K,), OWN_DTYPE),
    Operand("state", "cache", ("S", "H", K, K), OWN_DTYPE, READ_WRITE),
    Operand("conv", "cache", ("S", 3, "H", K, "W"), "bfloat16", READ_WRITE),
    Operand("corrections", "cache", ("R", "H", "RQ", K), "float32", READ_WRITE),
    Operand("key_gates", "cache", ("R", "H", "RQ", 2, K), "bfloat16", READ_WRITE),
    Operand("pending", "cache", ("R", "H"), "int32", READ_WRITE),
    Operand("nodes", "cache", ("R", "H", "RQ"), "int32", READ_WRITE, needs="trees"),
    Operand("out", "out", ("B", "T", "H", K), "bfloat16", WRITE),
)
NAMES = tuple(op.name for op in OPERANDS)
INPUTS = tuple(op for op in OPERANDS if op.access != WRITE)  # the custom call's operands
OUTPUTS = (tuple(op for op in OPERANDS if op.access == WRITE)
           + tuple(op for op in OPERANDS if op.access == READ_WRITE))


def shape(op: Operand, sizes: dict, stacked: bool) -> tuple:
    """op's shape with its symbols taken from `sizes` (B, T, H, S, R, RQ, W and, for a
    stacked call, L)."""
    dims = tuple(sizes[d] if isinstance(d, str) else d for d in op.dims)
    return ((sizes["L"],) if stacked and op.stacks else ()) + dims


def sizes_of(config, B, S, R, L=None) -> dict:
    """The symbols of a configuration and its batch, slot, record and layer counts."""
    return dict(B=B, T=config.tokens, H=config.heads, S=S, R=R, RQ=config.rq,
                W=config.window, L=L)


def present(op: Operand, has_bias: bool, stacked: bool, trees: bool) -> bool:
    """Whether a build with (or without) conv_bias, stacked or not, with trees or not,
    takes operand op."""
    return op.needs is None or dict(has_bias=has_bias, stacked=stacked, trees=trees)[op.needs]


def aliases(has_bias: bool, stacked: bool, trees: bool) -> dict:
    """A build's aliases: each present read-write operand's position among INPUTS (the
    absent ones counted) -> its position among the build's present outputs."""
    outputs = [op for op in OUTPUTS if present(op, has_bias, stacked, trees)]
    return {INPUTS.index(op): outputs.index(op) for op in outputs if op.access == READ_WRITE}


def dtype(op: Operand, own: dict) -> str:
    """op's dtype name; `own` maps conv_weight, norm_weight and state to theirs."""
    return own[op.like or op.name] if op.dtype == OWN_DTYPE else op.dtype


def values(params, cache, inputs, layer, out=None, only=OPERANDS) -> list:
    """The arrays of the operands `only` (all, in launch order, by default) from their
    pytrees (None for an absent optional one)."""
    trees = {"params": params, "cache": cache, "inputs": inputs}
    found = {"layer": layer, "out": out}
    return [found[op.tree] if op.tree in found else getattr(trees[op.tree], op.name)
            for op in only]


def table() -> str:
    """The operands as a markdown table (docs/design.md holds it)."""
    rows = ["| # | operand | of | shape | dtype | access |", "| --- | --- | --- | --- | --- | --- |"]
    for i, op in enumerate(OPERANDS):
        lead = "[L,] " if op.stacks else ""
        dims = ", ".join(map(str, op.dims))
        note = " (optional)" if op.optional else ""
        rows.append(f"| {i} | `{op.name}`{note} | {op.tree} | {lead}[{dims}] | {op.dtype} | "
                    f"{op.access} |")
    return "\n".join(rows)
