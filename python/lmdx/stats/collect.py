"""Collecting RegMean statistics over a whole model: the collection passes and their driver.

:func:`collect_regmean_stats` finds the model's sites (:mod:`lmdx.stats.sites`), probes
one sequence, hooks a :class:`lmdx.stats.collector.GramCollector` (what is accumulated,
and how, is described there) and runs the model in ``eval()`` under ``torch.no_grad()``
over the batches. With an output file and a memory bound, the input groups are split, in
the order the model calls them, into passes whose accumulators fit; each pass runs the
data through the model, ended after the pass's last module where the wiring allows
(:mod:`lmdx.stats.stop`), and writes its groups' Grams as soon as they are final.

The statistics are keyed by the names the model's ``save_pretrained`` folder stores its
weights under (:mod:`lmdx.files.saved`), the names a merge reads: a file collected on a
model in memory matches its saved checkpoint even where transformers renames or splits
weights on saving. Linear weights that cannot be given statistics (a conversion lmdx
cannot trace, experts of another interface) are listed with the reason in
``extra["not_solved"]``; a merge averages them and says so.

Diagonal Fisher statistics are :func:`lmdx.stats.fisher.collect_fisher`.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence, Sized
from typing import Any

from .._tensors import is_tensor
from .._util import parse_size, progress_bar, split_in_order
from ..config import resolve_threads
from ..data.batches import as_kwargs
from ..files.identity import model_identity
from ..files.st import hf_model_of
from .collector import BACKENDS, GramCollector, accumulation_option
from .file import Statistics
from .packing import pack_upper
from .sites import DECODER_KEYS, find_sites, first_sequence, probe_decoder_rows
from .stop import run_until_stopped, stop_before
from .torch_gram import BLOCK_ROWS, exact_float32_matmul
from .writer import StatisticsWriter

__all__ = ["GramCollector", "collect_regmean_stats"]


def _groups_in_order(collector: GramCollector) -> list[str]:
    """Input groups in the order their first module is called (uncalled ones last)."""
    out: list[str] = []
    for name in [*collector.order, *collector.modules, *collector.experts]:
        for site in collector.sites_of(name):
            g = collector.group_of[site]
            if g not in out:
                out.append(g)
    return out


def _plan_passes(
    groups: Sequence[str], dims: Mapping[str, int], budget: int | None
) -> list[list[str]]:
    """Split the groups (in call order) into passes whose accumulators fit ``budget``."""
    if budget is None:
        return [list(groups)]
    parts = split_in_order([_moments_bytes(dims[g]) for g in groups], budget)
    return [[groups[i] for i in part] for part in parts]


def _moments_bytes(d: int) -> int:
    return 8 * d * d + 8 * d


def _stop_module(collector: GramCollector, members: set[str]) -> str | None:
    """The first module called after every module of ``members`` (None: run to the end).

    Only when every module is called exactly once per forward pass (no weight sharing
    across calls), so that stopping there cannot skip a later call of a member."""
    if any(c != 1 for c in collector.calls_on_probe.values()):
        return None
    if any(m not in collector.order for m in members):
        return None
    last = max(collector.order.index(m) for m in members)
    return collector.order[last + 1] if last + 1 < len(collector.order) else None


def collect_regmean_stats(
    model: Any,
    batches: Iterable[Any],
    *,
    include: Sequence[str] | None = None,
    exclude: Sequence[str] | None = None,
    include_padding: bool = False,
    share_inputs: bool = True,
    mask_key: str = "attention_mask",
    accumulation: str = "mixed",
    description: str = "",
    out: str | os.PathLike[str] | None = None,
    max_memory: int | str | None = None,
    max_shard_size: int | str | None = None,
    progress: bool = True,
    n_threads: int | None = None,
    device: Any = None,
    backend: str | None = None,
    precision: str | None = None,
) -> Statistics:
    """Gram statistics of every selected linear module's input over ``batches``.

    Parameters
    ----------
    model
        A torch module (e.g. a Hugging Face model, a PEFT LoRA model, or a
        ``SentenceTransformer``, whose Transformer's Hugging Face model is used); it is run
        in ``eval()`` under ``torch.no_grad()`` and its training flag is restored
        afterwards.
    batches
        Iterable of dicts of tensors with any keys the model takes (``input_ids``,
        ``pixel_values``, ``decoder_input_ids``, ...), each passed as ``model(**batch)``
        (a ``labels`` entry is dropped), or of input-id tensors. An encoder-decoder
        model's batches must hold ``decoder_input_ids`` (or ``decoder_inputs_embeds``).
        Must be re-iterable (a list) when ``max_memory`` asks for more than one pass.
    include, exclude
        ``fnmatch`` patterns over module names (see
        :func:`lmdx.stats.sites.find_linear_modules`), or the names the model's
        ``save_pretrained`` folder gives their weights; for fused experts, the experts
        module, its 3-D parameters or the saved per-expert weights.
    include_padding
        Count padding rows like the reference implementations (default: rows whose
        ``attention_mask`` is 0 are left out; in an encoder-decoder model, decoder rows
        whose ``decoder_attention_mask`` is 0, every decoder row without one).
    share_inputs
        Accumulate one Gram for modules that read the same input tensor.
    accumulation
        How each Gram is accumulated (stored as ``extra["accumulation"]``; a merge's
        ``precision`` is its solve, not this): ``"mixed"`` (default): float32
        activations are multiplied in float32 in chunks of ≤ 64 rows and summed in
        float64 (2e-8–5e-8 relative to a float64 Gram on the Gaussian rows of
        ``bench/bench_core.py``; the tests bound it by 1e-6);
        ``"float64"``: activations are widened and multiplied in float64 (about twice
        the collection overhead in ``bench/bench_regmean.py``; for RegMean at α = 1 on
        ill-conditioned Grams, where the solve amplifies the Gram's relative error by the
        condition number). bfloat16 activations on a CPU with AVX512_BF16 are multiplied
        with its bf16 dot product (``lmdx info``: ``gram_paths``), within the same bound.
        With ``backend="torch"`` the file records ``"torch-float32"`` for ``"mixed"``:
        float32 products of blocks of 256 rows summed in float64
        (:mod:`lmdx.stats.torch_gram`).
    description
        Free text stored in the statistics file (what data, how much, from whom).
    out
        Write the statistics to this file (or, with ``max_shard_size``, sharded folder)
        while collecting: each input group's Gram is written as soon as it is final and
        dropped from memory; the returned statistics read from the file. Disk space is
        reserved before the first batch. On any error or Ctrl-C nothing is left behind.
    max_memory
        With ``out``: bound on the float64 accumulators held at once (``"4GB"`` or
        bytes). Groups are split, in the order the model calls them, into passes that
        fit; each pass runs the model over all batches, stopping the forward pass after
        the pass's last module where the model's wiring allows (every module called
        once per forward; tests/test_stream.py checks that later modules do not run).
        Later passes therefore run more of the model; their cost was not benchmarked.
    max_shard_size
        With ``out``: write a folder of shards of at most this size.
    progress
        Show a progress bar over batches.
    n_threads
        Threads of the native accumulation (default: lmdx's thread count).
    device
        Run the model there (``"cuda"``, ``"cuda:1"``, a ``torch.device``): it is moved
        there for the collection and back to where it was afterwards, and every batch is
        moved there. Default: where the model is. The model must fit on the device, with
        the float64 Grams (8 d² bytes per input group) that the pass holds: ``max_memory``
        bounds those (more passes over the data); a model larger than the device cannot
        be collected there (collect on the CPU, where ``include``/``exclude`` parts join
        exactly, :func:`lmdx.stats.join_statistics`).
    backend
        Where the Gram arithmetic runs: ``"lmdx"`` (the native core, on the CPU) or
        ``"torch"`` (matmuls on the model's device, :mod:`lmdx.stats.torch_gram`).
        Default: lmdx on the CPU, torch on any other device.
    precision
        Deprecated spelling of ``accumulation`` (a :class:`DeprecationWarning`).

    Returns
    -------
    Statistics
        ``kind="regmean-gram"``; save with :meth:`Statistics.save` (or already in ``out``).
    """
    accumulation = accumulation_option(accumulation, precision, "collect_regmean_stats")
    if out is None and (max_memory is not None or max_shard_size is not None):
        raise ValueError("max_memory and max_shard_size need out= (a file or folder to write)")
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend: expected 'lmdx' or 'torch', got {backend!r}")
    budget = None if max_memory is None else parse_size(max_memory)
    model = hf_model_of(model)  # a SentenceTransformer: its Hugging Face encoder
    with on_device(model, device) as target:
        backend = backend or ("lmdx" if target.type == "cpu" else "torch")
        if backend == "lmdx" and target.type != "cpu":
            raise ValueError(
                f"backend='lmdx' runs on the CPU, the model is on {target}; use "
                "backend='torch' (the default there)"
            )
        with exact_float32_matmul():
            return _collect(
                model,
                batches,
                target,
                include=include,
                exclude=exclude,
                include_padding=include_padding,
                share_inputs=share_inputs,
                mask_key=mask_key,
                accumulation=accumulation,
                backend=backend,
                description=description,
                out=out,
                max_memory=max_memory,
                budget=budget,
                max_shard_size=max_shard_size,
                progress=progress,
                n_threads=n_threads,
            )


@contextlib.contextmanager
def on_device(model: Any, device: Any) -> Iterator[Any]:
    """The model on ``device`` (default: where its parameters are) while inside, moved
    back where it was afterwards; yields the ``torch.device``."""
    import torch

    first = next(itertools.chain(model.parameters(), model.buffers()), None)
    home = first.device if first is not None else torch.device("cpu")
    try:
        target = home if device is None else torch.device(device)
        if target.type == "cuda" and target.index is None:
            target = torch.device("cuda", torch.cuda.current_device())
        if target != home:
            model.to(target)
    except (RuntimeError, AssertionError) as exc:  # no such device, or out of its memory
        model.to(home)
        raise ValueError(f"device {device}: cannot run the model there ({exc})") from None
    try:
        yield target
    finally:
        if target != home:
            model.to(home)


def _collect(
    model: Any,
    batches: Iterable[Any],
    device: Any,
    *,
    include: Sequence[str] | None,
    exclude: Sequence[str] | None,
    include_padding: bool,
    share_inputs: bool,
    mask_key: str,
    accumulation: str,
    backend: str,
    description: str,
    out: str | os.PathLike[str] | None,
    max_memory: int | str | None,
    budget: int | None,
    max_shard_size: int | str | None,
    progress: bool,
    n_threads: int | None,
) -> Statistics:
    """:func:`collect_regmean_stats` with its options checked, on ``device``."""
    import torch

    iterator = iter(batches)
    first = next(iterator, None)
    if first is None:
        raise ValueError("collect_regmean_stats: batches is empty")
    first_kwargs = to_device(as_kwargs(first), device)
    first_kwargs.pop("labels", None)
    _check_decoder_inputs(model, first_kwargs)
    was_training = model.training
    model.eval()
    writer: Any = None
    try:
        with torch.no_grad():
            sites = find_sites(model, first_kwargs, mask_key, include, exclude)
            collector = GramCollector(
                sites.linear,
                include_padding=include_padding,
                share_inputs=share_inputs,
                mask_key=mask_key,
                n_threads=resolve_threads(n_threads),
                accumulation=accumulation,
                backend=backend,
                experts=sites.experts,
                entries=sites.entries,
            )
            first_row = first_sequence(first_kwargs, mask_key)
            collector.probe(lambda: model(**first_row), probe_decoder_rows(first_row))
        dims = collector.dims()
        saved_group = {g: collector.group_name(g) for g in dims}
        order = _groups_in_order(collector)
        passes = _plan_passes(order, dims, budget)
        if len(passes) > 1 and iter(batches) is batches:
            raise ValueError(
                f"collect_regmean_stats: max_memory={max_memory} needs {len(passes)} passes over "
                "the data, but batches is a one-shot iterator; pass a list"
            )
        module_info = collector.module_info()
        counts: dict[str, float] = {}
        extra: dict[str, Any] = {
            "share_inputs": share_inputs,
            "accumulation": collector.accumulation,
            "passes": len(passes),
        }
        if collector.torch:
            extra["collected_on"] = str(device)
            if not collector.float64:
                extra["block_rows"] = BLOCK_ROWS
        if sites.routed:
            extra["experts"] = {saved_group[s]: v for s, v in sites.routed.items() if s in dims}
        if sites.not_solved:
            extra["not_solved"] = sites.not_solved

        identity = model_identity(model)

        def make_stats(**kwargs: Any) -> Statistics:
            return Statistics(
                kind="regmean-gram",
                model=identity,
                data=description,
                padding="included" if include_padding else "excluded",
                modules=module_info,
                extra=extra,
                **kwargs,
            )

        if out is not None:
            skeleton = make_stats(
                groups={saved_group[g]: {"dim": dims[g], "count": 0.0} for g in order}
            )
            writer = StatisticsWriter(
                out, skeleton.specs(), skeleton.metadata(), max_shard_size=max_shard_size
            )
        total = len(batches) * len(passes) if isinstance(batches, Sized) else 0
        bar = progress_bar(total, "RegMean statistics", progress, unit="batch")
        n_batches = 0
        try:
            for p, groups in enumerate(passes):
                source = itertools.chain([first], iterator) if p == 0 else iter(batches)
                members = {
                    n
                    for n in [*sites.linear, *sites.experts]
                    if any(collector.group_of[s] in groups for s in collector.sites_of(n))
                }
                collector.active = set(groups)
                seen = _run_pass(model, collector, members, source, bar, device)
                if p == 0:
                    n_batches = seen
                elif seen != n_batches:
                    raise ValueError(
                        f"collect_regmean_stats: pass {p + 1} saw {seen} batches, pass 1 saw "
                        f"{n_batches}; batches must yield the same data every time"
                    )
                missing = [
                    n
                    for n in sorted(members)
                    if any(
                        collector.group_of[s] in groups
                        and collector.group_of[s] not in collector.moments
                        for s in collector.sites_of(n)
                    )
                ]
                if missing:
                    raise ValueError(
                        f"collect_regmean_stats: modules never called during the forward "
                        f"pass: {missing[:5]}{' ...' if len(missing) > 5 else ''}; exclude them"
                    )
                for g in groups:
                    counts[g] = collector.moments[g].count
                if writer is not None:
                    for g in groups:
                        m = collector.final_moments(g)
                        writer.write(f"sum/{saved_group[g]}", m.sum)
                        writer.write(f"gram/{saved_group[g]}", pack_upper(m.gram()))
                        del m
        finally:
            bar.close()
        extra["batches"] = n_batches
        groups_meta = {saved_group[g]: {"dim": dims[g], "count": counts[g]} for g in order}
        if writer is not None:
            writer.close(make_stats(groups=groups_meta).metadata())
            writer = None
            return Statistics.load(out)  # type: ignore[arg-type]
        moments = {saved_group[g]: collector.final_moments(g) for g in list(collector.moments)}
        return make_stats(groups=groups_meta, moments=moments)
    except BaseException as exc:
        if writer is not None:
            writer.abort(exc)
        raise
    finally:
        model.train(was_training)


def _check_decoder_inputs(model: Any, kwargs: Mapping[str, Any]) -> None:
    """An encoder-decoder model's batches must hold its decoder inputs."""
    config = getattr(model, "config", None)
    if getattr(config, "is_encoder_decoder", False) and not any(k in kwargs for k in DECODER_KEYS):
        raise ValueError(
            f"batches: {type(model).__name__} is an encoder-decoder model; every batch needs "
            "decoder_input_ids (or decoder_inputs_embeds), and decoder_attention_mask where the "
            "decoder inputs are padded"
        )


def to_device(kwargs: dict[str, Any], device: Any) -> dict[str, Any]:
    """A batch's tensors moved to ``device`` (the others as they are)."""
    return {k: v.to(device) if is_tensor(v) else v for k, v in kwargs.items()}


def _run_pass(
    model: Any,
    collector: GramCollector,
    members: set[str],
    batches: Iterable[Any],
    bar: Any,
    device: Any,
) -> int:
    """One pass over the data accumulating the groups of ``members`` (hooked modules);
    returns the number of batches."""
    import torch

    stop = _stop_module(collector, members)
    hooked = None if stop is None else (collector.modules.get(stop) or collector.experts[stop])
    n = 0
    with (
        stop_before(None if hooked is None else hooked[0]),
        torch.no_grad(),
        collector.hooks(members),
    ):
        for batch in batches:
            kwargs = to_device(as_kwargs(batch), device)
            kwargs.pop("labels", None)
            collector.start_batch(kwargs)
            run_until_stopped(functools.partial(model, **kwargs))
            collector.end_batch()
            n += 1
            bar.update(1)
    return n
