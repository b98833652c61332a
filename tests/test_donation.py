"""Inside jax.jit with the cache donated, fused_verify (backend="jax"), accept, flush and
prefill update the cache in place and do O(B) work, none in the number of slots:

- the compiled program aliases each cache parameter to its output and holds no whole
  copy of a cache buffer (HLO checks, where XLA:CPU allows it: see the strict xfails);
- the output arrays live in the donated input buffers (pointer checks);
- a step costs the same at S = 17 and S = 1025 slots, to well within one pass over
  the larger state (timing checks), once the bf16 window's known O(S) cost on XLA:CPU
  is timed on its own and taken off: whole-buffer work that the HLO checks cannot see
  (a fusion that rewrites the state, a reduction over it) shows in what it costs.

Each runs for B = 1 (verify pads it to two rows: XLA turns a one-row scatter into a
dynamic-update-slice with a copy around it), B = 2, and a stacked cache with layer=1.
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_kda import KdaConfig, PrefillInputs, accept, flush, fused_verify, init_cache, prefill
from jax_kda import cache_rows
from hlo import aliased, whole_copies
from timing import Repeated, growth, yardstick_program

# T = 2: the bf16 window (W = 5 positions) is 1.5 W / K = 6% of the state's bytes, the
# least its known O(S) cost on XLA:CPU (BF16_UPCAST below) can be.
CONFIG = KdaConfig(heads=2, tokens=2)
SMALL, LARGE = 17, 1025  # slots; the shapes make every cache type unique in the HLO
NUM_RECORDS, LAYERS, PROMPT = 8, 2, 3
FIELDS = ("state", "conv", "corrections", "key_gates", "pending")
VARIANTS = {"B1": (1, None), "B2": (2, None), "stacked-layer1": (2, 1)}
OPS = ("verify", "decode", "accept", "flush", "prefill")
verify = functools.partial(fused_verify, backend="jax")


def arguments(draw, variant, num_slots, config=CONFIG):
    """(params, cache, inputs, prompts, accepted) of a variant: a zero cache whose rows
    all hold pending 1 (a verify replays), requests at slots 3 and 7."""
    B, layer = VARIANTS[variant]
    layers = None if layer is None else LAYERS
    params = draw.params(draw.key(1), config, layers=layers)
    cache = init_cache(config, num_slots, NUM_RECORDS, layers=layers)
    cache = dataclasses.replace(cache, pending=jnp.ones_like(cache.pending))
    slots = jnp.asarray([3, 7][:B], jnp.int32)
    rows = jnp.asarray([1, 4][:B], jnp.int32)
    inputs = draw.inputs(draw.key(2), config, slots, rows)
    rng = np.random.default_rng(3)
    bf16 = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
    H = CONFIG.heads
    prompts = PrefillInputs(bf16(B, PROMPT, 3, H, 128), bf16(B, PROMPT, 128), bf16(B, PROMPT, H),
                            bf16(B, PROMPT, H, 128), jnp.full((B,), PROMPT, jnp.int32),
                            slots, rows)
    return params, cache, inputs, prompts, jnp.ones((B,), jnp.int32)


def program(op, variant, config=CONFIG):
    """(jitted function donating the cache, how to call it from `arguments`, index of
    the cache's first leaf among its outputs)."""
    layer = VARIANTS[variant][1]

    def decode(params, cache, inputs, accepted):  # the runner's step: verify, accept
        out, cache = verify(params, cache, inputs, config, layer=layer)
        return out, accept(cache, inputs.record_rows, accepted, config)

    table = {
        "verify": (lambda p, c, i: verify(p, c, i, config, layer=layer), 1,
                   lambda p, c, i, pr, a: (p, c, i), 1),
        "decode": (decode, 1, lambda p, c, i, pr, a: (p, c, i, a), 1),
        "accept": (lambda c, rows, a: accept(c, rows, a, config), 0,
                   lambda p, c, i, pr, a: (c, i.record_rows, a), 0),
        "flush": (lambda p, c, slots, rows: flush(p, c, slots, rows, config), 1,
                  lambda p, c, i, pr, a: (p, c, i.slots, i.record_rows), 0),
        "prefill": (lambda p, c, pr: prefill(p, c, pr, config, layer=layer), 1,
                    lambda p, c, i, pr, a: (p, c, pr), 1),
    }
    function, donated, pick, first = table[op]
    return jax.jit(function, donate_argnums=donated), donated, pick, first


_COMPILED = {}


def compiled(draw, op, variant, num_slots, config=CONFIG):
    """(compiled program, its arguments, donated position, first cache output), once
    per module: each compile costs a second or more."""
    key = op, variant, num_slots, config
    if key not in _COMPILED:
        function, donated, pick, first = program(op, variant, config)
        args = pick(*arguments(draw, variant, num_slots, config))
        _COMPILED[key] = function.lower(*args).compile(), args, donated, first
    return _COMPILED[key]


ON_CPU = jax.default_backend() == "cpu"
# What XLA:CPU (jaxlib 0.10, 0.11) does that the library cannot avoid there (each a strict
# xfail: when a change of the library or of XLA removes one, the test says so). On
# other backends none of them is expected.
#
# jax_kda.cache_rows.write scatters into the bf16 window (and key_gates) as it is; XLA:CPU
# converts the whole buffer to f32, scatters, and converts it back (doing it on the
# uint16 bits instead still materializes two bitcast-converts of the whole buffer, and
# a bf16 dynamic-update-slice is upcast as well). O(S) per step; the timing checks
# below time it on its own.
BF16_UPCAST = pytest.mark.xfail(
    ON_CPU and jax.__version_info__ < (0, 11), strict=True,
    reason="XLA:CPU before jaxlib 0.11 converts a bf16 buffer to f32 and back around a "
           "scatter (O(S))")
# the verify gathers the old records from key_gates and scatters the new ones into
# it: XLA:CPU copies the buffer (R rows) first, and upcasts it as above.
KEY_GATES = pytest.mark.xfail(
    ON_CPU, strict=True,
    reason="XLA:CPU copies key_gates before the verify's scatter and upcasts it (O(R))")


def known(op, variant, field):
    """The strict xfail of (op, variant, field), or None."""
    if field == "conv" and op != "accept":
        return BF16_UPCAST
    if field == "key_gates" and op in ("verify", "decode"):
        return KEY_GATES
    return None


def hlo_cases():
    for op in OPS:
        for variant in VARIANTS:
            for field in FIELDS:
                mark = known(op, variant, field)
                yield pytest.param(op, variant, field, marks=[mark] if mark else [],
                                   id=f"{op}-{variant}-{field}")


@pytest.mark.parametrize("op, variant, field", list(hlo_cases()))
def test_no_whole_copy(draw, op, variant, field):
    executable, args, donated, first = compiled(draw, op, variant, SMALL)
    text = executable.as_text()
    buffer = getattr(args[donated], field)
    assert aliased(text, buffer, first + FIELDS.index(field)), f"cache.{field} not aliased"
    assert whole_copies(text, buffer) == []


@BF16_UPCAST
@pytest.mark.parametrize("op", ["verify", "flush", "prefill"])
def test_no_whole_copy_of_a_bf16_state(draw, op):
    """A bf16 state (KdaConfig.state_dtype) is written in place too, where XLA allows it:
    XLA:CPU upcasts it around the scatter as it does the window (BF16_UPCAST)."""
    config = dataclasses.replace(CONFIG, state_dtype=jnp.bfloat16)
    executable, args, donated, first = compiled(draw, op, "B2", SMALL, config)
    text = executable.as_text()
    state = args[donated].state
    assert aliased(text, state, first), "cache.state not aliased"
    assert whole_copies(text, state) == []


def pointers(cache):
    return {field: getattr(cache, field).unsafe_buffer_pointer() for field in FIELDS}


class Donating:
    """Calls a compiled donating program again and again on the cache it returned."""

    def __init__(self, executable, args, donated, first):
        self.executable, self.args = executable, list(args)
        self.donated, self.first = donated, first

    def __call__(self):
        result = self.executable(*self.args)
        cache = result[self.first] if isinstance(result, tuple) else result
        self.args[self.donated] = jax.block_until_ready(cache)
        return cache


WINDOW_READS = {"decode": True, "flush": True, "prefill": False}  # accept: no window


@functools.cache
def window_program(op, batch, layer):
    """The window's part of `op` on its own: the batch's rows of a donated window read
    (decode and flush read the history) and written back, with the helpers the verify,
    flush and prefill use (jax_kda.cache_rows), for as many rows as they update (they pad one
    request to two) and in as many layers (flush: every layer, vmapped as flush does).
    On XLA:CPU it is O(S) (BF16_UPCAST)."""
    slots = jnp.asarray([3, 7][:batch] if batch > 1 else [3, 0], jnp.int32)
    width = 3 if op != "decode" else CONFIG.tokens + 3

    def window_part(conv, layer):
        if WINDOW_READS[op]:
            values = cache_rows.read(conv, layer, slots)[..., ::-1][..., :width]
        else:
            values = jnp.ones(slots.shape + conv.shape[-4:-1] + (width,), conv.dtype)
        return cache_rows.write(conv, layer, (slots, ..., slice(0, width)), values)

    if layer is None:
        return jax.jit(lambda conv: window_part(conv, None), donate_argnums=0)
    if op == "flush":
        return jax.jit(jax.vmap(lambda conv: window_part(conv, None)), donate_argnums=0)
    return jax.jit(lambda conv: window_part(conv, jnp.int32(layer)), donate_argnums=0)


# Growth allowed from S = 17 to 1025, beyond the window's known round trip (timed on
# its own and subtracted), as a fraction of one pass over the larger (one layer's)
# state: 128 MiB read and written. Any whole pass over the state reads it at least
# once (>= ~50% of the yardstick; a copy or rewrite ~100%), while an O(B) step grows
# only by the cache misses of its rows. The window's f32 round trip on XLA:CPU
# (BF16_UPCAST: 6% of the state's bytes, converted and scattered) measured 25-120% of
# the yardstick on its own (the stacked window is converted whole), far too much to
# budget; what is left after subtracting it measured within +-10% (up to 21% while
# other processes held both cores). 30% leaves room for the difference of four noisy
# medians on a shared 2-core machine; a check passes if one of three attempts does
# (timing.least_of_attempts), which whole-buffer work, present in every one, cannot.
GROWTH = 0.3


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("op", ["decode", "accept", "flush", "prefill"])
def test_step_time_does_not_grow_with_slots(draw, op, variant):
    steps = {S: Donating(*compiled(draw, op, variant, S)) for S in (SMALL, LARGE)}
    large = steps[LARGE]
    before = pointers(large.args[large.donated])
    assert pointers(large()) == before, "the outputs are not in the donated buffers"
    one_pass = Repeated(yardstick_program(),
                        jnp.zeros((LARGE, CONFIG.heads, 128, 128), jnp.float32))
    windows = ([Repeated(window_program(op, *VARIANTS[variant]),
                         jnp.zeros_like(steps[S].args[steps[S].donated].conv))
                for S in (SMALL, LARGE)] if op in WINDOW_READS else [])
    excess, times = growth(steps[SMALL], large, one_pass, windows, GROWTH)
    assert excess < GROWTH, f"{op} {variant} at S = {SMALL} and {LARGE}: {times} ms"
    assert pointers(large()) == before
