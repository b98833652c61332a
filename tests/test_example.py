"""The speculative-decoding example at a tiny size: its tokens equal plain greedy decoding
with the stock per-token recurrence, its --layer-list path gives the same tokens as the
stacked one, its check notices a wrong token, and with --tp 2 (heads and projections
split over two devices) its tokens are still plain greedy decoding's."""
import importlib.util
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

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
LENGTHS = (1, 7, 2, 5, 3)


def decode(layer_list):
    """Five requests (prompt lengths 1..7) through a batch of two, so slots are reused
    and the last step has a padding row; returns (model, prompts, run)."""
    model = example.init_model(7, CONFIG)
    prompts = [np.random.default_rng(7).integers(0, CONFIG.vocab, n).tolist()
               for n in LENGTHS]
    engine = example.Engine(model, CONFIG, batch=2, max_prompt=max(LENGTHS), backend="jax",
                            layer_list=layer_list)
    return model, prompts, example.speculative_decode(engine, prompts, NEW_TOKENS)


@pytest.fixture(scope="module")
def decoded():
    return decode(layer_list=False)


def test_speculative_equals_stock_greedy(decoded):
    model, prompts, run = decoded
    verdict = example.check(model, CONFIG, prompts, run)
    assert [len(tokens) for tokens in run.tokens] == [NEW_TOKENS] * len(prompts)
    assert len(verdict.gap) == NEW_TOKENS * len(prompts)
    assert np.all(verdict.gap == 0), f"not greedy at {verdict.where[verdict.gap > 0]}"
    # No decision was a near-tie that happened to fall the same way.
    assert np.all(verdict.drift < verdict.margin)
    # Both outcomes of a verify happened: some drafts rejected, some accepted.
    assert 1 < run.accepted / run.row_steps < CONFIG.tokens


def test_layer_list_equals_stacked(decoded):
    _, _, stacked = decoded
    _, _, listed = decode(layer_list=True)
    assert listed.tokens == stacked.tokens
    assert (listed.steps, listed.accepted) == (stacked.steps, stacked.accepted)
    np.testing.assert_allclose(np.concatenate(listed.tops), np.concatenate(stacked.tops),
                               rtol=0, atol=1e-4)


def test_check_finds_a_wrong_token(decoded):
    model, prompts, run = decoded
    token = run.tokens[3][4]
    run.tokens[3][4] = (token + 1) % CONFIG.vocab
    try:
        verdict = example.check(model, CONFIG, prompts, run)
    finally:
        run.tokens[3][4] = token
    wrong = verdict.where[verdict.gap > example.TIE]
    assert wrong[:1].tolist() == [[3, 4]]


def test_tensor_parallel_equals_stock_greedy():
    """--tp 2 in a child process given four CPU devices (XLA fixes the count when JAX
    starts; the example wants more than the two it splits over): the cache split by
    heads, one all-reduce per KDA block and per MLP block, and every token plain greedy
    decoding's (the example's own check; exit status 1 otherwise); the roofline at the
    copy bandwidth given."""
    sizes = dict(vocab=64, dim=64, layers=2, heads=2, tokens=3, batch=2, requests=5,
                 new_tokens=9, max_prompt=7, backend="jax", tp=2, copy_bandwidth=100)
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=4"
    run = subprocess.run(
        [sys.executable, str(EXAMPLE)]
        + [f"--{k.replace('_', '-')}={v}" for k, v in sizes.items()],
        env=dict(os.environ, XLA_FLAGS=flags.strip(), JAX_PLATFORMS="cpu"),
        capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert "tensor parallel: 1 of 2 heads on each of 2 devices" in run.stdout, run.stdout
    assert "the decode step's all-reduces: 4 " in run.stdout, run.stdout
    assert "check: OK" in run.stdout, run.stdout
    assert " ms at 100.0 GB/s (--copy-bandwidth); " in run.stdout, run.stdout
