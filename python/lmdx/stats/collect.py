"""RegMean statistics collected from torch / Hugging Face models by forward hooks.

RegMean needs, for every linear module, the Gram ``Σ x xᵀ`` of its inputs over the
user's data. :func:`collect_regmean_stats` puts a forward pre-hook on every selected
``nn.Linear`` and Hugging Face ``Conv1D``, runs the model in ``eval()`` under
``torch.no_grad()`` and streams each input into a float64 :class:`lmdx.Moments`:

* padding rows are left out using the batch's attention mask (the reference
  implementations count them, which makes a Gram depend on how texts were batched);
  ``include_padding=True`` counts them like the reference code;
* modules that read the very same input tensor (attention q/k/v, MLP gate/up, ...)
  share one Gram: it is accumulated once and stored once. Sharing is detected on a
  one-sequence probe and verified on every batch;
* fp32/bf16/fp16 activations are handed to the core as they are (16-bit floats are
  widened exactly while the kernel packs them) and accumulated in float64.

Diagonal Fisher statistics are :func:`lmdx.stats.fisher.collect_fisher`.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence, Sized
from typing import Any

import numpy as np

from .._tensors import as_float64, as_rows
from .._util import matches, parse_size, progress_bar, split_in_order
from ..config import resolve_threads
from ..data.batches import as_kwargs
from ..files.identity import model_identity
from ..files.peft import is_peft_model, peft_modules
from ..files.st import hf_model_of
from ..moments import Moments
from .file import Statistics
from .packing import pack_upper
from .writer import StatisticsWriter

__all__ = ["GramCollector", "collect_regmean_stats", "find_linear_modules"]


def _conv1d_type() -> type | None:
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:
        return None
    return Conv1D


def find_linear_modules(
    model: Any,
    include: Sequence[str] | None = None,
    exclude: Sequence[str] | None = None,
) -> dict[str, tuple[Any, str]]:
    """Linear modules of ``model`` selected by name: name -> (module, layout).

    ``layout`` is ``"linear"`` for ``torch.nn.Linear`` (weight ``[out, in]``) and
    ``"conv1d"`` for Hugging Face ``Conv1D`` (weight ``[in, out]``). ``include`` and
    ``exclude`` are shell-style patterns (``fnmatch``) over the dotted module names or
    their weights' names (``classifier*`` and ``classifier.*`` both select
    ``classifier``); a module is selected if it matches an include pattern (or there are
    none) and no exclude pattern.

    A PEFT LoRA model's modules are named as in its base model (a LoRA layer by its base
    layer, whose input it reads); the LoRA factors themselves are not collected.
    """
    import torch

    conv1d = _conv1d_type()
    found: dict[str, tuple[Any, str]] = {}
    root, rename = (model, None) if not is_peft_model(model) else peft_modules(model)
    for name, module in root.named_modules():
        if rename is not None:
            if (base_name := rename(name)) is None:
                continue
            name = base_name
        if isinstance(module, torch.nn.Linear):
            layout = "linear"
        elif conv1d is not None and isinstance(module, conv1d):
            layout = "conv1d"
        else:
            continue
        names = (name, f"{name}.weight")  # a pattern may name the module or its weight
        if include and not any(matches(n, include) for n in names):
            continue
        if any(matches(n, exclude) for n in names):
            continue
        found[name] = (module, layout)
    return found


def _first_sequence(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The first row of every batched tensor (a cheap probe of the model's wiring)."""
    ref = next((v for v in kwargs.values() if hasattr(v, "shape") and v.dim() > 0), None)
    if ref is None:
        return dict(kwargs)
    b = ref.shape[0]
    return {
        k: (v[:1] if hasattr(v, "shape") and v.dim() > 0 and v.shape[0] == b else v)
        for k, v in kwargs.items()
    }


