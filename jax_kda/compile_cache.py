"""The persistent compile caches, turned on by one call (`enable_compile_cache`), so that
a second process compiles nothing that an earlier one compiled: JAX's compilation cache
(XLA's executables, and on GPUs XLA's autotuning results) and the CuTe DSL kernels'
binaries.

CuTe DSL's own file cache does not serve the kernels: `cute.compile`, which both of
their bindings call, turns it off, and a hit there would still trace the kernel's
Python. The binaries are kept here instead (`stored`): the object file that the custom
call embeds (`jax_kda.ffi.lowering.for_xla`), one file per kernel key, read back by a
later lowering without tracing or compiling anything. A program's JAX cache key holds
its kernels' binaries, so the two caches hit together.

The directory is trusted: what it holds is loaded as code. Keep it private.
"""
from __future__ import annotations

import functools
import hashlib
import os
import pathlib

import jax
from jax.experimental.compilation_cache import compilation_cache

_kernels: pathlib.Path | None = None  # the kernels' binaries, while the cache is on


def default_directory() -> pathlib.Path:
    """$XDG_CACHE_HOME/jax_kda, or ~/.cache/jax_kda."""
    root = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
    return pathlib.Path(root) / "jax_kda"


def enable_compile_cache(path: str | os.PathLike | None = None) -> pathlib.Path:
    """Turns on the persistent compile caches in `path` (None: `default_directory()`)
    for the rest of the process: JAX's compilation cache in path/xla, every program
    cached however small or quick to compile, and the CuTe DSL kernels' binaries in
    path/kernels. Call it before the first compile; a later call moves both caches.
    Returns the directory."""
    directory = pathlib.Path(path) if path is not None else default_directory()
    kernels = directory / "kernels"
    kernels.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(directory / "xla"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    compilation_cache.reset_cache()  # the directory takes effect at the next compile
    global _kernels
    _kernels = kernels
    return directory


def stored(key: str, build) -> bytes:
    """build()'s bytes, kept under `key` while the cache is on: read back where an
    earlier build stored them, else built and stored (atomically: processes may share
    the directory). Without the cache, build()."""
    if _kernels is None:
        return build()
    file = _kernels / hashlib.sha256(key.encode()).hexdigest()
    if file.is_file():
        return file.read_bytes()
    data = build()
    partial = file.with_name(f"{file.name}.{os.getpid()}.partial")
    partial.write_bytes(data)
    os.replace(partial, file)
    return data


@functools.lru_cache(maxsize=None)
def source_digest() -> str:
    """A digest of jax_kda's Python source (the package with its kernels and ffi/), part
    of every kernel's key: a binary built from other code is never read back."""
    import jax_kda
    import jax_kda.ffi

    digest = hashlib.sha256()
    for package in (jax_kda, jax_kda.ffi):
        for folder in map(pathlib.Path, package.__path__):
            for file in sorted(folder.rglob("*.py")):
                digest.update(f"{package.__name__}/{file.relative_to(folder)}".encode())
                digest.update(file.read_bytes())
    return digest.hexdigest()
