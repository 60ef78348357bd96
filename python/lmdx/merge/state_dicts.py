"""``lmdx.merge_state_dicts``: the in-memory door mergekit users already have.

mergekit (0.1.5) merges in-memory models with
``merge_state_dicts(models, method, *, parameters=, base=, strict=, dtype=, out_dtype=)``,
and sentence-transformers' ``merge`` calls it. This function takes the same arguments,
plus ``statistics=``, and returns a state dict the same way, so a script written for one
runs on the other with lmdx's methods — RegMean among them when statistics are given:

* ``models``: a sequence of state dicts or torch modules (sentence-transformers models
  included), or a mapping from IDs to them;
* ``base``: the ID (index, or mapping key) of the pre-trained model among ``models``; it
  becomes lmdx's ``base`` (the task-vector methods' θ_base) and is not merged as a model;
* ``parameters``: the method's options by lmdx's names (``lmdx methods``), and
  ``weight``, per input (a sequence in input order or a mapping by ID) or one number: the
  models' ``coefficients``;
* ``statistics``: per merged model, its statistics (objects or files), in order or by ID,
  collected on the model (for a sentence-transformers model, on the model itself: its
  Transformer's names are matched to the state dict's keys);
* ``dtype``: the floating-point inputs are cast to it before merging; ``out_dtype``: the
  merged floating-point tensors are cast to it. lmdx computes in float64 either way;
* non-floating-point tensors (position ids, counters) are copied when every input holds
  the same values, and refused otherwise; with ``strict=False`` only the tensors every
  input holds are merged.

The returned dict holds every merged tensor under the first model's keys, in its order
(with a ``heads`` option: the first model's heads), ready for ``load_state_dict``.
"""

from __future__ import annotations

import os
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

from .._errors import MergeError
from .._tensors import FLOAT_DTYPES, float_dtype_name
from ..files.st import hf_model_of
from ..stats.file import Statistics
from .api import merge_models

__all__ = ["merge_state_dicts"]


def merge_state_dicts(
    models: Mapping[Hashable, Any] | Sequence[Any],
    method: str,
    *,
    parameters: Mapping[str, Any] | None = None,
    base: Hashable | None = None,
    strict: bool = True,
    dtype: Any = None,
    out_dtype: Any = None,
    statistics: Mapping[Hashable, Any] | Sequence[Any] | None = None,
    progress: bool = False,
) -> dict[str, Any]:
    """Merge in-memory models or state dicts with an lmdx method; a state dict back.

    Parameters
    ----------
    models
        State dicts (name -> torch tensor) or torch modules, in a sequence or a mapping
        from IDs; their keys are the returned dict's.
    method
        An lmdx method's name (``"regmean"``, ``"ties"``, ``"task_arithmetic"``, ...;
        ``"linear"`` is read as ``"average"``).
    parameters
        The method's options, plus ``weight``: the per-model coefficients.
    base
        The ID of the pre-trained model among ``models`` (task-vector methods).
    strict
        Every input must hold the same keys (else only the common ones are merged).
    dtype, out_dtype
        torch dtypes the floating-point inputs are cast to before, and the merged tensors
        after, merging (None: as they are).
    statistics
        RegMean's Gram (or Fisher's) statistics, one per merged model.
    progress
        Show lmdx's progress bars.

    Returns
    -------
    dict
        Name -> merged torch tensor, in the first model's key order.
    """
    if not isinstance(method, str) or not method:
        raise MergeError(
            f"merge_state_dicts: method must be a method's name (lmdx methods lists them), "
            f"got {method!r}"
        )
    if isinstance(models, (str, bytes)) or not isinstance(models, Mapping | Sequence):
        raise MergeError(
            "merge_state_dicts: models must be a list of state dicts or modules, or a mapping "
            f"from IDs to them, got {type(models).__name__}"
        )
    dtype, out_dtype = _torch_dtype(dtype, "dtype"), _torch_dtype(out_dtype, "out_dtype")
    items = list(models.items()) if isinstance(models, Mapping) else list(enumerate(models))
    if not items:
        raise MergeError("merge_state_dicts: at least one model is needed")
    ids = [i for i, _ in items]
    if len(set(ids)) != len(ids):
        raise MergeError("merge_state_dicts: two models have the same ID")
    if base is not None and base not in ids:
        raise MergeError(f"merge_state_dicts: base {base!r} is not one of the models' IDs {ids}")
    states = {i: _state_dict(m, i) for i, m in items}
    names = _common_names(states, ids, strict)
    prefix = _statistics_prefix(items, names, statistics)
    merged_ids = [i for i in ids if i != base]
    copied = _copied_buffers(states, ids, names)
    floats = [n for n in names if n not in copied]

    def renamed(i: Hashable) -> dict[str, Any]:
        return {_strip(n, prefix): _cast(states[i][n], dtype) for n in floats}

    options = dict(parameters or {})
    weights = options.pop("weight", None)
    if weights is not None:
        options["coefficients"] = _per_model(weights, merged_ids, ids, "parameters['weight']")
    stats = None
    if statistics is not None:
        stats = _per_model(statistics, merged_ids, ids, "statistics")
    result = merge_models(
        [renamed(i) for i in merged_ids],
        "average" if method == "linear" else method,
        stats=stats,
        base=None if base is None else renamed(base),
        labels=[str(i) for i in merged_ids],
        progress=progress,
        **options,
    )
    merged = result.model_state(0)
    out = {}
    for n in names:
        out[n] = copied[n] if n in copied else _cast(merged[_strip(n, prefix)], out_dtype)
    return out