class GramCollector:
    """Forward pre-hooks streaming the inputs of linear modules into float64 accumulators,
    one :class:`Moments` per input group: the one collector of RegMean Grams.

    :func:`collect_regmean_stats` runs it over a whole model; RegMean++
    (:mod:`lmdx.merge.regmean_plusplus`) over one block at a time. Use: :meth:`probe` once
    (which modules share an input), then per batch :meth:`start_batch` (the batch's
    attention mask), a forward pass inside :meth:`hooks`, :meth:`end_batch`.

    Parameters
    ----------
    modules
        Module name -> (module, layout), as :func:`find_linear_modules` returns them.
    include_padding, share_inputs, mask_key, precision
        As in :func:`collect_regmean_stats`.
    n_threads
        Threads of the native accumulation.
    """

    def __init__(
        self,
        modules: Mapping[str, tuple[Any, str]],
        include_padding: bool,
        share_inputs: bool,
        mask_key: str,
        n_threads: int,
        precision: str = "mixed",
    ) -> None:
        self.float64 = precision == "float64"
        self.precision = precision
        self.modules = modules
        self.include_padding = include_padding
        self.share_inputs = share_inputs
        self.mask_key = mask_key
        self.n_threads = n_threads
        self.group_of: dict[str, str] = {}
        self.order: list[str] = []
        self.calls_on_probe: dict[str, int] = {}
        self.moments: dict[str, Moments] = {}
        # per batch: tensors accumulated per group (weak references) and calls per module
        self._accumulated: dict[str, list[weakref.ref[Any]]] = {}
        self._calls: dict[str, int] = {}
        self._mask: Any = None
        self._mask_shape: tuple[int, ...] | None = None
        self._probe_inputs: dict[str, list[Any]] | None = None

    # -- probe: which modules read the same tensor -----------------------------------

    def probe(self, run: Callable[[], Any]) -> None:
        """Find the input groups: ``run()`` makes one forward pass (e.g. of one sequence)
        while hooks record which modules read the very same input tensor."""
        self._probe_inputs = {name: [] for name in self.modules}
        self._first_call: dict[str, int] = {}
        handles = [
            module.register_forward_pre_hook(self._probe_hook(name))
            for name, (module, _) in self.modules.items()
        ]
        try:
            run()
        finally:
            for h in handles:
                h.remove()
        seen = self._probe_inputs
        self._probe_inputs = None
        self.order = sorted((n for n in self.modules if seen[n]), key=self._first_call.__getitem__)
        self.calls_on_probe = {n: len(seen[n]) for n in self.modules}
        leader_of: dict[tuple[int, ...], str] = {}
        for name in self.modules:
            key = tuple(id(t) for t in seen[name])
            if not key:  # not called on the probe: a group of its own
                self.group_of[name] = name
                continue
            leader = leader_of.setdefault(key, name) if self.share_inputs else name
            self.group_of[name] = leader
        del seen  # release the probe's activations

    def _probe_hook(self, name: str) -> Any:
        def hook(module: Any, args: tuple[Any, ...]) -> None:
            assert self._probe_inputs is not None
            self._probe_inputs[name].append(args[0])
            self._first_call.setdefault(name, len(self._first_call))

        return hook

    def adopt_groups(self, other: GramCollector) -> None:
        """Take the input groups ``other`` found by its probe (for the same modules, e.g.
        one block loaded with another model's weights) instead of probing again."""
        self.group_of = dict(other.group_of)
        self.order = list(other.order)
        self.calls_on_probe = dict(other.calls_on_probe)

    def dims(self) -> dict[str, int]:
        """Input group -> its input dimension."""
        return {
            self.group_of[n]: int(m.weight.shape[1 if layout == "linear" else 0])
            for n, (m, layout) in self.modules.items()
        }

    def module_info(self) -> dict[str, dict[str, Any]]:
        """Module name -> its group, layout, weight name and input dimension, as
        :class:`Statistics` record them."""
        dims = self.dims()
        return {
            name: {
                "group": self.group_of[name],
                "layout": layout,
                "weight": f"{name}.weight",
                "dim": dims[self.group_of[name]],
            }
            for name, (_m, layout) in self.modules.items()
        }

    def take_statistics(self, model: Mapping[str, Any], data: str = "") -> Statistics:
        """The Grams accumulated so far as in-memory :class:`Statistics` of ``model`` (an
        identity); the collector starts over with empty accumulators."""
        dims = self.dims()
        missing = [n for n in self.modules if self.group_of[n] not in self.moments]
        if missing:
            raise ValueError(
                f"modules never called during the forward pass: {missing[:5]}"
                f"{' ...' if len(missing) > 5 else ''}; exclude them"
            )
        moments, self.moments = self.moments, {}
        return Statistics(
            kind="regmean-gram",
            model=model,
            data=data,
            padding="included" if self.include_padding else "excluded",
            modules=self.module_info(),
            groups={g: {"dim": d, "count": moments[g].count} for g, d in dims.items()},
            moments=moments,
            extra={"share_inputs": self.share_inputs, "precision": self.precision},
        )

    @contextlib.contextmanager
    def hooks(self, names: Iterable[str] | None = None) -> Iterator[None]:
        """Accumulating hooks on the modules ``names`` (default: all) while inside."""
        chosen = self.modules if names is None else set(names)
        handles = [
            module.register_forward_pre_hook(self.hook(name))
            for name, (module, _) in self.modules.items()
            if name in chosen
        ]
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    # -- accumulation ------------------------------------------------------------------

    def start_batch(self, kwargs: Mapping[str, Any]) -> None:
        self._accumulated = {}
        self._calls = {}
        mask = None if self.include_padding else kwargs.get(self.mask_key)
        if mask is None:
            self._mask, self._mask_shape = None, None
            return
        arr = as_float64(mask, self.mask_key)
        self._mask_shape = tuple(arr.shape)
        arr = arr.reshape(-1)
        if not np.isin(arr, (0.0, 1.0)).all():
            raise ValueError(f"batches: {self.mask_key} must hold 0/1 values")
        self._mask = np.ascontiguousarray(arr)

    def hook(self, name: str) -> Any:
        def fn(module: Any, args: tuple[Any, ...]) -> None:
            self._accumulate(name, args[0])

        return fn

    def _accumulate(self, name: str, x: Any) -> None:
        group = self.group_of[name]
        call = self._calls.get(name, 0)
        self._calls[name] = call + 1
        done = self._accumulated.setdefault(group, [])
        if call < len(done):
            if done[call]() is not x:
                raise RuntimeError(
                    f"module {name!r} shares a Gram with {group!r} (they read the same input "
                    "on the probe sequence) but read a different input in this batch; pass "
                    "share_inputs=False"
                )
            return
        d = self.modules[name][0].weight.shape[1 if self.modules[name][1] == "linear" else 0]
        if x.ndim == 0 or x.shape[-1] != d:
            raise ValueError(
                f"module {name!r} input: expected shape (..., {d}), got {tuple(x.shape)}"
            )
        leading = tuple(x.shape[:-1])
        weights = self._row_weights(name, leading, int(np.prod(leading, dtype=np.int64)))
        # float16/bfloat16 activations stay 16-bit: widened exactly inside the kernel
        rows = as_rows(x, d, f"module {name!r} input")[0].astype(np.float64) if self.float64 else x
        acc = self.moments.get(group)
        if acc is None:
            acc = self.moments[group] = Moments(d)
        try:  # the core checks every value (threaded) before adding anything
            acc.update(rows, weights=weights, n_threads=self.n_threads)
        except ValueError as exc:
            if str(exc).startswith("x: contains"):
                raise ValueError(
                    f"module {name!r}: its input holds NaN or Inf ({exc}); check the model "
                    "and the data"
                ) from None
            raise ValueError(f"module {name!r}: {exc}") from None
        done.append(weakref.ref(x))

    def _row_weights(self, name: str, leading: tuple[int, ...], rows: int) -> Any:
        if self._mask is None:
            return None
        assert self._mask_shape is not None
        if leading == self._mask_shape or rows == self._mask.size:
            return self._mask
        if len(leading) == 1 and leading[0] == self._mask_shape[0]:
            return None  # one row per sequence (a pooled input): no padding in it
        raise ValueError(
            f"module {name!r}: input rows {leading} do not line up with the attention mask "
            f"{self._mask_shape}; pass include_padding=True or exclude this module"
        )

    def end_batch(self) -> None:
        for name, calls in self._calls.items():
            group = self.group_of[name]
            if calls != len(self._accumulated.get(group, ())):
                raise RuntimeError(
                    f"module {name!r} shares a Gram with {group!r} but was called {calls} "
                    f"times while the group accumulated {len(self._accumulated[group])} "
                    "inputs in this batch; pass share_inputs=False"
                )
        self._accumulated = {}


