"""How the entry points meet JAX's transformations (README, "Transformations").

`jax.vmap`: the requests of every mapped instance are one batch sharing the cache, so a
mapped axis of the per-request arguments folds into the batch B and the cache comes
out unmapped (`jax.vmap(step, out_axes=(0, None))`); a mapped cache or weights is
refused, naming the entry. Differentiation (`jax.grad`, `jvp`, `vjp`, `linearize`):
the verify, the prefill and the flush are inference steps (a kernel, a cache updated
in place), so they raise, naming the differentiable reference to use instead.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax_kda.partitioning import per_head


def request_batched(name: str, body, instead: str | None = None):
    """body(shared, requests) -> (per_request, shared_out) as the entry `name` runs it.

    shared, requests: dicts of argument name -> pytree of arrays. Under `jax.vmap` the
    mapped axis of every leaf of `requests` folds into its leading batch axis B (an
    unmapped one is repeated for every instance), `per_request`'s leaves (leading B,
    or None) come out mapped and `shared_out` unmapped; a mapped leaf of `shared`
    raises a ValueError. instead: where given, differentiating through the entry
    raises a TypeError that says what to differentiate instead.
    """

    @jax.custom_batching.custom_vmap
    def run(shared, requests):
        return body(shared, requests)

    @run.def_vmap
    def fold(axis_size, in_batched, shared, requests):
        shared_b, requests_b = in_batched
        mapped = [arg for arg, batched in shared_b.items() if any(jax.tree.leaves(batched))]
        if mapped:
            raise ValueError(
                f"jax.vmap of {name}: {mapped[0]}: expected unmapped (in_axes None), got "
                f"mapped; the mapped axis of {', '.join(requests)} folds into the batch B, "
                f"and every instance shares {', '.join(shared)} (out_axes None for the "
                f"cache)")
        widen = lambda a, m: a if m else jnp.broadcast_to(a, (axis_size,) + a.shape)
        fold_in = lambda a: a.reshape((-1,) + a.shape[2:])  # [V, B, ...] -> [V B, ...]
        folded = jax.tree.map(lambda a, m: fold_in(widen(a, m)), requests, requests_b)
        per_request, shared_out = run(shared, folded)
        unfold = lambda a: a.reshape((axis_size, -1) + a.shape[1:])
        return ((jax.tree.map(unfold, per_request), shared_out),
                (jax.tree.map(lambda _: True, per_request),
                 jax.tree.map(lambda _: False, shared_out)))

    if instead is None:
        return run
    refused = jax.custom_jvp(run)

    @refused.defjvp
    def derivative(primals, tangents):
        raise TypeError(f"{name} is inference-only and has no derivative; differentiate "
                        f"{instead}")

    return refused


@functools.lru_cache(maxsize=None)
def per_head_entry(name: str, body, config, instead: str):
    """The entry `name` over `body(params, cache, inputs, layer, *, config)`: split by
    heads where they are sharded (`partitioning.per_head`), as `request_batched` runs
    it (the inputs fold into the batch under `jax.vmap`, differentiation raises naming
    `instead`). Call it with (dict(params=, cache=, layer=), dict(inputs=)); one object
    per (name, body, config)."""

    def run(shared, requests):
        return per_head(body, config, shared["params"], shared["cache"], requests["inputs"],
                        shared["layer"])

    return request_batched(name, run, instead)
