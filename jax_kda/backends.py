"""Where each stage of a call runs: the one room of backend policy.

A public entry (`fused_verify`, `prefill`) names a backend ("auto", "jax", "cutedsl");
the head-sharded body that runs it (`partitioning.per_head`) asks this module for a
plan once, from its own (per-shard) config and batch, and runs what the plan names:

- a verify: the kernel with its launch (split, CTA variant) or the XLA backend;
- a prefill: its three stages, each in a kernel or in XLA: the convolution (with the
  gate projection beside it), the chunks' operands, the scan over the chunks.

A plan holds one choice for a program lowered for CUDA and one for every other
platform: "jax" is XLA on both, "cutedsl" the kernels on both (they raise a clear error
when lowered for anything but CUDA), "auto" the kernels on CUDA where they suit the
config and XLA elsewhere, chosen when the program is lowered
(`jax.lax.platform_dependent`): a step exported for ["cuda", "cpu"] carries both, and
the XLA branch beside a kernel is traced only where a program keeps it (`deferred`).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jax_kda import prompt_chunks, xla
from jax_kda.config import SPLITS, KdaConfig
from jax_kda.deferred import deferred
from jax_kda.layer import Prompt, convolved, gate_projection
from jax_kda.pytrees import KdaParams
from jax_kda.steps import prompt_step

BACKENDS = ("auto", "jax", "cutedsl")
KERNEL, XLA = "kernel", "xla"
KERNEL_TOKENS = 16  # the verify kernel's largest T, chain or tree
OPERANDS_KERNEL_SCALE = 2.0**60  # the largest query scale the operands kernel takes


def _cuda_major(device) -> int | None:
    """The major compute capability of a CUDA GPU, None for any other device."""
    if device.platform != "gpu" or not hasattr(device, "compute_capability"):
        return None
    return int(str(device.compute_capability).split(".")[0])


def kernel_available(device=None) -> bool:
    """True where `backend="auto"` may take the kernels for CUDA: nvidia-cutlass-dsl is
    installed (they compile for sm_90a on any host) and `device` (the default device
    unless one is given) is no CUDA GPU of compute capability < 9.0."""
    device = jax.devices()[0] if device is None else device
    major = _cuda_major(device)
    if major is not None and major < 9:
        return False
    try:
        import cutlass  # noqa: F401 - installed or not
    except ImportError:
        return False
    return True


def cutedsl_supported(device=None) -> bool:
    """True where the CuTe DSL kernels can run: a CUDA GPU of compute capability >= 9.0
    (the default device unless one is given) and nvidia-cutlass-dsl installed."""
    device = jax.devices()[0] if device is None else device
    return _cuda_major(device) is not None and kernel_available(device)


def check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")


def by_platform(cuda, other, *args, config: KdaConfig):
    """cuda(*args, config=config) where the program is lowered for CUDA, other(...) on
    every other platform; one call where the two are the same. `other` is traced only
    where a program is lowered for another platform (`deferred`): a step traced for a
    GPU pays for tracing the kernel's branch alone."""
    if cuda == other:
        return cuda(*args, config=config)
    results = []  # the CUDA branch's results, traced first: the other branch's types

    def cuda_branch(*args):
        results.append(cuda(*args, config=config))
        return results[-1]

    def other_branch(*args):
        if not results:  # branches traced in another order: trace `other` now
            return other(*args, config=config)
        return deferred(functools.partial(other, config=config), results[-1], *args)

    return jax.lax.platform_dependent(*args, cuda=cuda_branch, default=other_branch)


# --- the verify


@dataclasses.dataclass(frozen=True)
class Launch:
    """The verify kernel's launch: CTAs per (request, head) and whether each CTA takes an
    SM of its own (`ffi.launch`)."""

    split: int
    solo: bool


@dataclasses.dataclass(frozen=True)
class VerifyPlan:
    """The verify's kernel launch for a program lowered for CUDA (`cuda`) and for every
    other platform (`other`); None: the XLA backend."""

    cuda: Launch | None
    other: Launch | None