class _StopForward(Exception):
    """Raised by a hook once every module of the current pass has seen its input."""


def _groups_in_order(collector: GramCollector) -> list[str]:
    """Input groups in the order their first module is called (uncalled ones last)."""
    out: list[str] = []
    for name in [*collector.order, *collector.modules]:
        g = collector.group_of[name]
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
    precision: str = "mixed",
    description: str = "",
    out: str | os.PathLike[str] | None = None,
    max_memory: int | str | None = None,
    max_shard_size: int | str | None = None,
    progress: bool = True,
    n_threads: int | None = None,
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
        Iterable of dicts of tensors, each passed as ``model(**batch)`` (a ``labels``
        entry is dropped), or of input-id tensors. Must be re-iterable (a list) when
        ``max_memory`` asks for more than one pass.
    include, exclude
        ``fnmatch`` patterns over module names (see :func:`find_linear_modules`).
    include_padding
        Count padding rows like the reference implementations (default: rows whose
        ``attention_mask`` is 0 are left out).
    share_inputs
        Accumulate one Gram for modules that read the same input tensor.
    precision
        ``"mixed"`` (default): float32 activations are multiplied in float32 in chunks of
        ≤ 64 rows and summed in float64 (2e-8–5e-8 relative to a float64 Gram on the
        Gaussian rows of ``bench/bench_core.py``; the tests bound it by 1e-6);
        ``"float64"``: activations are widened and multiplied in float64 (about twice
        the collection overhead in ``bench/bench_regmean.py``; for RegMean at α = 1 on
        ill-conditioned Grams, where the solve amplifies the Gram's relative error by the
        condition number).
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

    Returns
    -------
    Statistics
        ``kind="regmean-gram"``; save with :meth:`Statistics.save` (or already in ``out``).
    """
    import torch

    if precision not in ("mixed", "float64"):
        raise ValueError(f"precision: expected 'mixed' or 'float64', got {precision!r}")
    if out is None and (max_memory is not None or max_shard_size is not None):
        raise ValueError("max_memory and max_shard_size need out= (a file or folder to write)")
    budget = None if max_memory is None else parse_size(max_memory)
    model = hf_model_of(model)
    modules = find_linear_modules(model, include, exclude)
    if not modules:
        raise ValueError(
            "collect_regmean_stats: no nn.Linear / Conv1D module matches the include/exclude "
            "patterns"
        )
    collector = GramCollector(
        modules, include_padding, share_inputs, mask_key, resolve_threads(n_threads), precision
    )
    iterator = iter(batches)
    first = next(iterator, None)
    if first is None:
        raise ValueError("collect_regmean_stats: batches is empty")
    was_training = model.training
    model.eval()
    writer: Any = None
    try:
        with torch.no_grad():
            first_kwargs = as_kwargs(first)
            first_kwargs.pop("labels", None)
            collector.probe(lambda: model(**_first_sequence(first_kwargs)))
        dims = collector.dims()
        order = _groups_in_order(collector)
        passes = _plan_passes(order, dims, budget)
        if len(passes) > 1 and iter(batches) is batches:
            raise ValueError(
                f"collect_regmean_stats: max_memory={max_memory} needs {len(passes)} passes over "
                "the data, but batches is a one-shot iterator; pass a list"
            )
        module_info = collector.module_info()
        counts: dict[str, float] = {}
        extra = {"share_inputs": share_inputs, "precision": precision, "passes": len(passes)}

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
            skeleton = make_stats(groups={g: {"dim": dims[g], "count": 0.0} for g in order})
            writer = StatisticsWriter(
                out, skeleton.specs(), skeleton.metadata(), max_shard_size=max_shard_size
            )
        total = len(batches) * len(passes) if isinstance(batches, Sized) else 0
        bar = progress_bar(total, "RegMean statistics", progress, unit="batch")
        n_batches = 0
        try:
            for p, groups in enumerate(passes):
                source = itertools.chain([first], iterator) if p == 0 else iter(batches)
                members = {n for n in modules if collector.group_of[n] in groups}
                seen = _run_pass(model, collector, modules, members, source, bar)
                if p == 0:
                    n_batches = seen
                elif seen != n_batches:
                    raise ValueError(
                        f"collect_regmean_stats: pass {p + 1} saw {seen} batches, pass 1 saw "
                        f"{n_batches}; batches must yield the same data every time"
                    )
                missing = [n for n in members if collector.group_of[n] not in collector.moments]
                if missing:
                    raise ValueError(
                        f"collect_regmean_stats: modules never called during the forward "
                        f"pass: {missing[:5]}{' ...' if len(missing) > 5 else ''}; exclude them"
                    )
                for g in groups:
                    counts[g] = collector.moments[g].count
                if writer is not None:
                    for g in groups:
                        m = collector.moments.pop(g)
                        writer.write(f"sum/{g}", m.sum)
                        writer.write(f"gram/{g}", pack_upper(m.gram()))
                        del m
        finally:
            bar.close()
        extra["batches"] = n_batches
        groups_meta = {g: {"dim": dims[g], "count": counts[g]} for g in order}
        if writer is not None:
            writer.close(make_stats(groups=groups_meta).metadata())
            writer = None
            return Statistics.load(out)  # type: ignore[arg-type]
        return make_stats(groups=groups_meta, moments=collector.moments)
    except BaseException as exc:
        if writer is not None:
            writer.abort(exc)
        raise
    finally:
        model.train(was_training)


def _run_pass(
    model: Any,
    collector: GramCollector,
    modules: Mapping[str, tuple[Any, str]],
    members: set[str],
    batches: Iterable[Any],
    bar: Any,
) -> int:
    """One pass over the data accumulating the groups of ``members``; returns batches."""
    import torch

    stop = _stop_module(collector, members)

    def stop_hook(module: Any, args: tuple[Any, ...]) -> None:
        raise _StopForward

    handle = None if stop is None else modules[stop][0].register_forward_pre_hook(stop_hook)
    n = 0
    try:
        with torch.no_grad(), collector.hooks(members):
            for batch in batches:
                kwargs = as_kwargs(batch)
                kwargs.pop("labels", None)
                collector.start_batch(kwargs)
                try:
                    model(**kwargs)
                except _StopForward:
                    pass
                collector.end_batch()
                n += 1
                bar.update(1)
    finally:
        if handle is not None:
            handle.remove()
    return n
