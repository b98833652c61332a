"""The token-tree section of the benchmark: one verify of a KDA layer (H = 32) on a tree of
T nodes against a chain of T tokens, at T = 8 and 16 and B = 1, 16, 64, jitted with the
cache donated, `backend="auto"` (the kernel where it takes the step: T <= 16, chain or
tree) and both in XLA too (`backend="jax"`), so that a tree's
cost over a chain shows on each path.

Correctness first: at each T, the tree's outputs of both backends against the stock
reference on the same tree (the largest error, in bf16 units of the row's scale).

Each row: form (chain, tree, chain-xla, tree-xla), B, T, us (the GPU's time of a call:
the span of its activities in JAX's profiler trace, median), backend, or error; a short
table last (`summary`). Alone:

    python benchmarks/trees.py --json trees.json [--points 1x8,16x8,...] [--forms chain,tree]
"""
from __future__ import annotations

import dataclasses
import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np

import measure  # benchmarks/, on sys.path as the script's folder
from jax_kda import KdaConfig, fused_verify
from jax_kda.profiling import traced_steps
from jax_kda.ref import stock_verify
from jax_kda.testing import random_cache, random_inputs, random_params, random_parents

POINTS = ((1, 8), (16, 8), (64, 8), (1, 16), (16, 16), (64, 16))
CALLS = 20
FORMS = {"chain": ("auto", False), "tree": ("auto", True), "chain-xla": ("jax", False),
         "tree-xla": ("jax", True)}


def operands(B: int, T: int, tree: bool, seed: int = 0):
    """(config, params, cache, inputs) of B requests at slots 1..B, trees random."""
    config = KdaConfig(heads=measure.KIMI_HEADS, tokens=T, trees=tree)
    key = jax.random.key(seed)
    slots = jnp.arange(1, B + 1, dtype=jnp.int32)
    inputs = random_inputs(jax.random.fold_in(key, 2), config, slots, slots - 1)
    if tree:
        inputs = dataclasses.replace(
            inputs, parents=random_parents(np.random.default_rng(seed), B, T))
    return (config, random_params(key, config),
            random_cache(jax.random.fold_in(key, 1), config, B + 1, B), inputs)


def check(T: int, backend: str) -> float:
    """The tree verify of `backend` against the stock reference on one tree batch: the
    largest |out - stock| over the row's mean |stock|, in bf16 units (2^-8)."""
    config, params, cache, inputs = operands(4, T, True, seed=T)
    out, _ = fused_verify(params, cache, inputs, config, backend=backend)
    ref, _ = jax.jit(stock_verify, static_argnames="config")(params, cache, inputs, config)
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    scale = np.mean(np.abs(ref), axis=-1, keepdims=True) + 1e-30
    return float(np.max(np.abs(out - ref) / scale) / 2**-8)


def timed(form: str, B: int, T: int) -> dict:
    backend, tree = FORMS[form]
    config, params, cache, inputs = operands(B, T, tree)
    step = jax.jit(functools.partial(fused_verify, config=config, backend=backend),
                   donate_argnums=1)
    state = {"cache": cache}

    def call():
        _, state["cache"] = step(params, state["cache"], inputs)
        return state["cache"]

    jax.block_until_ready(call())
    traced = traced_steps(lambda: jax.block_until_ready([call() for _ in range(CALLS)][-1]),
                          CALLS)
    return dict(us=traced.get("step_us"), kernels=traced.get("kernels"))


def run(args) -> list:
    rows = []
    for T in sorted({T for _, T in args.points}):
        for backend in sorted({FORMS[form][0] for form in args.forms}):
            measure.emit(rows, dict(form="check", T=T, backend=backend,
                                    tree_vs_stock_bf16_units=check(T, backend)), args.json)
    for B, T in args.points:
        for form in args.forms:
            try:
                row = timed(form, B, T)
            except Exception as error:  # a point that cannot run says why and the rest go on
                row = dict(error=f"{type(error).__name__}: {error}"[:300])
            measure.emit(rows, dict(form=form, B=B, T=T, backend=FORMS[form][0], **row),
                         args.json)
    return rows


def summary(rows: list) -> None:
    """The short table printed last: each point's time per form, a tree against the chain
    of its T (kernel, XLA), and at each B, T = 16 against T = 8 where both ran."""
    us = {(row["form"], row["B"], row["T"]): row["us"] for row in rows if row.get("us")}
    names = [form for form in FORMS if any(key[0] == form for key in us)]
    print("\n   B   T" + "".join(f"{form:>11}" for form in names)
          + "  tree/chain  tree/chain in XLA")
    for B, T in sorted({key[1:] for key in us}):
        times = [us.get((form, B, T)) for form in names]
        ratios = [us[(tree, B, T)] / us[(chain, B, T)] if (tree, B, T) in us and
                  (chain, B, T) in us else None
                  for tree, chain in (("tree", "chain"), ("tree-xla", "chain-xla"))]
        print(f"{B:>4}{T:>4}" + "".join(f"{t:>8.2f} us" if t else f"{'-':>11}" for t in times)
              + "".join(f"{r:>11.2f}x" if r else f"{'-':>12}" for r in ratios))
    for B in sorted({key[1] for key in us}):
        pairs = [(form, us[(form, B, 16)] / us[(form, B, 8)]) for form in names
                 if (form, B, 16) in us and (form, B, 8) in us]
        if pairs:
            print(f"B = {B}, T = 16 against T = 8: "
                  + ", ".join(f"{form} {ratio:.2f}x" for form, ratio in pairs))


def parse(argv):
    parser = measure.section_parser(__doc__)
    parser.add_argument("--points", type=measure.points, default=list(POINTS),
                        help="BxT points (default 1x8,16x8,64x8,1x16,16x16,64x16)")
    parser.add_argument("--forms", type=forms, default=list(FORMS),
                        help=f"the forms timed, and the backends checked (default "
                             f"{','.join(FORMS)})")
    return parser.parse_args(argv)


def forms(text: str) -> list:
    """'chain,tree' -> the forms named, each one of FORMS."""
    names = text.split(",")
    unknown = [name for name in names if name not in FORMS]
    if unknown:
        raise ValueError(f"unknown forms {unknown}: expected some of {list(FORMS)}")
    return names


if __name__ == "__main__":
    summary(run(parse(sys.argv[1:])))
