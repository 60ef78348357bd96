"""A model in memory as its ``save_pretrained`` folder stores it.

transformers (5.x) converts some weights between the checkpoint on disk and the model in
memory: it renames them (ViT's ``encoder.layer.0.attention.attention.query`` is
``layers.0.attention.q_proj`` in memory, GPT-NeoX's ``embed_out`` is ``lm_head``) and
fuses others (Mixtral's, Qwen2-MoE's and OLMoE's per-expert ``w1``/``w3``/``w2`` or
``gate_proj``/``up_proj``/``down_proj`` matrices are 3-D ``gate_up_proj`` and ``down_proj``
tensors of experts × out × in in memory); ``save_pretrained`` converts them back. A merge
reads checkpoints, so lmdx names, hashes and merges every model by the names and tensors
of its saved form: :func:`saved_state` is ``model.state_dict()`` as ``save_pretrained``
writes it (with transformers' own ``revert_weight_conversion``), and
:func:`saved_sources` says, for tensors transformers converts, which in-memory values each
saved tensor holds, element by element.

With a transformers that converts nothing (4.x), the saved form is the state dict.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

__all__ = ["SavedSource", "saved_form", "saved_sources", "saved_state"]


def _reverter() -> Any:
    """transformers' ``revert_weight_conversion`` (None where transformers has none)."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:
        return None
    return revert_weight_conversion


def saved_form(model: Any, state: Mapping[str, Any]) -> dict[str, Any]:
    """Tensors named and shaped like ``model``'s parameters (its state dict or values per
    parameter, e.g. Fisher sums) under the names and in the shapes ``save_pretrained``
    writes: transformers' conversions reverted, or ``state`` unchanged for a model that
    has none."""
    revert = _reverter()
    if revert is None or not hasattr(model, "config"):
        return dict(state)
    return dict(revert(model, dict(state)))


def saved_state(model: Any) -> dict[str, Any]:
    """``model.state_dict()`` under the names, and in the shapes, ``save_pretrained``
    writes: transformers' weight conversions reverted (renamed tensors are the very
    in-memory tensors under their saved names; split ones are new tensors). Tied weights
    stay under each of their names (``save_pretrained`` stores them once). A torch module
    that is not a Hugging Face model is returned as its state dict."""
    return saved_form(model, model.state_dict())


def _key(t: Any) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
    return (t.data_ptr(), tuple(t.shape), tuple(t.stride()))


@dataclass(frozen=True)
class SavedSource:
    """Where the values of one saved tensor come from in memory.

    Attributes
    ----------
    saved
        The saved tensor's name.
    memory
        The in-memory tensor its values come from.
    index
        ``None``: the saved tensor *is* the in-memory tensor (renamed or not). Otherwise,
        per saved element (an array of the saved tensor's shape), the flat C-order index
        of the in-memory element it holds.
    """

    saved: str
    memory: str
    index: NDArray[np.int64] | None = None


def saved_sources(
    model: Any, names: Iterable[str], saved: Mapping[str, Any]
) -> tuple[dict[str, list[SavedSource]], dict[str, str]]:
    """For the in-memory tensors ``names`` of ``model``, the saved tensors holding their
    values (``saved`` is :func:`saved_state` of the model).

    A saved tensor that is an in-memory tensor (same storage, shape and strides) comes
    from it as a whole. The rest are traced by converting, one parent module at a time,
    integer tensors that hold each in-memory element's index in place of its value
    (transformers' conversions only move elements): this costs 8 bytes per element of the
    converted tensors, once. Saved tensors whose elements come from several in-memory
    tensors are not traced.

    Returns
    -------
    (sources, untraced)
        ``sources``: in-memory name -> its saved tensors (an in-memory tensor that is
        saved under a name as it is, usually its own); ``untraced``: in-memory name ->
        why its saved form could not be traced.
    """
    import torch

    state = model.state_dict()
    names = [n for n in names if n in state]
    by_key: dict[tuple[int, tuple[int, ...], tuple[int, ...]], list[str]] = {}
    for s_name, t in saved.items():
        if hasattr(t, "data_ptr") and t.numel():
            by_key.setdefault(_key(t), []).append(s_name)
    sources: dict[str, list[SavedSource]] = {}
    untraced: dict[str, str] = {}
    pending: dict[str, list[str]] = {}
    for n in names:
        hits = by_key.get(_key(state[n]), [])
        if hits:  # the tensor itself: under its own name if saved so, else renamed
            chosen = n if n in hits else hits[0]
            sources[n] = [SavedSource(chosen, n)]
        else:
            pending.setdefault(n.rpartition(".")[0], []).append(n)
    for parent, members in pending.items():
        tags: dict[str, Any] = {}
        offsets = []
        start = 0
        for n in members:
            k = int(state[n].numel())
            tags[n] = torch.arange(start, start + k, dtype=torch.int64).reshape(state[n].shape)
            offsets.append(start)
            start += k
        try:
            converted = saved_form(model, tags)
        except Exception as exc:  # transformers' own conversion code: any failure means untraced
            for n in members:
                untraced[n] = f"transformers' conversion of {parent!r} could not be traced ({exc})"
            continue
        found: dict[str, list[SavedSource]] = {n: [] for n in members}
        mixed = []
        for s_name, t in converted.items():
            if s_name not in saved:
                continue
            if tuple(saved[s_name].shape) != tuple(t.shape):
                mixed.append(s_name)
                continue
            values = t.numpy()
            owner = np.searchsorted(offsets, values, side="right") - 1
            if values.size == 0 or not (owner == owner.flat[0]).all():
                mixed.append(s_name)
                continue
            j = int(owner.flat[0])
            found[members[j]].append(
                SavedSource(s_name, members[j], np.ascontiguousarray(values - offsets[j]))
            )
        for n in members:
            if found[n]:
                sources[n] = found[n]
            else:
                why = f" (saved tensors mix it with others: {mixed[:2]})" if mixed else ""
                untraced[n] = f"no saved tensor holds only values of {n!r}{why}"
    return sources, untraced
