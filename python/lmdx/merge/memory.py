"""Merging K models fine-tuned from one checkpoint: RegMean, averaging, Fisher, task arithmetic.

All methods work on state dicts (name -> tensor) with the arithmetic in float64 by the
native core, and return a :class:`MergeResult`; :func:`save_merged` writes it as a
Hugging Face ``save_pretrained`` directory, atomically.

* ``regmean`` (Jin et al., 2023): every linear weight with statistics in all K files is
  solved in closed form, ``W_Mᵀ = (Σ c_i G̃_i)⁻¹ Σ c_i G̃_i W_iᵀ`` with
  ``G̃_i = α·G_i/n_i + (1−α)·diag(G_i/n_i)``; modules that share an input Gram (q/k/v)
  are solved together (one factorization). Everything else is averaged.
* ``average``: ``Σ c_i θ_i / Σ c_i``.
* ``fisher``: ``Σ c_i (F_i+ε) θ_i / Σ c_i (F_i+ε)`` with ``F_i`` the mean squared
  gradients from :func:`lmdx.capture.collect_fisher`.
* ``task_arithmetic``: ``θ_0 + λ Σ c_i (θ_i − θ_0)`` from a base model ``θ_0``.

Task heads (``heads`` patterns, e.g. ``classifier.*``) are not merged: each model keeps
its own (:meth:`MergeResult.model_state`) or they are dropped.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from .._errors import MergeError
from .._tensors import as_tensor_array
from .._util import matches as _matches
from .._util import parse_size
from .._util import progress_bar as _progress
from ..average import fisher_average, weighted_average
from ..files.atomic import atomic_directory
from ..files.hf import TOKENIZER_FILES, hf_progress, load_model
from ..files.identity import model_identity
from ..regmean import regmean_merge_layer
from ..stats.file import Statistics

__all__ = [
    "METHODS",
    "MergeError",
    "MergeResult",
    "load_model",
    "merge_models",
    "save_merged",
]

METHODS = ("regmean", "average", "fisher", "task_arithmetic")


@dataclass
class MergeResult:
    """A merged model.

    Attributes
    ----------
    state_dict
        Merged parameters (torch tensors in each parameter's original dtype), without the
        task heads.
    heads
        Per input model, its own head tensors (empty dicts when there are no heads).
    report
        What was done: method, options, per-layer solver information, timings.
    """

    state_dict: dict[str, Any]
    heads: list[dict[str, Any]]
    report: dict[str, Any] = field(default_factory=dict)

    def model_state(self, i: int = 0) -> dict[str, Any]:
        """Full state dict for model ``i``: the merged body plus model ``i``'s own head."""
        return {**self.state_dict, **self.heads[i]}


def _state(model: Any, label: str) -> dict[str, Any]:
    if isinstance(model, Mapping):
        return dict(model)
    if hasattr(model, "state_dict"):
        return dict(model.state_dict())
    raise MergeError(f"{label}: expected a torch module, a state dict or a model folder")


def _check_architectures(states: Sequence[Mapping[str, Any]], labels: Sequence[str]) -> None:
    ref = states[0]
    for state, label in zip(states[1:], labels[1:], strict=True):
        for name in ref:
            if name not in state:
                raise MergeError(
                    f"{label} has no tensor {name!r} that {labels[0]} has: the models do not "
                    "share one architecture"
                )
            if tuple(state[name].shape) != tuple(ref[name].shape):
                raise MergeError(
                    f"tensor {name!r}: shape {tuple(ref[name].shape)} in {labels[0]} but "
                    f"{tuple(state[name].shape)} in {label}; models must be fine-tuned from "
                    "one checkpoint (exclude differing task heads with heads=[...])"
                )
        extra = [n for n in state if n not in ref]
        if extra:
            raise MergeError(
                f"{label} has tensors {labels[0]} lacks (e.g. {extra[0]!r}): the models do "
                "not share one architecture"
            )


def _coefficients(coefficients: Sequence[float] | None, k: int) -> list[float] | None:
    if coefficients is None:
        return None
    coef = [float(c) for c in coefficients]
    if len(coef) != k:
        raise MergeError(f"coefficients: {len(coef)} values for {k} models")
    if any(not np.isfinite(c) or c < 0 for c in coef) or sum(coef) <= 0:
        raise MergeError(f"coefficients: must be finite, >= 0 and not all 0, got {coef}")
    return coef


def _finite(name: str, arr: NDArray[Any]) -> NDArray[Any]:
    if not np.isfinite(arr).all():
        raise MergeError(
            f"merged tensor {name!r} is not finite; check the inputs (NaN/Inf in a model or "
            "statistics)"
        )
    return arr


def merge_models(
    models: Sequence[Any],
    method: str = "regmean",
    *,
    stats: Sequence[Statistics | str | os.PathLike[str]] | None = None,
    alpha: float = 1.0,
    coefficients: Sequence[float] | None = None,
    exclude: Sequence[str] = (),
    heads: Sequence[str] = (),
    base: Any = None,
    scaling: float = 0.3,
    fisher_eps: float = 1e-8,
    ridge: float = 0.0,
    allow_regularization: bool = True,
    labels: Sequence[str] | None = None,
    progress: bool = True,
    n_threads: int | None = None,
) -> MergeResult:
    """Merge K models fine-tuned from one checkpoint.

    Parameters
    ----------
    models
        K torch modules, state dicts or Hugging Face model folders.
    method
        ``"regmean"``, ``"average"``, ``"fisher"`` or ``"task_arithmetic"``.
    stats
        ``regmean``: K Gram statistics (objects or files), one per model, in order;
        ``fisher``: K Fisher statistics. Each is verified to belong to its model.
    alpha
        RegMean's off-diagonal scaling in [0, 1] (the paper uses 0.9 for transformers).
    coefficients
        Optional K non-negative per-model coefficients (RegMean: multiply the Grams;
        averages: weights; task arithmetic: per task-vector factors).
    exclude
        ``fnmatch`` patterns of module names RegMean must not solve (they are averaged).
    heads
        ``fnmatch`` patterns of parameter names that are task heads: not merged; each
        model's own head is kept in :attr:`MergeResult.heads`.
    base
        The pre-trained model (``task_arithmetic``).
    scaling
        λ of task arithmetic.
    fisher_eps
        ε added to every Fisher value.
    ridge, allow_regularization
        Passed to the RegMean solves (see :func:`lmdx.regmean_merge_layer`).
    labels
        Names of the models for messages and the report (default: their paths or
        ``model0``...).
    """
    t0 = time.perf_counter()
    if method not in METHODS:
        raise MergeError(f"method: expected one of {METHODS}, got {method!r}")
    models = list(models)
    if len(models) < 2:
        raise MergeError(f"need at least 2 models to merge, got {len(models)}")
    k = len(models)
    if labels is None:
        labels = [
            str(m) if isinstance(m, (str, os.PathLike)) else f"model{i}"
            for i, m in enumerate(models)
        ]
    labels = list(labels)
    if len(labels) != k:
        raise MergeError(f"labels: {len(labels)} names for {k} models")
    loaded = [
        load_model(m, progress=progress) if isinstance(m, (str, os.PathLike)) else m for m in models
    ]
    states = [_state(m, lab) for m, lab in zip(loaded, labels, strict=True)]
    coef = _coefficients(coefficients, k)
    if not 0.0 <= alpha <= 1.0:
        raise MergeError(f"alpha: must be in [0, 1], got {alpha}")

    head_names = [n for n in states[0] if _matches(n, heads)]
    body = [{n: t for n, t in s.items() if not _matches(n, heads)} for s in states]
    _check_architectures(body, labels)
    head_states = [{n: t for n, t in s.items() if _matches(n, heads)} for s in states]

    identities = [model_identity(m) for m in loaded]
    stat_objs = _load_stats(stats, method, k, identities, labels)
    report: dict[str, Any] = {
        "method": method,
        "models": labels,
        "alpha": alpha if method == "regmean" else None,
        "coefficients": coef,
        "exclude": list(exclude),
        "heads": list(heads),
        "head_tensors": head_names,
        "weights_sha256": [i["weights_sha256"] for i in identities],
        "layers": {},
    }
    names = list(body[0])
    tied = _tied_names(body[0])
    if tied:
        report["tied"] = tied
    merged = _Merged(body[0])
    bar = _progress(len(names), f"merge ({method})", progress)
    try:
        if method == "regmean":
            assert stat_objs is not None
            options = RegMeanOptions(alpha, coef, ridge, allow_regularization, n_threads)
            skip = set(tied) | set(tied.values())
            for members in regmean_groups(stat_objs, body[0], skip, exclude, heads, labels):
                weights = [[b[stat_objs[0].modules[m]["weight"]] for m in members] for b in body]
                for w, value in solve_group(
                    members, weights, stat_objs, labels, options, report
                ).items():
                    merged[w] = value
                    bar.update(1)
        elif method == "fisher":
            assert stat_objs is not None
            for name in names:
                if name in merged:
                    continue
                if name in stat_objs[0].parameters:
                    report.setdefault("fisher_weighted", []).append(name)
                    merged[name] = fisher_tensor(
                        name, [b[name] for b in body], stat_objs, coef, fisher_eps, n_threads
                    )
                bar.update(1)
        elif method == "task_arithmetic":
            if base is None:
                raise MergeError("task_arithmetic needs base= (the pre-trained model)")
            base_state = _state(
                load_model(base, progress=progress)
                if isinstance(base, (str, os.PathLike))
                else base,
                "base",
            )
            base_body = {n: t for n, t in base_state.items() if not _matches(n, heads)}
            _check_architectures([body[0], base_body], [labels[0], "base"])
            for name in names:
                merged[name] = task_arithmetic_tensor(
                    base_body[name], [b[name] for b in body], coef, scaling
                )
                bar.update(1)
            report["scaling"] = float(scaling)
        for name in names:  # everything not merged otherwise is averaged
            if name not in merged:
                if _is_float(body[0][name]):
                    merged[name] = _named(
                        name, weighted_average, [b[name] for b in body], coef, n_threads=n_threads
                    )
                else:
                    merged[name] = None  # integer buffers: kept from the first model
                bar.update(1)
    finally:
        bar.close()
    for alias, canonical in tied.items():  # tied copies stay tied
        dict.__setitem__(merged, alias, merged[canonical])
    out = {name: merged[name] for name in names}
    report["seconds"] = time.perf_counter() - t0
    return MergeResult(out, head_states, report)


class _Merged(dict[str, Any]):
    """Merged tensors, each checked finite and cast to its input's dtype when stored, so
    float64 intermediates do not pile up for the whole model."""

    def __init__(self, reference: Mapping[str, Any]) -> None:
        super().__init__()
        self._reference = reference

    def __setitem__(self, name: str, value: Any) -> None:
        ref = self._reference[name]
        if value is None:
            value = ref.clone() if hasattr(ref, "clone") else np.array(ref)
        else:
            value = _like(_finite(name, np.asarray(value)), ref)
        super().__setitem__(name, value)


def _named(name: str, fn: Any, *args: Any, **kwargs: Any) -> NDArray[np.float64]:
    """Call an averaging kernel; its input errors name the tensor."""
    try:
        return np.asarray(fn(*args, **kwargs))
    except ValueError as exc:
        raise MergeError(f"tensor {name!r}: {exc}") from None


def fisher_tensor(
    name: str,
    tensors: Sequence[Any],
    stats: Sequence[Statistics],
    coef: Sequence[float] | None,
    eps: float,
    n_threads: int | None,
) -> NDArray[np.float64]:
    """One parameter's Fisher-weighted average, the Fisher sums divided by the counts."""
    fishers = [s.fisher(name) / max(s.count(), 1.0) for s in stats]
    return _named(name, fisher_average, tensors, fishers, coef, eps=eps, n_threads=n_threads)


def task_arithmetic_tensor(
    base: Any, tensors: Sequence[Any], coef: Sequence[float] | None, scaling: float
) -> NDArray[np.float64]:
    """``θ_0 + λ Σ c_i (θ_i − θ_0)`` of one tensor, in float64."""
    theta0 = _as64(base)
    delta = np.zeros_like(theta0)
    for ci, t in zip(coef or [1.0] * len(tensors), tensors, strict=True):
        delta += ci * (_as64(t) - theta0)
    return theta0 + float(scaling) * delta


def _as64(t: Any) -> NDArray[np.float64]:
    if hasattr(t, "detach"):
        t = t.detach().cpu()
        return np.asarray(t.double().numpy())
    return np.asarray(t, dtype=np.float64)


def _is_float(t: Any) -> bool:
    if hasattr(t, "is_floating_point"):
        return bool(t.is_floating_point())
    return bool(np.asarray(t).dtype.kind == "f")


def _like(arr: NDArray[Any], ref: Any) -> Any:
    """``arr`` as a tensor of ``ref``'s dtype (torch) or an array of its dtype."""
    if hasattr(ref, "detach"):
        import torch

        return torch.from_numpy(np.ascontiguousarray(arr)).to(ref.dtype)
    return np.asarray(arr, dtype=np.asarray(ref).dtype)


def _load_stats(
    stats: Sequence[Any] | None,
    method: str,
    k: int,
    identities: Sequence[Mapping[str, Any]],
    labels: Sequence[str],
) -> list[Statistics] | None:
    objs = open_stats(stats, method, k, labels)
    for s, ident, lab in zip(objs or [], identities, labels, strict=bool(objs)):
        s.check_model(ident, lab)
    return objs


def open_stats(
    stats: Sequence[Any] | None, method: str, k: int, labels: Sequence[str]
) -> list[Statistics] | None:
    """The K statistics a method needs (None for methods without), loaded and checked for
    kind and a common padding policy; not yet checked against the models."""
    if method not in ("regmean", "fisher"):
        if stats:
            raise MergeError(f"method {method!r} takes no statistics")
        return None
    kind = "regmean-gram" if method == "regmean" else "fisher"
    if stats is None or len(stats) != k:
        raise MergeError(
            f"method {method!r} needs one {kind} statistics per model ({k}), got "
            f"{0 if stats is None else len(stats)}"
        )
    objs = [s if isinstance(s, Statistics) else Statistics.load(s) for s in stats]
    for i, (s, lab) in enumerate(zip(objs, labels, strict=True)):
        if s.kind != kind:
            raise MergeError(f"stats[{i}] ({s.source or lab}): kind {s.kind!r}, expected {kind!r}")
    if kind == "regmean-gram" and len({s.padding for s in objs}) > 1:
        raise MergeError(
            "statistics mix padding policies (excluded and included); collect them all the same way"
        )
    return objs


def _tied_names(state: Mapping[str, Any]) -> dict[str, str]:
    """Tensors sharing storage with an earlier one (tied weights): alias -> first name."""
    first: dict[tuple[int, tuple[int, ...]], str] = {}
    tied: dict[str, str] = {}
    for name, t in state.items():
        if not hasattr(t, "data_ptr") or t.numel() == 0:
            continue
        key = (t.data_ptr(), tuple(t.shape))
        if key in first:
            tied[name] = first[key]
        else:
            first[key] = name
    return tied


@dataclass(frozen=True)
class RegMeanOptions:
    """Options of every RegMean solve of one merge (see :func:`merge_models`)."""

    alpha: float = 1.0
    coefficients: list[float] | None = None
    ridge: float = 0.0
    allow_regularization: bool = True
    n_threads: int | None = None


def regmean_groups(
    stats: Sequence[Statistics],
    weights: set[str] | Mapping[str, Any],
    skip: set[str],
    exclude: Sequence[str],
    heads: Sequence[str],
    labels: Sequence[str],
) -> list[list[str]]:
    """The modules RegMean solves, grouped: modules that share one input Gram in every
    statistics file are solved together (one factorization). ``weights``: the weight
    names the models have; ``skip``: weights never solved (tied ones)."""
    for i, s in enumerate(stats):
        missing = [m for m in stats[0].modules if m not in s.modules]
        if missing:
            raise MergeError(
                f"statistics of {labels[i]} lack module {missing[0]!r} that {labels[0]}'s have"
            )
    by_group: dict[tuple[str, ...], list[str]] = {}
    for m, info in stats[0].modules.items():
        w = info["weight"]
        if _matches(m, exclude) or _matches(w, heads) or w in skip:
            continue
        if w not in weights:
            raise MergeError(f"statistics name module {m!r} but the models have no {w!r}")
        key = (*(s.group_of(m) for s in stats), info["layout"])
        by_group.setdefault(key, []).append(m)
    return list(by_group.values())


def solve_group(
    members: Sequence[str],
    weights: Sequence[Sequence[Any]],
    stats: Sequence[Statistics],
    labels: Sequence[str],
    options: RegMeanOptions,
    report: dict[str, Any],
) -> dict[str, NDArray[np.float64]]:
    """RegMean of one group: ``weights[i]`` are model i's weights of ``members``; returns
    weight name -> merged float64 weight and records the solver's information."""
    layout = stats[0].modules[members[0]]["layout"]
    axis = 0 if layout == "linear" else 1
    weights_k = []
    sizes: list[int] = []
    for ws in weights:
        arrays = [as_tensor_array(w, f"{m}.weight") for m, w in zip(members, ws, strict=True)]
        sizes = [int(a.shape[axis]) for a in arrays]
        weights_k.append(np.concatenate(arrays, axis=axis) if len(arrays) > 1 else arrays[0])
        del arrays
    counts = [s.count(members[0]) for s in stats]
    for i, n in enumerate(counts):
        if n <= 0:
            raise MergeError(f"statistics of {labels[i]}: module {members[0]!r} saw no rows")
    name = (
        members[0] if len(members) == 1 else f"{members[0]} (+{len(members) - 1} sharing its input)"
    )
    res = regmean_merge_layer(
        [s.gram(members[0]) for s in stats],
        weights_k,
        counts,
        alpha=options.alpha,
        coefficients=options.coefficients,
        layout=layout,
        ridge=options.ridge,
        allow_regularization=options.allow_regularization,
        name=name,
        n_threads=options.n_threads,
    )
    del weights_k
    out = {}
    start = 0
    for m, size in zip(members, sizes, strict=True):
        part = slice(start, start + size)
        out[stats[0].modules[m]["weight"]] = res.weight[part] if axis == 0 else res.weight[:, part]
        start += size
        report["layers"][m] = {
            "ridge": float(res.info.ridge),
            "attempts": int(res.info.attempts),
            "shared_with": members[0] if m != members[0] else None,
        }
    return out


# --------------------------------------------------------------------------- saving

_DTYPES = ("auto", "float32", "bfloat16", "float16")


def _parse_size(size: int | str) -> int:
    try:
        return parse_size(size)
    except ValueError:
        raise MergeError(f"max_shard_size: expected e.g. '2GB' or bytes, got {size!r}") from None


def save_merged(
    result: MergeResult,
    out_dir: str | os.PathLike[str],
    template: Any,
    *,
    head_policy: str = "keep",
    dtype: str = "auto",
    max_shard_size: int | str = "2GB",
    tokenizer_from: str | os.PathLike[str] | None = None,
    record: Mapping[str, Any] | None = None,
    progress: bool = True,
) -> Path:
    """Write a merged model as a Hugging Face ``save_pretrained`` folder, atomically.

    Parameters
    ----------
    result
        From :func:`merge_models`.
    out_dir
        Output folder; must not exist. Written to a temporary folder beside it and
        renamed when complete; on any error nothing is left behind.
    template
        A model (or model folder) of the merged architecture, e.g. the first input model;
        its configuration is saved and its weights are replaced.
    head_policy
        ``"keep"``: the model is saved with the first model's head and every model's head
        is written to ``heads/<i>.safetensors``; ``"drop"``: the backbone
        (``model.base_model``) is saved without heads.
    dtype
        ``"auto"`` (each tensor's dtype in the inputs), ``"float32"``, ``"bfloat16"`` or
        ``"float16"``.
    record
        Extra entries for ``lmdx_merge.json`` (e.g. the resolved config).
    progress
        Show progress bars (transformers' own included).
    """
    import torch
    from safetensors.torch import save_file

    from .. import __version__

    if head_policy not in ("keep", "drop"):
        raise MergeError(f"head_policy: expected 'keep' or 'drop', got {head_policy!r}")
    if dtype not in _DTYPES:
        raise MergeError(f"dtype: expected one of {_DTYPES}, got {dtype!r}")
    shard = _parse_size(max_shard_size)
    out_dir = Path(out_dir)
    if out_dir.exists():
        raise MergeError(f"output {out_dir}: already exists; choose a new directory")
    if tokenizer_from is None and isinstance(template, (str, os.PathLike)):
        tokenizer_from = template
    if isinstance(template, (str, os.PathLike)):
        model = load_model(template, progress=progress)
    else:
        model = copy.deepcopy(template)  # the caller's model is never modified
    with atomic_directory(out_dir) as tmp:
        state = result.model_state(0)
        target = model
        if head_policy == "drop":
            target = model.base_model
            prefix = getattr(model, "base_model_prefix", "") + "."
            state = {
                n.removeprefix(prefix): t
                for n, t in result.state_dict.items()
                if n.startswith(prefix) or target is model
            }
        if dtype != "auto":
            tdtype = getattr(torch, dtype)
            state = {n: t.to(tdtype) if t.is_floating_point() else t for n, t in state.items()}
            target = target.to(tdtype)
        try:
            missing, unexpected = target.load_state_dict(state, strict=False)
        except RuntimeError as exc:  # shape mismatches
            raise MergeError(f"merged tensors do not fit the template model: {exc}") from None
        if unexpected:
            raise MergeError(f"merged tensors do not fit the template model: {unexpected[:3]}")
        real_missing = [m for m in missing if m in dict(target.named_parameters())]
        if real_missing:
            raise MergeError(f"template parameters have no merged value: {real_missing[:3]}")
        with hf_progress(progress):
            target.save_pretrained(str(tmp), max_shard_size=shard, safe_serialization=True)
        if head_policy == "keep" and any(result.heads):
            (tmp / "heads").mkdir()
            for i, head in enumerate(result.heads):
                save_file(
                    {n: t.contiguous() for n, t in head.items()},
                    str(tmp / "heads" / f"{i}.safetensors"),
                )
        if tokenizer_from is not None:
            for fname in TOKENIZER_FILES:
                src = Path(tokenizer_from) / fname
                if src.is_file():
                    shutil.copy2(src, tmp / fname)
        full_record = {
            "lmdx_version": __version__,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "head_policy": head_policy,
            "dtype": dtype,
            "report": result.report,
            **(dict(record) if record else {}),
        }
        (tmp / "lmdx_merge.json").write_text(json.dumps(full_record, indent=2, default=str))
    return out_dir
