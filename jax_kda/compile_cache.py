"""The persistent compile caches, turned on by one call (`enable_compile_cache`), so that
a second process compiles nothing that an earlier one compiled: JAX's compilation cache
(XLA's executables, and on GPUs XLA's autotuning results) and the CuTe DSL kernels'
binaries.

CuTe DSL's own file cache does not serve the kernels: `cute.compile`, which both of
their bindings call, turns it off, and a hit there would still trace the kernel's
Python. The binaries are kept here instead (`stored`): the object file that the custom
call embeds (`jax_kda.ffi.lowering.for_xla`), one file per kernel key, read back by a
later lowering without tracing or compiling anything. A program's JAX cache key holds
its kernels' binaries, so the two caches hit together. `compile_kernels` builds a
program's kernels ahead, in parallel processes, into the same store (or behind: a
lowering then waits for the process of each kernel it needs).

The directory is trusted: what it holds is loaded as code. Keep it private.
"""
from __future__ import annotations

import atexit
import dataclasses
import functools
import hashlib
import os
import pathlib
import pickle
import shutil
import subprocess
import sys
import tempfile
import threading

import jax
from jax.experimental.compilation_cache import compilation_cache

_kernels: pathlib.Path | None = None  # the kernels' binaries, while the cache is on
_built: dict[str, bytes] = {}  # the binaries this process built, by key
_pending: dict[str, "_Job"] = {}  # kernels a `compile_kernels` process is compiling, by key
_finishing = threading.Lock()


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
    """build()'s bytes under `key`: those this process built or `compile_kernels` built
    for it, else while the cache is on those an earlier build stored, else built now and
    kept (on disk while the cache is on, written atomically: processes may share the
    directory). A kernel that a `compile_kernels` process is compiling is waited for."""
    job = _pending.get(key)
    if job is not None:
        _finish(job)
    if key in _built:
        return _built[key]
    file = _file(key)
    if file is not None and file.is_file():
        return file.read_bytes()
    data = build()
    _keep(key, data)
    return data


def compile_kernels(*programs, processes: int | None = None, wait: bool = True) -> int:
    """Compiles the CuTe DSL kernels that `programs` launch, in parallel processes, so
    that their lowering compiles none: the kernels' compiles hold Python's lock, and a
    prefill lowers three. programs: traced jitted functions (`jax.jit(f).trace(*args)`)
    or their jaxprs, every platform's branch searched. processes: at most this many at
    once (None: one a kernel, at most one a CPU). wait: False returns at once, the
    processes still compiling; a lowering that needs one of their kernels waits for
    that kernel's process alone (and raises its error), so a program can lower and
    compile while the other programs' kernels compile. A kernel in the cache (on disk,
    compiled by an earlier call, or compiling) is not compiled again; the binaries go
    where `stored` finds them, and to disk while the cache is on. Returns how many
    kernels it compiles."""
    if processes is not None and (not isinstance(processes, int) or processes < 1):
        raise ValueError(f"processes: expected None or an int >= 1, got {processes!r}")
    from jax_kda.ffi import lowering
    from jax_kda.kernels import compiled

    kernels = set()
    for program in programs:
        kernels |= lowering.kernels_called(getattr(program, "jaxpr", program))
    keyed = {compiled(kernel, binding=lowering.binary_key): kernel for kernel in kernels}
    todo = [key for key in keyed if not _holds(key) and key not in _pending]
    count = min(len(todo), processes or os.cpu_count() or 1)
    jobs = [_start({key: keyed[key] for key in todo[i::count]}) for i in range(count)]
    for job in jobs:
        _pending.update(dict.fromkeys(job.keys, job))
    if wait:
        for job in jobs:
            _finish(job)
    return len(todo)


@dataclasses.dataclass(eq=False)
class _Job:
    """A `compile_kernels` process: its folder (in: the kernels pickled, out: their
    (key, binary) pairs, err: its stderr), the keys it compiles, the process."""

    folder: pathlib.Path
    keys: list
    child: subprocess.Popen


def _start(kernels: dict) -> _Job:
    """A process compiling `kernels` ({key: kernel}), started."""
    folder = pathlib.Path(tempfile.mkdtemp())
    (folder / "in").write_bytes(pickle.dumps(list(kernels.values())))
    # the child imports what this process imported, from outside any source tree
    path = os.pathsep.join(entry or os.getcwd() for entry in sys.path)
    with open(folder / "err", "wb") as errors:
        child = subprocess.Popen(
            [sys.executable, "-c", _CHILD, str(folder)], stdout=subprocess.DEVNULL,
            stderr=errors, cwd=folder, env=dict(os.environ, PYTHONPATH=path))
    return _Job(folder, list(kernels), child)


def _finish(job: _Job) -> None:
    """Waits for a `compile_kernels` process and keeps its binaries; raises its error."""
    with _finishing:
        if job.keys[0] not in _pending:  # finished already, by another thread
            return
        job.child.wait()
        for key in job.keys:
            del _pending[key]
        try:
            if job.child.returncode:
                raise RuntimeError(f"compile_kernels: a kernel's compile failed (exit "
                                   f"{job.child.returncode}):\n"
                                   f"{(job.folder / 'err').read_text()[-4000:]}")
            for key, data in pickle.loads((job.folder / "out").read_bytes()):
                _keep(key, data)
        finally:
            shutil.rmtree(job.folder, ignore_errors=True)


@atexit.register
def _abandon() -> None:
    """At exit: the processes still compiling stopped, their folders removed."""
    for job in set(_pending.values()):
        job.child.kill()
        job.child.wait()
        shutil.rmtree(job.folder, ignore_errors=True)


_CHILD = "from jax_kda.compile_cache import _compile_job; _compile_job()"


def _compile_job():
    """A `compile_kernels` process: the kernels pickled in argv[1]/in compiled, their
    (key, binary) pairs pickled to argv[1]/out."""
    from jax_kda.ffi import lowering
    from jax_kda.kernels import compiled

    folder = pathlib.Path(sys.argv[1])
    kernels = pickle.loads((folder / "in").read_bytes())
    (folder / "out").write_bytes(pickle.dumps(
        [compiled(kernel, binding=lowering.binary) for kernel in kernels]))


def _file(key: str) -> pathlib.Path | None:
    return None if _kernels is None else _kernels / hashlib.sha256(key.encode()).hexdigest()


def _holds(key: str) -> bool:
    file = _file(key)
    return key in _built or (file is not None and file.is_file())


def _keep(key: str, data: bytes) -> None:
    """A binary kept for this process, and on disk while the cache is on."""
    _built[key] = data
    file = _file(key)
    if file is not None:
        partial = file.with_name(f"{file.name}.{os.getpid()}.partial")
        partial.write_bytes(data)
        os.replace(partial, file)


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
