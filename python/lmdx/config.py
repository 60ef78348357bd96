"""Thread defaults and a report of how lmdx was built and what it runs on this machine."""

from __future__ import annotations

import os
import sys
from typing import Any, TextIO

from . import _core

__all__ = ["config", "default_threads", "release_memory", "resolve_threads", "show_config"]

# GNU OpenMP (lmdx's runtime, and torch's) cannot start a parallel region in a child made by
# fork() once its parent has run one: the child waits for ever for pool threads that fork did
# not copy. So in a forked child lmdx runs its kernels on one thread, as torch's DataLoader
# does for torch in its workers (a parent's threads cannot be told apart from NumPy's BLAS
# pool, so every forked child is treated alike). Workers that want many threads: `spawn` or
# `forkserver`, or import lmdx after the fork.
_forked = False


def _after_fork_in_child() -> None:
    global _forked
    _forked = True


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def default_threads() -> int:
    """Threads used when ``n_threads`` is None: ``$LMDX_NUM_THREADS`` or the CPUs available
    (1 in a process made by ``fork()`` after lmdx was imported: see :func:`resolve_threads`)."""
    if _forked:
        return 1
    env = os.environ.get("LMDX_NUM_THREADS")
    if env:
        try:
            value = int(env)
        except ValueError:
            raise ValueError(f"LMDX_NUM_THREADS must be an integer, got {env!r}") from None
        if value < 1:
            raise ValueError(f"LMDX_NUM_THREADS must be >= 1, got {value}")
        return value
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def release_memory() -> None:
    """Free the memory the core keeps between calls: the kernels' scratch buffers and the
    large matrices of the RegMean solves, kept for the next layer of the same shapes (at
    most 1 GiB of them). Every merge (:func:`lmdx.merge_models`, :func:`lmdx.stream_merge`,
    ``lmdx merge``) frees it when it ends; after calling :func:`lmdx.regmean_merge_layer`
    yourself, call this to give the memory back."""
    _core.core.release_scratch()


def resolve_threads(n_threads: int | None) -> int:
    """The thread count for a call into the core: ``None`` is :func:`default_threads`; an
    integer must be >= 1 (the core enforces the same rule).

    In a process made by ``fork()`` after lmdx was imported, every count is 1: GNU OpenMP
    waits for ever there for the thread pool of the parent (lmdx's or torch's), which fork
    does not copy. Start workers with ``spawn`` or ``forkserver`` to use many threads.
    """
    if n_threads is None:
        return default_threads()
    if int(n_threads) < 1:
        raise ValueError(
            f"n_threads: must be >= 1, got {n_threads}; pass None for the default "
            "(lmdx.default_threads(): $LMDX_NUM_THREADS or the CPUs available)"
        )
    return 1 if _forked else int(n_threads)


def config() -> dict[str, Any]:
    """Build and runtime facts as a dict (see :func:`show_config`)."""
    core = _core.core
    features = _core.cpu_features()
    return {
        "version": core.__version__,
        "simd_path": core.isa(),
        "simd_forced": os.environ.get("LMDX_SIMD") or None,
        "built_paths": _core.built_variants(),
        "supported_paths": _core.supported_variants(),
        "cpu_features": [name for name, present in features.items() if present],
        "eigen": core.eigen_version(),
        "eigen_simd": core.eigen_simd(),
        "gram_tile": {k: f"{r}x{c}" for k, (r, c) in core.gram_tile().items()},
        "gram_paths": _core.gram_paths(),
        "compiler": core.compiler(),
        "openmp": core.has_openmp(),
        "profiled": core.profiled(),
        "default_threads": default_threads(),
        "python": sys.version.split()[0],
    }


def show_config(file: TextIO | None = None) -> None:
    """Print lmdx's version, SIMD path, OpenMP and thread settings."""
    out = file or sys.stdout
    for key, value in config().items():
        if isinstance(value, list):
            value = ", ".join(value) if value else "-"
        elif isinstance(value, dict):
            value = ", ".join(f"{k} {v}" for k, v in value.items())
        print(f"{key:>16}: {value}", file=out)
