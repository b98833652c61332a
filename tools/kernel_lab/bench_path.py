"""Puts benchmarks/ on sys.path: the lab's scripts use the product benchmark's harness
(`measure`, `peers`, `graphs`); the product never imports the lab."""
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))
