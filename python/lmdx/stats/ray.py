"""RegMean statistics collected by several processes or machines with Ray (``lmdx[ray]``).

:func:`collect_regmean_stats_ray` splits a list of batches into contiguous shards, runs
:func:`lmdx.stats.collect.collect_regmean_stats` on each shard in a Ray task that loads the
model once, and adds the partial statistics in float64 on the driver. Grams, sums and
counts are sums over rows, so the result is the single-process one up to the order of
the float64 additions (≤ 1e-12 relative; not bit for bit): every batch is run whole by one
worker, with the same padding and the same rows as in one process.

That holds when both runs see the same activations. Torch's CPU kernels may round
differently with a different number of intra-op threads; each worker runs torch with
``threads_per_worker`` threads, so compare with a single process that uses as many
(otherwise the Grams differ at the float32 rounding level of the forward pass, as two
single-process runs with different thread counts do).

Ray is imported only when the function is called; ``import lmdx`` never imports it.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from .. import _ray
from .._errors import ModelMismatchError, RayClusterError
from .._util import progress_bar
from ..files.hf import load_model
from .add import add_statistics
from .collect import collect_regmean_stats
from .collector import accumulation_option
from .file import Statistics

__all__ = ["collect_regmean_stats_ray", "shard_bounds", "shard_partial"]

#: ``collect_regmean_stats`` arguments not accepted in ``collect_kwargs``, and why.
_RESERVED = {
    "progress": "the workers never show one; pass progress= to this function",
    "n_threads": "pass threads_per_worker= (threads of each worker)",
    "out": "the workers return their shards to this process; save the result with .save()",
    "max_memory": "it bounds a file-backed collection (out=), which the workers do not do",
    "max_shard_size": "it shards a file-backed collection (out=), which the workers do not do",
}


def shard_bounds(n: int, k: int) -> list[tuple[int, int]]:
    """``k`` contiguous ``(start, stop)`` ranges covering ``range(n)``, sizes differing ≤ 1.

    The first ``n % k`` shards are one batch longer. ``k`` must be ≤ ``n``.
    """
    if not 1 <= k <= n:
        raise ValueError(f"shard_bounds: need 1 <= k <= n, got k={k}, n={n}")
    size, extra = divmod(n, k)
    bounds, start = [], 0
    for i in range(k):
        stop = start + size + (1 if i < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


class _LoadFailed(RuntimeError):
    """The model could not be loaded (or built) in a worker; the message says why."""


def _load(model: str | Callable[[], Any]) -> Any:
    if callable(model):
        return model()
    if not (Path(model) / "config.json").is_file():
        node = _ray.import_ray().util.get_node_ip_address()
        raise _LoadFailed(
            f"the model folder {model} is not on Ray node {node}: "
            "every node must see it at this path (a shared filesystem, or a copy there), "
            "or pass a model factory"
        )
    return load_model(model, progress=False)


def _collect_shard(
    model: str | Callable[[], Any], threads: int, batches: list[Any], kwargs: Mapping[str, Any]
) -> Statistics:
    """One shard's statistics (a Ray task): metadata and packed float64 arrays."""
    import torch

    torch.set_num_threads(threads)
    try:
        module = _load(model)
    except _LoadFailed:
        raise
    except Exception as exc:
        raise _LoadFailed(f"loading the model failed: {type(exc).__name__}: {exc}") from None
    if not hasattr(module, "named_modules"):
        raise _LoadFailed(
            f"the model factory returned a {type(module).__name__}, not a torch module"
        )
    return shard_partial(module, threads, batches, kwargs)


def shard_partial(
    module: Any, threads: int, batches: list[Any], kwargs: Mapping[str, Any]
) -> Statistics:
    """The statistics of ``batches`` on ``module`` as a shard's plain data (metadata and
    packed float64 arrays in memory, no file), what a worker sends back to be added on the
    driver."""
    stats = collect_regmean_stats(module, batches, progress=False, n_threads=threads, **kwargs)
    return stats.rebuilt({spec.name: stats.packed(spec.name) for spec in stats.specs()})


def _check_collect_kwargs(kwargs: Mapping[str, Any]) -> None:
    for name, hint in _RESERVED.items():
        if name in kwargs:
            raise TypeError(f"collect_regmean_stats_ray: {name}= is not passed on; {hint}")
    accepted = inspect.signature(collect_regmean_stats).parameters
    unknown = sorted(set(kwargs) - set(accepted))
    if unknown:
        raise TypeError(
            f"collect_regmean_stats_ray: unknown argument(s) {unknown} for collect_regmean_stats"
        )