def kernel_takes(config: KdaConfig) -> None:
    """Raises ValueError, naming the need, where the verify kernel cannot run `config`
    at all: it verifies chains and trees of up to KERNEL_TOKENS tokens but for the builds
    that spill at every split it may take (`spilling_build`; those run in XLA)."""
    if config.tokens > KERNEL_TOKENS:
        raise ValueError(f"backend='cutedsl': the verify kernel takes T <= {KERNEL_TOKENS} "
                         f"tokens, got tokens={config.tokens}; use backend='auto' or "
                         f"backend='jax'")
    spills = [spilling_build(config, split)
              for split in (SPLITS if config.split is None else (config.split,))]
    if all(spills):
        raise ValueError(f"backend='cutedsl': the verify kernel takes no {spills[0]}; use "
                         f"backend='auto' or backend='jax'")


def spilling_build(config: KdaConfig, split: int) -> str | None:
    """The verify kernel's builds that spill registers (the compile table's, `python -m
    jax_kda.kernels`), named; None for every other. `ffi.kernel_split` launches none of
    them."""
    if config.tokens == 9 and config.gate_mode == 1:
        return "tokens=9 at gate_mode=1 (its gate projection's one-token second tile)"
    if config.trees and config.tokens == 13:
        return "tree of tokens=13 (its pair products, batched or node by node)"
    return None


def verify_plan(config: KdaConfig, batch: int, backend: str) -> VerifyPlan:
    """The plan of a verify of `batch` requests: "cutedsl" raises (naming the need) where
    the kernel cannot run the config or no split of it fits the shared memory; "auto"
    is XLA there."""
    if backend == "jax" or (backend == "auto" and not kernel_available()):
        return VerifyPlan(None, None)
    from jax_kda.ffi import kernel_split, solo_ctas  # the kernel's launch rules, lazily

    try:
        kernel_takes(config)
        split = kernel_split(config, batch)
    except ValueError:
        if backend == "cutedsl":
            raise
        return VerifyPlan(None, None)
    launch = Launch(split, solo_ctas(config, batch, split))
    return VerifyPlan(launch, launch if backend == "cutedsl" else None)


@functools.lru_cache(maxsize=None)
def verifier(backend: str):
    """The verify of `backend`, (params, cache, inputs, layer, *, config) -> (out, cache)
    on checked arguments: one object per backend (a static key of `per_head`'s
    partitioning), planning from the config it is called with."""

    def run(params, cache, inputs, layer, *, config: KdaConfig):
        plan = verify_plan(config, inputs.slots.shape[0], backend)
        return by_platform(_verify_with(plan.cuda), _verify_with(plan.other), params, cache,
                           inputs, layer, config=config)

    return run


@functools.lru_cache(maxsize=None)
def _verify_with(launch: Launch | None):
    """The XLA backend (None) or the kernel at `launch`."""
    if launch is None:
        return xla.xla_verify
    from jax_kda.ffi import cutedsl_verify  # the kernel's custom call, lazily

    def run(params, cache, inputs, layer, *, config: KdaConfig):
        return cutedsl_verify(params, cache, inputs, layer, config=config, split=launch.split,
                              solo=launch.solo)

    return run


# --- the prefill


@dataclasses.dataclass(frozen=True)
class PrefillStages:
    """Where each stage of a prefill runs (KERNEL or XLA): the convolution and the gate
    projection beside it, the chunks' operands, the scan over the chunks."""

    convolution: str
    operands: str
    scan: str


ALL_XLA = PrefillStages(XLA, XLA, XLA)


@dataclasses.dataclass(frozen=True)
class PrefillPlan:
    """The prefill's stages for a program lowered for CUDA and for every other
    platform."""

    cuda: PrefillStages
    other: PrefillStages


def scan_kernel_fits(config: KdaConfig) -> bool:
    """Whether the prefill's chunks suit the scan kernel (a multiple of 16 tokens:
    lower_bound >= about -41.6, and the softplus gate's 16)."""
    return prompt_chunks.chunk_size(config.lower_bound) % 16 == 0


