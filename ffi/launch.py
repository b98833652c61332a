"""How the kernel is launched for a batch: the split (CTAs per (request, head)) and
whether each CTA gets an SM of its own. docs/performance.md has the measurements these
rules come from."""
from __future__ import annotations

import jax

from jax_kda.config import (CTA_RESERVED, CTA_SHARED_LIMIT, DEFAULT_SMS, SM_SHARED, SPLITS,
                             KdaConfig)


# From this many tokens a split-1 CTA that needs more than half an SM's shared memory
# (alone on its SM) gives way to split 2: faster at T = 16, and T = 8 with 4 steps'
# records (8-14% at B = 64); at T = 4 with 8 steps' records split 2 was 14-17% slower
LONE_CTA_TOKENS = 8


def sm_count(device=None) -> int:
    """Streaming multiprocessors of `device` (the default device), DEFAULT_SMS if unknown."""
    device = jax.devices()[0] if device is None else device
    return int(getattr(device, "core_count", 0) or DEFAULT_SMS)


def choose_split(items: int, sms: int) -> int:
    """CTAs per (request, head) for `items` = B x H on `sms` SMs: the smallest split whose
    grid puts a CTA on a quarter of the SMs, and at least 2 while the split-2 grid still
    fits the SMs one CTA each. A large batch streams each state with one CTA (the
    per-token operands computed once per item); a small one spreads its rows over SMs
    that would otherwise stay idle."""
    for split in SPLITS:
        if items * split >= sms // 4 and (split > 1 or 2 * items > sms):
            return split
    return SPLITS[-1]


def solo_ctas(config: KdaConfig, batch: int, split: int, sms: int | None = None) -> bool:
    """Whether the launch gives each CTA an SM of its own: where its batch x heads x split
    CTAs fit the SMs one each, at split 1 or 2 (with two CTAs allowed per SM, a grid
    that small may land two to an SM on half of them, or beside the next launch's CTAs
    parked in griddepcontrol.wait)."""
    sms = sm_count() if sms is None else sms
    return isinstance(batch, int) and split <= 2 and batch * config.heads * split <= sms


def kernel_split(config: KdaConfig, batch: int, sms: int | None = None) -> int:
    """The split the kernel runs `config` with at `batch` requests: config.split, or
    `choose_split`'s raised to the smallest whose CTA fits the shared memory
    (`FusedLayout.shared_bytes`: long records need more), at least 2 from
    LONE_CTA_TOKENS tokens where a split-1 CTA would be alone on its SM, never one whose
    build spills (`backends.spilling_build`: the largest below then). Raises ValueError,
    naming the need, where the kernel does not take `config` (`backends.kernel_takes`)
    or no split fits."""
    from jax_kda.backends import kernel_takes, spilling_build
    from jax_kda.kernels.fused_layout import FusedLayout

    kernel_takes(config)
    if config.split is None and not isinstance(batch, int):
        raise ValueError(f"config.split: a symbolic batch size ({batch}) needs an explicit "
                         f"split, one of {SPLITS}")
    if config.split is None:
        first = choose_split(batch * config.heads, sm_count() if sms is None else sms)
        unspilled = [s for s in SPLITS if not spilling_build(config, s)]
        candidates = [s for s in unspilled if s >= first] or unspilled[-1:]
        lone = 2 * (FusedLayout(config, 1).shared_bytes() + CTA_RESERVED) > SM_SHARED
        if lone and config.tokens >= LONE_CTA_TOKENS:
            candidates = [s for s in candidates if s > 1] or candidates
    else:
        candidates = [config.split]
    for split in candidates:
        need = FusedLayout(config, split).shared_bytes()
        if need <= CTA_SHARED_LIMIT:
            return split
    raise ValueError(
        f"config: tokens={config.tokens}, record_tokens={config.rq}, split={split} needs "
        f"{need / 1024:.0f} KiB of shared memory per CTA, more than the "
        f"{CTA_SHARED_LIMIT // 1024} KiB of a Hopper SM; use a larger split (or "
        f"split=None), fewer record_tokens, or backend='jax'")