def _state_dict(model: Any, model_id: Hashable) -> dict[str, Any]:
    """A module's or mapping's tensors, detached."""
    if hasattr(model, "state_dict") and not isinstance(model, Mapping):
        model = model.state_dict()
    if not isinstance(model, Mapping):
        raise MergeError(
            f"merge_state_dicts: model {model_id!r} is a {type(model).__name__}; give a torch "
            "module or a state dict (name -> tensor)"
        )
    out = {}
    for name, t in model.items():
        if not isinstance(name, str) or not hasattr(t, "detach"):
            raise MergeError(
                f"merge_state_dicts: model {model_id!r}: entry {name!r} is not a named torch tensor"
            )
        if t.device.type == "meta":
            raise MergeError(
                f"merge_state_dicts: model {model_id!r}: tensor {name!r} is on the meta device "
                "(its values were never loaded); load the model's weights first"
            )
        out[name] = t.detach()
    return out


def _common_names(
    states: Mapping[Hashable, Mapping[str, Any]], ids: Sequence[Hashable], strict: bool
) -> list[str]:
    """The first model's keys (every input's, with ``strict``; else those all hold)."""
    first = states[ids[0]]
    for i in ids[1:]:
        keys = states[i]
        if strict and set(keys) != set(first):
            missing = sorted(set(first) - set(keys)) or sorted(set(keys) - set(first))
            raise MergeError(
                f"merge_state_dicts: model {i!r} and model {ids[0]!r} hold different tensors "
                f"(e.g. {missing[0]!r}); pass strict=False to merge the ones they share"
            )
    return [n for n in first if all(n in states[i] for i in ids)]


def _copied_buffers(
    states: Mapping[Hashable, Mapping[str, Any]], ids: Sequence[Hashable], names: Sequence[str]
) -> dict[str, Any]:
    """Non-floating-point tensors, equal in every input: copied, not merged."""
    out = {}
    for n in names:
        first = states[ids[0]][n]
        if first.is_floating_point():
            continue
        for i in ids[1:]:
            other = states[i][n]
            if other.shape != first.shape or not bool((other == first).all()):
                raise MergeError(
                    f"merge_state_dicts: tensor {n!r} ({first.dtype}, not merged) differs "
                    f"between model {ids[0]!r} and model {i!r}; the models must share it"
                )
        out[n] = first.clone()
    return out


def _statistics_prefix(
    items: Sequence[tuple[Hashable, Any]], names: Sequence[str], statistics: Any
) -> str:
    """The key prefix of the model the statistics were collected on: a sentence-transformers
    model's Transformer (``0.model.``), else none."""
    if statistics is None:
        return ""
    module = items[0][1]
    inner = hf_model_of(module) if hasattr(module, "named_modules") else module
    if inner is module:
        return ""
    for path, sub in module.named_modules():
        if sub is inner:
            prefix = f"{path}." if path else ""
            if not any(n.startswith(prefix) for n in names):
                break
            return prefix
    raise MergeError(
        "merge_state_dicts: cannot find the sentence-transformers model's Transformer among "
        "its modules, whose names the statistics use"
    )


def _strip(name: str, prefix: str) -> str:
    return name[len(prefix) :] if prefix and name.startswith(prefix) else name


def _torch_dtype(value: Any, what: str) -> Any:
    """The torch float dtype ``value`` names (a torch dtype, its name, a NumPy float dtype),
    or None; anything else is refused in one line."""
    if value is None:
        return None
    name = float_dtype_name(value)
    if name is None:
        raise MergeError(
            f"merge_state_dicts: {what} must be a floating-point dtype ("
            f"{', '.join(sorted(FLOAT_DTYPES))}: a torch dtype or its name), got {value!r}"
        )
    import torch

    return getattr(torch, name)


def _cast(t: Any, dtype: Any) -> Any:
    return t.to(dtype) if dtype is not None and t.is_floating_point() else t


def _per_model(
    value: Any, merged_ids: Sequence[Hashable], ids: Sequence[Hashable], what: str
) -> list[Any]:
    """A per-input value (a mapping by ID, a sequence in input order, or one value) for the
    merged models, in order."""
    if isinstance(value, Mapping):
        missing = [i for i in merged_ids if i not in value]
        if missing:
            raise MergeError(f"merge_state_dicts: {what} has nothing for model {missing[0]!r}")
        return [value[i] for i in merged_ids]
    if isinstance(value, (str, os.PathLike, Statistics)) or not isinstance(value, Sequence):
        return [value] * len(merged_ids)
    if len(value) == len(ids) and len(ids) != len(merged_ids):
        return [v for i, v in zip(ids, value, strict=True) if i in merged_ids]
    if len(value) != len(merged_ids):
        raise MergeError(
            f"merge_state_dicts: {what} has {len(value)} entries for {len(merged_ids)} merged "
            "models"
        )
    return list(value)