def operands_kernel_fits(config: KdaConfig) -> bool:
    """Whether the operands kernel takes the config: its chunks and sub-chunks at the
    lower bound (>= about -5.2), and q scaled by at most 2^60 (its pair factors, around
    each sub-chunk's middle token, reach 2^60 themselves: FP32's range ends at 2^128)."""
    return (prompt_chunks.operands_kernel_fits(config.lower_bound)
            and config.query_scale <= OPERANDS_KERNEL_SCALE)


def prefill_plan(config: KdaConfig, backend: str) -> PrefillPlan:
    """The plan of a prefill: the scan in its kernel where the chunks suit it
    ("cutedsl" raises where they do not), the convolution and the operands in theirs
    where the config suits the operands kernel (`operands_kernel_fits`). The kernels see
    FP32 states either way: a bf16 checkpoint is widened and rounded around them."""
    fits = scan_kernel_fits(config)
    if backend == "cutedsl" and not fits:
        raise ValueError(f"backend='cutedsl': the prefill's chunks of "
                         f"{prompt_chunks.chunk_size(config.lower_bound)} tokens (lower_bound "
                         f"{config.lower_bound}) are not a multiple of 16; use backend='jax'")
    if backend == "jax" or not fits or (backend == "auto" and not kernel_available()):
        return PrefillPlan(ALL_XLA, ALL_XLA)
    near = KERNEL if operands_kernel_fits(config) else XLA
    stages = PrefillStages(near, near, KERNEL)
    return PrefillPlan(stages, stages if backend == "cutedsl" else ALL_XLA)


@functools.lru_cache(maxsize=None)
def prefiller(backend: str):
    """The prefill of `backend`, (params, cache, inputs, layer, *, config) -> (out,
    cache) on checked arguments: one object per backend, planning from the config it is
    called with."""

    def run(params, cache, inputs, layer, *, config: KdaConfig):
        plan = prefill_plan(config, backend)
        return by_platform(_prefill_with(plan.cuda), _prefill_with(plan.other), params,
                           cache, inputs, layer, config=config)

    return run


@functools.lru_cache(maxsize=None)
def _prefill_with(stages: PrefillStages):
    return functools.partial(_prefill, stages=stages)


@functools.partial(jax.jit, static_argnames=("config", "stages"))
def _prefill(params, cache, inputs, layer, *, config, stages):
    recurrence = functools.partial(
        xla.prompt_recurrence,
        operands=kernel_operands if stages.operands == KERNEL else xla.chunk_operands,
        scan=_kernel_scan() if stages.scan == KERNEL else prompt_chunks.scan_chunks)
    convolution = kernel_convolved if stages.convolution == KERNEL else convolved
    return prompt_step(params, cache, inputs, config, layer, recurrence, convolution)


def _kernel_scan():
    from jax_kda.ffi import cutedsl_chunk_states  # the kernel's call, lazily

    return cutedsl_chunk_states


def kernel_operands(params: KdaParams, prompt: Prompt, config: KdaConfig):
    """`xla.chunk_operands` by the operands kernel, from the prompt's bf16 tokens."""
    from jax_kda.ffi import cutedsl_chunk_operands  # the kernel's call, lazily

    return cutedsl_chunk_operands(*prompt, params.a_log, params.dt_bias,
                                  lower_bound=config.lower_bound, scale=config.query_scale)


def kernel_convolved(params: KdaParams, x, f_a, history, config: KdaConfig):
    """`layer.convolved` in bf16 arrays for the operands kernel: the convolution by its
    kernel (`jax_kda.kernels.prompt_conv`); in gate_mode 0 the gate projection is the
    bf16 product's own output (FP32 sums in the GPU library's order, rounded once:
    docs/spec.md, "Which path sums how"), in gate_mode 1 `layer.gate_projection`."""
    from jax_kda.ffi import cutedsl_prompt_conv  # the kernel's call, lazily

    if config.gate_mode == 0:
        raw_g = jnp.einsum("btr,hfr->bthf", f_a, params.f_b,
                           preferred_element_type=jnp.bfloat16)
    else:
        raw_g = gate_projection(f_a, params.f_b, config.gate_mode).astype(jnp.bfloat16)
    return cutedsl_prompt_conv(x, history, params.conv_weight, params.conv_bias), raw_g
