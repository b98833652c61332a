"""Fidelity of the checkpoint's storage (`KdaConfig.state_dtype`): long decode episodes on
the XLA backend with an FP32 and a bf16 state, each against the float64 model of the
exact math (tests/numpy_model.py with its state and records in float64, never rounded;
the layer's own bf16 roundings, SiLU, raw gates, o_t and the output, where the contract
puts them).

An episode: a prompt of 16 tokens per request, then verifies of T random tokens, each
followed by an accept of a random count in 1..T (as sampling gives), the three runs
(FP32, bf16, the model) fed the same tokens and counts. At the reported steps: the
largest and the mean |error| of that step's outputs, and of the state flushed at that
step (a copy: the episode goes on unflushed), beside the largest |exact| of each.

    JAX_PLATFORMS=cpu python benchmarks/fidelity.py [--steps 300,1000] [--heads 2]
        [--tokens 4] [--batch 2] [--lower-bound -5] [--report 1,10,100,300,1000]
        [--json fidelity.json]
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jax_kda import (KdaConfig, PrefillInputs, accept, flush, fused_verify, init_cache,
                     prefill)
from jax_kda.testing import random_accepted, random_inputs, random_params

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
import numpy_model  # noqa: E402 - the tests' float64 oracle, which imports no jax_kda

REPORTED = "1,10,100,300,1000"
PROMPT = 16
DTYPES = {"fp32": jnp.float32, "bf16": jnp.bfloat16}


def exact_cache(cache):
    """The model's cache: `cache`'s buffers as NumPy arrays, its state and records in
    float64 (never rounded)."""
    model = numpy_model.copy_cache(cache, "never")
    model.corrections = model.corrections.astype(np.float64)
    return model


def errors(actual, expected) -> dict:
    gap = np.abs(np.asarray(actual, np.float64) - expected)
    return dict(max=float(gap.max()), mean=float(gap.mean()), exact=float(np.abs(expected).max()))


def verified(params, cache, inputs, accepted, *, config):
    """A verify, then the accept of `accepted` tokens: (out, cache)."""
    out, cache = fused_verify(params, cache, inputs, config, backend="jax")
    return out, accept(cache, inputs.record_rows, accepted, config)


def episode(steps: int, heads: int, tokens: int, batch: int, seed: int,
            lower_bound: float = -5.0, reported=(1, 10, 100, 300, 1000)) -> list:
    """Rows of (state dtype, step, outputs' and flushed state's errors) at the steps of
    `reported` within `steps`."""
    config = KdaConfig(heads=heads, tokens=tokens, lower_bound=lower_bound)
    configs = {name: dataclasses.replace(config, state_dtype=d) for name, d in DTYPES.items()}
    key = jax.random.key(seed)
    rng = np.random.default_rng(seed)
    params = random_params(jax.random.fold_in(key, 0), config)
    slots = jnp.arange(1, batch + 1, dtype=jnp.int32)
    rows = jnp.arange(batch, dtype=jnp.int32)
    wide = random_inputs(jax.random.fold_in(key, 1), dataclasses.replace(config, tokens=PROMPT),
                         slots, rows)
    prompts = PrefillInputs(wide.x, wide.f_a, wide.beta, wide.gate,
                            jnp.full((batch,), PROMPT, jnp.int32), slots, rows)
    caches, outs = {}, {}
    for name, c in configs.items():
        outs[name], caches[name] = prefill(params, init_cache(c, batch + 1, batch), prompts, c,
                                           backend="jax")
    _, model = numpy_model.prefill(params, exact_cache(caches["fp32"]), prompts, config,
                                   rounding="never")
    draw = jax.jit(random_inputs, static_argnums=1)
    steps_of = {name: jax.jit(functools.partial(verified, config=c), donate_argnums=1)
                for name, c in configs.items()}
    found = []
    for step in range(1, steps + 1):
        inputs = draw(jax.random.fold_in(key, 1 + step), config, slots, rows)
        accepted = random_accepted(rng, rows, tokens)
        for name in configs:
            outs[name], caches[name] = steps_of[name](params, caches[name], inputs, accepted)
        model_out, after = numpy_model.verify(params, model, inputs, config, rounding="never")
        model = numpy_model.accept(after, rows, accepted, config)
        if step not in reported:
            continue
        exact = numpy_model.flush(params, model, slots, rows, config, rounding="never")
        for name, c in configs.items():
            flushed = flush(params, caches[name], slots, rows, c)
            found.append(dict(
                state_dtype=name, steps=steps, step=step,
                out=errors(outs[name], model_out),
                state=errors(np.asarray(flushed.state, np.float64)[1:],
                             exact.state[1:])))
    return found


def table(found: list) -> str:
    lines = ["| episode | step | state | out max err | out mean err | out max exact | "
             "state max err | state mean err | state max exact |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in found:
        o, s = row["out"], row["state"]
        lines.append(f"| {row['steps']} | {row['step']} | {row['state_dtype']} | "
                     f"{o['max']:.2e} | {o['mean']:.2e} | {o['exact']:.2f} | "
                     f"{s['max']:.2e} | {s['mean']:.2e} | {s['exact']:.2f} |")
    return "\n".join(lines)


def main(argv) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", default="300,1000", help="episode lengths")
    parser.add_argument("--report", default=REPORTED, help="the steps reported")
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=4)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--lower-bound", type=float, default=-5.0,
                        help="the gate's lower bound: near 0, every decay is near 1")
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args(argv)
    found = []
    for seed, steps in enumerate(int(s) for s in args.steps.split(",")):
        found += episode(steps, args.heads, args.tokens, args.batch, seed, args.lower_bound,
                         tuple(int(s) for s in args.report.split(",")))
    print(table(found))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(found, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