def _model_spec(model: Any, local: bool) -> str | Callable[[], Any]:
    if isinstance(model, (str, os.PathLike)):
        path = Path(model).expanduser().absolute()  # workers may run in another folder
        if local and not (path / "config.json").is_file():
            raise ValueError(
                f"model {model}: no config.json; expected a save_pretrained folder, or pass a "
                "zero-argument callable that returns the model"
            )
        return str(path)
    if callable(model) and not hasattr(model, "named_modules"):
        return model  # type: ignore[no-any-return]
    raise TypeError(
        "collect_regmean_stats_ray: model must be a save_pretrained folder or a "
        f"zero-argument callable returning a torch module, got {type(model).__name__} (a "
        "model object would be pickled to every worker; pass its folder or a factory)"
    )


def _add_partials(
    partials: Sequence[Statistics],
    bounds: Sequence[tuple[int, int]],
    threads_per_worker: int,
) -> Statistics:
    """The partials' sum in shard order, after checking they describe one model."""
    n = bounds[-1][1]
    names = [f"shard {i + 1} (batches {a}..{b - 1})" for i, (a, b) in enumerate(bounds)]
    parts = [
        p.rebuilt({spec.name: p.packed(spec.name) for spec in p.specs()}, source=name)
        for p, name in zip(partials, names, strict=True)
    ]
    try:
        total = add_statistics(parts, data=parts[0].data)
    except ModelMismatchError as exc:
        raise ModelMismatchError(
            f"{exc}. The workers loaded different models: a model factory must return the "
            "same weights in every process (seed it, or load saved weights)"
        ) from None
    # materialize once: every tensor summed in float64, shard 1 + shard 2 + ...
    tensors = {spec.name: total.tensor(spec.name) for spec in total.specs()}
    extra = dict(parts[0].extra)
    if all("batches" in p.extra for p in parts):
        extra["batches"] = sum(int(p.extra["batches"]) for p in parts)
    extra["ray"] = {
        "workers": len(bounds),
        "threads_per_worker": threads_per_worker,
        "shards": [[a, b] for a, b in bounds],
        "batches": n,
    }
    return total.rebuilt(tensors, extra=extra)


