"""A function staged out as one equation and traced only where it is lowered.

`jax.lax.platform_dependent` traces every platform's branch, and the XLA backend's
branch of a step (element by element where the sums must not depend on the CPU) takes
longer to trace than the kernel's. `deferred(fun, like, *args)` stands for fun(*args),
whose results have the types of `like`: it traces `fun` only when a program that
keeps it is lowered (or when it runs eagerly), so a step lowered for CUDA alone never
traces its other platforms' branch.
"""
from __future__ import annotations

import jax
from jax.extend.core import Primitive
from jax.interpreters import mlir

deferred_p = Primitive("kda_deferred")
deferred_p.multiple_results = True


def deferred(fun, like, *args):
    """fun(*args) (pytrees of arrays), its results typed as `like`'s (a pytree of arrays
    or tracers of fun's result types), traced only when lowered."""
    leaves, in_tree = jax.tree.flatten(args)
    like_leaves, out_tree = jax.tree.flatten(like)
    results = deferred_p.bind(*leaves, fun=fun, in_tree=in_tree, out_tree=out_tree,
                              out_types=tuple(jax.typeof(a) for a in like_leaves))
    return out_tree.unflatten(results)


def _flat(*leaves, fun, in_tree, out_tree, out_types):
    results, tree = jax.tree.flatten(fun(*in_tree.unflatten(leaves)))
    kinds = [(t.shape, t.dtype) for t in map(jax.typeof, results)]
    expected = [(t.shape, t.dtype) for t in out_types]
    if tree != out_tree or kinds != expected:
        raise TypeError(f"deferred: {fun} returned {tree} of {kinds}, expected {out_tree} "
                        f"of {expected}")
    return results


deferred_p.def_impl(_flat)
deferred_p.def_abstract_eval(lambda *_, out_types, **__: out_types)
mlir.register_lowering(deferred_p, mlir.lower_fun(_flat, multiple_results=True))
