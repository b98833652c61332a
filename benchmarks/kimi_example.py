"""The example's model at Kimi-Linear's size, for the benchmarks that time it
(`compile_time.py`, `step_kernels.py`): the example loaded as a module, the flags that
size its model, and the config they give."""
from __future__ import annotations

import argparse
import pathlib
import sys

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "speculative_decoding.py"


def load_example():
    """The example as a module (examples/ is not a package: its folder on sys.path)."""
    sys.path.insert(0, str(EXAMPLE.parent))
    import speculative_decoding
    return speculative_decoding


def add_size_flags(parser: argparse.ArgumentParser, batch: int) -> None:
    """The model's and the batch's flags, Kimi-Linear's KDA layers by default."""
    parser.add_argument("--layers", type=int, default=20)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--dim", type=int, default=2304)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=4)
    parser.add_argument("--batch", type=int, default=batch)
    parser.add_argument("--max-prompt", type=int, default=512)


def model_config(example, args):
    """The example's `ModelConfig` of the flags of `add_size_flags`."""
    return example.ModelConfig(vocab=args.vocab, dim=args.dim, layers=args.layers,
                               heads=args.heads, tokens=args.tokens)