def collect_regmean_stats_ray(
    model: str | os.PathLike[str] | Callable[[], Any],
    batches: Iterable[Any],
    *,
    address: str | None = None,
    num_workers: int = 2,
    threads_per_worker: int = 1,
    progress: bool = True,
    **collect_kwargs: Any,
) -> Statistics:
    """:func:`lmdx.stats.collect.collect_regmean_stats` over ``num_workers`` Ray workers.

    Parameters
    ----------
    model
        A ``save_pretrained`` folder (each worker loads it with
        :func:`lmdx.files.hf.load_model`; on a cluster the path must exist on every node, and
        with ``address=None`` also here, where it is checked first), or a
        zero-argument callable that returns the torch model (pickled by Ray and called once
        in every worker; it must return the same weights every time).
    batches
        The batches (dicts of tensors, e.g. from :func:`lmdx.data.batches.text_batches`), all of
        them: they are split into ``num_workers`` contiguous shards of whole batches
        (shard sizes differ by at most one batch; fewer workers when there are fewer
        batches) and shipped to the workers as they are, so rows and padding are those of a
        single-process run.
    address
        ``None``: use the running Ray if ``ray.init`` was called already, otherwise start a
        new local one (``num_workers × threads_per_worker`` CPUs, no dashboard; neither
        ``RAY_ADDRESS`` nor a ``ray start`` cluster is joined) and shut it down at the end.
        ``"auto"`` (``RAY_ADDRESS`` or the ``ray start`` cluster of this machine),
        ``"ray://host:port"`` or ``"host:port"``: connect to that cluster and disconnect at
        the end. If ``ray.init`` was called already, that connection is used as it is.
    num_workers
        Shards, each collected by one Ray task that loads the model once. The tasks run as
        CPUs free up: more workers than CPUs only take longer.
    threads_per_worker
        CPUs each task reserves: its lmdx ``n_threads`` and torch's intra-op threads.
    progress
        Show a progress bar over finished shards.
    **collect_kwargs
        Passed on to :func:`lmdx.stats.collect.collect_regmean_stats` (``include``, ``exclude``,
        ``include_padding``, ``share_inputs``, ``mask_key``, ``accumulation``,
        ``description``; the deprecated ``precision`` is read as ``accumulation``);
        ``progress`` and ``n_threads`` are set by this function, and the file-backed
        collection (``out``, ``max_memory``, ``max_shard_size``) is not available: each
        worker holds its shard's accumulators in memory.

    Returns
    -------
    Statistics
        The sum of the shards' statistics in float64, in shard order: counts exact, Grams
        and sums equal to a single-process run to ≤ 1e-12 relative (same activations; see
        the module docstring). Metadata as in one process, plus ``extra["ray"]`` (workers,
        threads per worker, the shards' batch ranges).

    Raises
    ------
    ImportError
        Ray is not installed (``pip install 'ray>=2.9'``, lmdx's ``ray`` extra).
    RuntimeError
        A worker raised (e.g. its model could not be loaded: a folder missing on its node);
        the message names the shard's batch range and the worker's error.
    lmdx.RayClusterError
        The cluster's address does not answer (checked within seconds, before
        ``ray.init``); a shard's worker process or node was lost twice (each shard is run
        again once, on any node with free CPUs); or no node has had ``threads_per_worker``
        CPUs for ``LMDX_RAY_WAIT`` seconds (default 60) while shards were left.

    Notes
    -----
    Nothing is returned (nothing is written) on error; the tasks still running are
    cancelled at the end, also on error or ``KeyboardInterrupt``.
    """
    ray = _ray.import_ray()
    for name, value in (("num_workers", num_workers), ("threads_per_worker", threads_per_worker)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: expected an integer >= 1, got {value!r}")
    _check_collect_kwargs(collect_kwargs)
    if "precision" in collect_kwargs:  # the deprecated spelling, warned about here
        collect_kwargs["accumulation"] = accumulation_option(
            collect_kwargs.pop("accumulation", "mixed"),
            collect_kwargs.pop("precision"),
            "collect_regmean_stats_ray",
        )
    if isinstance(batches, Mapping) or hasattr(batches, "dim"):
        raise TypeError(
            "collect_regmean_stats_ray: batches must be a list of batches, got a single batch"
        )
    batches = list(batches)
    if not batches:
        raise ValueError("collect_regmean_stats_ray: batches is empty")
    started = not ray.is_initialized()
    spec = _model_spec(model, local=address is None)
    k = min(num_workers, len(batches))
    bounds = shard_bounds(len(batches), k)

    if started:
        _ray.start_ray(address, num_workers * threads_per_worker)
    n = len(batches)
    names = [
        f"shard {i + 1} of {k} (batches {a}..{b - 1} of {n})" for i, (a, b) in enumerate(bounds)
    ]
    refs: dict[Any, int] = {}
    bar = progress_bar(k, "RegMean statistics (Ray shards)", progress, unit="shard")
    try:
        task = ray.remote(num_cpus=threads_per_worker, max_retries=1)(_collect_shard)
        for i, (a, b) in enumerate(bounds):  # a shard starts as soon as CPUs are free
            refs[task.remote(spec, threads_per_worker, batches[a:b], dict(collect_kwargs))] = i
        partials: list[Any] = [None] * k
        while refs:
            done = _ray.wait_ready(
                ray, list(refs), threads_per_worker, lambda: _pending(names, refs.values())
            )
            for ref in done:
                i = refs.pop(ref)
                try:
                    partials[i] = ray.get(ref)
                except ray.exceptions.RayError as exc:
                    cause = getattr(exc, "cause", None)
                    why = str(cause) if isinstance(cause, _LoadFailed) else _ray.failure(ray, exc)
                    # an error raised by the worker's code, or the worker (node) lost twice
                    error = RuntimeError if cause is not None else RayClusterError
                    raise error(
                        f"collect_regmean_stats_ray: {names[i]} failed on its Ray worker: {why}"
                    ) from None
                bar.update(1)
    finally:
        bar.close()
        _ray.stop_ray(ray, list(refs), started)
    return _add_partials(partials, bounds, threads_per_worker)


def _pending(names: Sequence[str], indices: Iterable[int]) -> str:
    """The shards still out, for the message of a lost cluster."""
    left = sorted(indices)
    more = f" and {len(left) - 1} more" if len(left) > 1 else ""
    return f"collect_regmean_stats_ray: {names[left[0]]}{more}"
