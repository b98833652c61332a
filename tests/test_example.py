"""The speculative-decoding example at a tiny size: its tokens equal plain greedy decoding
with the stock per-token recurrence (prompts longer than a prefill piece resuming from
the cache), and so do its tree drafter's (accepted along the walk a runner would take,
through top-2 drafts at times; --draft both runs both), its prefill computes the
admitted prompts' pieces only, one block's program called once a layer where its decode
step runs the blocks in a straight line, its --layer-list path gives the same tokens as
the stacked one, its check notices a wrong token, with --tp 2 (heads and projections
split over two devices) its tokens are still plain greedy decoding's, with --state-dtype
bfloat16 its states are bf16 and its tokens greedy decoding's up to that state's ties,
and a second run loads every program from the compile cache."""
import dataclasses
import functools
import importlib.util
import os
import pathlib
import re
import subprocess
import sys
import threading

import jax
import numpy as np
import pytest

import jax_kda
from tree_shapes import SHAPES, tree_of

EXAMPLE = pathlib.Path(__file__).parent.parent / "examples" / "speculative_decoding.py"


def load_example():
    """examples/ is not a package: the module by path (registered, as dataclasses need)."""
    spec = importlib.util.spec_from_file_location("speculative_decoding", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


example = load_example()
# Two layers, so that the stacked path's layer index and the scan carry are exercised.
CONFIG = example.ModelConfig(vocab=64, dim=64, layers=2, heads=1, tokens=3)
NEW_TOKENS = 9
LENGTHS = (1, 37, 2, 17, 3)
PIECE = 16  # prompts of 17 and 37 tokens take 2 and 3 prefill pieces


def decode(layer_list, config=CONFIG):
    """Five requests (prompt lengths 1..37) through a batch of two, so slots are reused
    and the last step has a padding row; returns (model, prompts, run, engine)."""
    model = example.init_model(7, config)
    prompts = [np.random.default_rng(7).integers(0, config.vocab, n).tolist()
               for n in LENGTHS]
    engine = example.Engine(model, config, batch=2, max_prompt=max(LENGTHS), backend="jax",
                            layer_list=layer_list, piece=PIECE)
    return model, prompts, example.speculative_decode(engine, prompts, NEW_TOKENS), engine


@pytest.fixture(scope="module")
def decoded():
    return decode(layer_list=False)


def test_speculative_equals_stock_greedy(decoded):
    model, prompts, run, _ = decoded
    verdict = example.check(model, CONFIG, prompts, run)
    assert [len(tokens) for tokens in run.tokens] == [NEW_TOKENS] * len(prompts)
    assert len(verdict.gap) == NEW_TOKENS * len(prompts)
    assert np.all(verdict.gap == 0), f"not greedy at {verdict.where[verdict.gap > 0]}"
    # No decision was a near-tie that happened to fall the same way.
    assert np.all(verdict.drift < verdict.margin)
    # Both outcomes of a verify happened: some drafts rejected, some accepted.
    assert 1 < run.accepted / run.row_steps < CONFIG.tokens


def test_tree_drafts_equal_stock_greedy(monkeypatch):
    """The tree drafter at T = 8 (the bigram's chain of 6 with its top-2 token beside the
    first two levels): every token plain greedy decoding's, and live requests' accepted
    paths (what `accept` got) went through a top-2 node at times, which no chain of
    drafts holds."""
    tree = dataclasses.replace(CONFIG, tokens=8, tree=True)
    depth = tree.tokens - tree.tokens // 4  # nodes depth.. are the top-2 siblings
    branched = []

    def record(path, accepted, record_rows):
        branched.extend(bool(np.any(p[:a] >= depth))
                        for p, a, row in zip(path, accepted, record_rows) if row >= 0)

    def watched(cache, record_rows, accepted, config, *, path=None):
        jax.debug.callback(record, path, accepted, record_rows)
        return accept(cache, record_rows, accepted, config, path=path)

    accept = jax_kda.accept
    monkeypatch.setattr(jax_kda, "accept", watched)
    model, prompts, run, _ = decode(layer_list=False, config=tree)
    verdict = example.check(model, tree, prompts, run)
    assert [len(tokens) for tokens in run.tokens] == [NEW_TOKENS] * len(prompts)
    assert np.all(verdict.gap == 0), f"not greedy at {verdict.where[verdict.gap > 0]}"
    assert np.all(verdict.drift < verdict.margin)
    assert 1 < run.accepted / run.row_steps < tree.tokens
    assert any(branched) and not all(branched), branched


def walked_path(parents, tokens, target):
    """The accepted nodes by hand: from node 0, the first child whose token is the
    target's argmax after the node, while there is one."""
    path = [0]
    while children := [c for c in range(1, len(parents))
                       if parents[c] == path[-1] and tokens[c] == target[path[-1]]]:
        path.append(children[0])
    return path


@pytest.mark.parametrize("shape", SHAPES)
def test_longest_path_is_the_greedy_walk(shape):
    """`longest_path` against a walk down the tree by hand, on trees of every shape and
    random tokens of a vocabulary of 3 (so that paths of several lengths occur, and
    siblings of one token, where the first is taken): its first `accepted` entries are
    the walk's nodes."""
    rng = np.random.default_rng()
    batch, tokens = 64, 8
    parents = np.asarray(tree_of(shape, rng, 1, tokens))[0]
    drafts = rng.integers(0, 3, (batch, tokens)).astype(np.int32)
    target = rng.integers(0, 3, (batch, tokens)).astype(np.int32)
    path, accepted = map(np.asarray, example.longest_path(tuple(parents), drafts, target))
    walks = [walked_path(parents, d, t) for d, t in zip(drafts, target)]
    assert [list(p[:a]) for p, a in zip(path, accepted)] == walks
    assert len({len(w) for w in walks}) > 1, walks


def test_prefill_computes_the_admitted_pieces(decoded):
    """Each prompt went through in pieces of at most PIECE tokens (the long ones, and
    those cut short, resuming), packed in calls of at most the batch's two rows, each
    call computing one piece's positions: never a row as wide as the longest prompt."""
    _, _, _, engine = decoded
    assert engine.resumes and engine.piece == PIECE
    assert engine.tokens(1) == engine.tokens(2) == PIECE
    assert engine.prefill_positions == PIECE * engine.prefill_calls
    assert -(-sum(LENGTHS) // PIECE) <= engine.prefill_calls < sum(LENGTHS) // 2
    assert set(engine.prefills) <= {1, 2} == set(engine.prefill_shapes)


def test_prefill_packs_the_pieces(decoded, monkeypatch):
    """Four prompts into a batch of four: each call's tokens are its rows' pieces one
    after another (a call of R rows computing R * PIECE / 2 positions), each row reads
    its piece's positions and each position finds its row's place; the pieces of a row
    put together are its prompt, all but the first resuming; each prompt's first new
    token is the stock recurrence's greedy choice after it."""
    model, _, _, _ = decoded
    rng = np.random.default_rng()
    texts = [rng.integers(1, CONFIG.vocab, n).tolist() for n in (5, 30, 2, 17)]
    engine = example.Engine(model, CONFIG, batch=4, max_prompt=30, backend="jax",
                            piece=PIECE)
    calls, call = [], engine._prefill_call
    monkeypatch.setattr(engine, "_prefill_call", lambda programs, *args: (
        calls.append(args) or call(programs, *args)))
    first, _ = engine.prefill(texts)
    seen = [[] for _ in texts]
    for tokens, where, origin, lengths, resume, slots, _ in calls:
        rows, width = where.shape
        assert width == PIECE and len(tokens) == engine.tokens(rows) == PIECE * rows // 2
        for b in range(rows):
            n = lengths[b]
            assert np.all(where[b, n:] == len(tokens))
            assert np.array_equal(origin[where[b, :n]], b * width + np.arange(n))
            if slots[b] > 0:
                assert resume[b] == (len(seen[slots[b] - 1]) > 0)
                seen[slots[b] - 1] += tokens[where[b, :n]].tolist()
            else:
                assert n == 0
    assert seen == texts
    assert len(calls) < sum(-(-len(text) // PIECE) for text in texts)
    # Each first token is greedy decoding's after its whole prompt, by the stock per-token
    # recurrence; a different token only at a tie (stock logits within TIE: FP32 sums
    # ordered differently by the pieces).
    ends = np.array([len(text) for text in texts])
    _, margin, gap = example.stock_greedy(
        model, example.padded([t + [int(f)] for t, f in zip(texts, first)], 32), ends + 1,
        config=CONFIG)
    margin, gap = (np.asarray(a)[np.arange(len(texts)), ends - 1] for a in (margin, gap))
    assert np.all(np.isfinite(gap)) and np.all(gap <= example.TIE)
    assert np.all(gap[margin > example.TIE] == 0)


def test_kernels_compiled_ahead_and_the_first_prefill_traced_once(decoded, monkeypatch):
    """Where the kernels run, the engine hands its decode step and its prefill, traced at
    a full batch's rows, to `jax_kda.compile_kernels` without waiting for them, and
    lowers that trace at the first prefill of those rows; the run is the same (the
    kernels stand in for XLA here)."""
    model, prompts, run, _ = decoded
    handed = []
    monkeypatch.setattr(example.jax_kda, "cutedsl_supported", lambda: True)
    monkeypatch.setattr(example.jax_kda, "compile_kernels", lambda *programs, wait: (
        handed.extend(programs) or (3 if wait is False else 0)))
    engine = example.Engine(model, CONFIG, batch=2, max_prompt=max(LENGTHS), backend="auto",
                            piece=PIECE)  # "auto": XLA on the CPU
    assert engine.kernels == 3 and len(handed) == 2
    assert (2, PIECE) in [a.shape for a in handed[1].jaxpr.in_avals]  # the rows' places
    assert list(engine._traced) == [2]
    again = example.speculative_decode(engine, prompts, NEW_TOKENS)
    assert engine._traced == {} and 2 in engine.prefills
    assert again.tokens == run.tokens


def test_time_decode_traces_the_full_batch_prefill(decoded):
    """The GPU report's timing: a full batch prefilled (prompts cycled) and counted, then
    the decode steps; on the CPU the profiler traces no GPU activity."""
    model, prompts, _, _ = decoded
    engine = example.Engine(model, CONFIG, batch=2, max_prompt=max(LENGTHS), backend="jax",
                            piece=PIECE)
    wall, traced, prefilled = example.time_decode(engine, prompts, 2)
    assert wall > 0 and traced["steps"] == 0 and prefilled["steps"] == 0
    assert prefilled["tokens"] == LENGTHS[0] + LENGTHS[1]
    assert prefilled["calls"] == engine.prefill_calls == -(-LENGTHS[1] // PIECE)
    assert prefilled["positions"] == engine.prefill_positions >= prefilled["tokens"]


def test_prefill_compiled_ahead_in_threads(decoded, monkeypatch):
    """With compile_threads, every prefill row count compiles in those threads while the
    engine compiles its decode step; the first prefill waits for them all and runs each
    once on padding rows (slot 0, no record row: every request's slot and record row
    stay as they were); a call takes the fewest rows that hold its prompts (a lone
    prompt one row, where a lazy engine reuses its compiled two); the tokens are still
    plain greedy decoding's."""
    model, prompts, _, _ = decoded
    compiled, compile_prefill = [], example.Engine._compile_prefill
    monkeypatch.setattr(example.Engine, "_compile_prefill", lambda self, rows: (
        compiled.append((rows, threading.current_thread())) or compile_prefill(self, rows)))
    engine = example.Engine(model, CONFIG, batch=2, max_prompt=max(LENGTHS), backend="jax",
                            piece=PIECE, compile_threads=2)
    assert sorted(engine._ahead) == engine.prefill_shapes == [1, 2]
    calls, call = [], engine._prefill_call
    monkeypatch.setattr(engine, "_prefill_call", lambda programs, *args: (
        calls.append(args) or call(programs, *args)))
    before = jax.tree.map(np.array, engine.cache)
    engine._compiled_prefill(2)
    assert sorted(engine.prefills) == [1, 2] and not engine._ahead
    assert sorted(len(slots) for *_, slots, _ in calls) == [1, 2]
    assert all(np.all(slots == 0) and np.all(rows == -1) for *_, slots, rows in calls)
    after = jax.tree.map(np.array, engine.cache)
    for name in ("state", "conv"):  # [L, S, ...]: slot 0 is padding's
        np.testing.assert_array_equal(getattr(after, name)[:, 1:], getattr(before, name)[:, 1:])
    for name in ("corrections", "key_gates", "pending"):
        np.testing.assert_array_equal(getattr(after, name), getattr(before, name))
    run = example.speculative_decode(engine, prompts, NEW_TOKENS)
    assert sorted(rows for rows, _ in compiled) == [1, 2]
    assert all(thread is not threading.main_thread() for _, thread in compiled)
    assert 1 in [len(slots) for *_, slots, _ in calls[2:]]  # the lone prompt's call
    verdict = example.check(model, CONFIG, prompts, run)
    assert np.all(np.isfinite(verdict.gap)) and np.all(verdict.gap <= example.TIE)
    assert np.all(verdict.gap[verdict.margin > example.TIE] == 0)


@pytest.mark.parametrize("requested, backend, cores, threads", [
    (None, "gpu", 16, 4), (None, "gpu", 2, 0), (None, "cpu", 16, 0), (3, "cpu", 2, 3),
    (0, "gpu", 16, 0)])
def test_compile_threads(requested, backend, cores, threads, monkeypatch):
    """One thread per CORES_PER_COMPILE host cores beside an accelerator, none on the CPU
    by default; a request wins."""
    monkeypatch.setattr(example.jax, "default_backend", lambda: backend)
    monkeypatch.setattr(example.os, "cpu_count", lambda: cores)
    assert example.compile_threads(requested) == threads


@pytest.mark.parametrize("prompts, batch, compiled, rows", [
    (1, 1, (), 1), (3, 16, (), 4), (5, 16, (), 8), (9, 10, (), 10),
    (5, 16, (16,), 16), (3, 16, (16,), 4), (1, 4, (4,), 4), (2, 16, (1, 4, 16), 4)])
def test_prefill_rows(prompts, batch, compiled, rows):
    """A power of two at most the batch, or a compiled row count up to 4x the prompts."""
    assert example.prefill_rows(prompts, batch, compiled) == rows


class Counted:
    """A compiled program that records the first argument of each call."""

    def __init__(self, compiled):
        self.compiled, self.input_shardings, self.firsts = compiled, compiled.input_shardings, []

    def __call__(self, first, *args):
        self.firsts.append(first)
        return self.compiled(first, *args)


@pytest.mark.parametrize("layer_list", [False, True])
def test_the_prefill_runs_one_block_program_a_layer(layer_list, monkeypatch):
    """A prefill call runs its one compiled block once a layer, in order, on that layer's
    own weights (the very arrays of the model: none stacked or copied) with the stacked
    KDA params and the layer's index, or (per-layer) its own; the decode step's blocks
    run in a straight line (no scan at its top)."""
    model = example.init_model(3, CONFIG)
    engine = example.Engine(model, CONFIG, batch=2, max_prompt=8, backend="jax",
                            layer_list=layer_list, piece=PIECE)
    programs = engine._compiled_prefill(1)
    block = Counted(programs.block)
    monkeypatch.setitem(engine.prefills, 1, programs._replace(block=block))
    engine.prefill([[1, 2, 3], []])
    assert len(block.firsts) == CONFIG.layers
    for i, (weights, kda) in enumerate(block.firsts):
        assert weights.w_up is engine.model.blocks[i].w_up
        assert kda is (engine.model.blocks[i].kda if layer_list else engine.model.kda)
    assert [layer for _, layer in engine._layers] == (
        [None] * CONFIG.layers if layer_list else list(range(CONFIG.layers)))
    decode = jax.make_jaxpr(functools.partial(example.decode_step, config=CONFIG,
                                              backend="jax"))(
        engine.model, engine.cache, np.zeros(2, np.int32), *example.indices(np.arange(2)))
    assert not [eqn for eqn in decode.jaxpr.eqns if eqn.primitive.name == "scan"]


def test_layer_list_equals_stacked(decoded):
    _, _, stacked, _ = decoded
    _, _, listed, _ = decode(layer_list=True)
    assert listed.tokens == stacked.tokens
    assert (listed.steps, listed.accepted) == (stacked.steps, stacked.accepted)
    np.testing.assert_allclose(np.concatenate(listed.tops), np.concatenate(stacked.tops),
                               rtol=0, atol=1e-4)


def test_check_finds_a_wrong_token(decoded):
    model, prompts, run, _ = decoded
    token = run.tokens[3][4]
    run.tokens[3][4] = (token + 1) % CONFIG.vocab
    try:
        verdict = example.check(model, CONFIG, prompts, run)
    finally:
        run.tokens[3][4] = token
    wrong = verdict.where[verdict.gap > example.TIE]
    assert wrong[:1].tolist() == [[3, 4]]


def run_example(*flags, env=()):
    """The example in a child process at a tiny size, on the CPU; its stdout."""
    sizes = dict(vocab=64, dim=64, layers=2, heads=2, tokens=3, batch=2, requests=5,
                 new_tokens=9, max_prompt=7, backend="jax")
    run = subprocess.run(
        [sys.executable, str(EXAMPLE)]
        + [f"--{k.replace('_', '-')}={v}" for k, v in sizes.items()] + list(flags),
        env=dict(os.environ, JAX_PLATFORMS="cpu", **dict(env)),
        capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    return run.stdout


def test_tensor_parallel_equals_stock_greedy(tmp_path):
    """--tp 2 in a child process given four CPU devices (XLA fixes the count when JAX
    starts; the example wants more than the two it splits over): the cache split by
    heads, one all-reduce per KDA block and per MLP block, and every token plain greedy
    decoding's (the example's own check; exit status 1 otherwise); the roofline at the
    copy bandwidth given. With --no-compile-cache nothing is written to the default cache
    directory."""
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=4"
    out = run_example("--tp=2", "--copy-bandwidth=100", "--no-compile-cache",
                      env={"XLA_FLAGS": flags.strip(), "XDG_CACHE_HOME": str(tmp_path)})
    assert "tensor parallel: 1 of 2 heads on each of 2 devices" in out, out
    assert "the decode step's all-reduces: 4 " in out, out
    assert "check: OK" in out, out
    assert "compile cache off" in out and not any(tmp_path.iterdir()), out
    assert " ms at 100.0 GB/s (--copy-bandwidth); " in out, out


def test_prefill_piece_flag():
    """--prefill-piece 16: prompts of up to 40 tokens go in pieces of 16, the longer ones
    resuming (pieces of 48 tokens without it), and the tokens are still greedy
    decoding's."""
    out = run_example("--max-prompt=40", "--prefill-piece=16", "--no-compile-cache")
    assert "1 x 16 (16 tokens), 2 x 16 (16 tokens)" in out and "check: OK" in out, out


def test_draft_both_flag():
    """--draft both --tokens 4: the chain's run and the tree's (parents [-1, 0, 1, 0]: a
    chain of 3 with the top-2 token beside its first level) on the same prompts, and both
    means printed (the tree's tokens are checked above)."""
    out = run_example("--draft=both", "--tokens=4", "--no-compile-cache", "--no-check")
    assert "draft chain: the last token and 3 drafts" in out, out
    assert "draft tree: parents [-1, 0, 1, 0]" in out, out
    assert re.search(r"mean accepted tokens per request per step: chain \d\.\d\d, "
                     r"tree \d\.\d\d \(T=4\)", out), out


def test_bf16_state_flag():
    """--state-dtype bfloat16: the KDA states in bf16, half the roofline's state bytes
    (2 layers x 2 heads x 128 x 128 x 2 bytes, 2 rows read and written: 0.5 MB against
    FP32's 1.0), and the tokens greedy decoding's up to the bf16 state's ties."""
    out = run_example("--state-dtype=bfloat16", "--no-compile-cache")
    assert ", bfloat16 states; " in out and "read and written (0.5 MB)" in out, out
    assert "check: OK" in out, out


def test_a_second_run_starts_warm(tmp_path):
    """--compile-cache DIR: the first run compiles its steps and stores them there, the
    second loads every one of them."""
    first = run_example("--no-check", f"--compile-cache={tmp_path}")
    second = run_example("--no-check", f"--compile-cache={tmp_path}")
    assert "; cold start: 0 of " in first and any((tmp_path / "xla").iterdir()), first
    loaded = re.search(r"; warm start: (\d+) of (\d+) XLA programs", second)
    assert loaded and loaded[1] == loaded[2] != "0", second
