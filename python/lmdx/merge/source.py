"""Where a merge reads its tensors: one interface over a model in memory and a checkpoint
on disk, so one engine serves both.

:class:`lmdx.files.Checkpoint` (a ``save_pretrained`` folder read tensor by tensor),
:class:`StateDictSource` (a torch module or state dict) and :class:`AdapterSource` (a
PEFT LoRA adapter over either) all provide what the engine asks of a
:class:`TensorSource`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from .._errors import MergeError
from .._tensors import FLOAT_DTYPES, as_float64, dtype_name
from ..files.checkpoint import Checkpoint
from ..files.digest import DIGEST, tensor_digest
from ..files.hf import base_model_info, load_model
from ..files.peft import LoraAdapter, is_peft_model
from ..files.saved import saved_state

__all__ = [
    "AdapterSource",
    "PrefixedSource",
    "StateDictSource",
    "TensorSource",
    "base_as_named",
    "model_source",
    "read_rows",
]


class TensorSource(Protocol):
    """The tensors of one model as a merge reads them.

    ``names()`` lists the tensors stored once each (a tied weight under its first name
    only); :meth:`aliases` maps the other names of tied weights to the stored one where
    the source knows them.
    """

    label: str
    config: dict[str, Any]

    @property
    def path(self) -> Path | None: ...

    def names(self) -> list[str]: ...

    def __contains__(self, name: str) -> bool: ...

    def shape(self, name: str) -> tuple[int, ...]: ...

    def dtype(self, name: str) -> str: ...

    def is_float(self, name: str) -> bool: ...

    def nbytes(self, name: str) -> int: ...

    def where(self, name: str) -> str: ...

    def read(self, name: str) -> Any: ...

    def digest(self, name: str, algorithm: str = DIGEST) -> str: ...

    def architecture(self) -> str | None: ...

    def aliases(self) -> dict[str, str]: ...

    def total_bytes(self) -> int: ...


class StateDictSource:
    """A model in memory (torch module or name -> tensor mapping) as a tensor source.

    Tensors sharing storage with an earlier one (tied weights, which ``save_pretrained``
    stores once) are listed under their first name only and reported by :meth:`aliases`.
    """

    def __init__(
        self,
        state: Mapping[str, Any],
        label: str,
        *,
        architecture: str | None = None,
        config: Mapping[str, Any] | None = None,
        path: Path | None = None,
    ) -> None:
        self.label = label
        self.config = dict(config or {})
        self._state = dict(state)
        self._architecture = architecture
        self._path = path
        self._digests: dict[tuple[str, str], str] = {}
        self._aliases: dict[str, str] = {}
        first: dict[tuple[int, tuple[int, ...]], str] = {}
        for name, t in self._state.items():
            if not hasattr(t, "data_ptr") or t.numel() == 0:
                continue
            key = (t.data_ptr(), tuple(t.shape))
            if key in first:
                self._aliases[name] = first[key]
            else:
                first[key] = name
        self._names = [n for n in self._state if n not in self._aliases]

    @classmethod
    def of_model(cls, model: Any, label: str, *, path: Path | None = None) -> StateDictSource:
        """A torch module (its tensors as ``save_pretrained`` stores them, its class name and
        Hugging Face config) or a state dict."""
        if isinstance(model, Mapping):
            return cls(model, label, path=path)
        if not hasattr(model, "state_dict"):
            raise MergeError(f"{label}: expected a torch module, a state dict or a model folder")
        if path is None:  # a Hugging Face model remembers the folder it was loaded from
            loaded_from = Path(str(getattr(model, "name_or_path", "") or "."))
            path = loaded_from if str(loaded_from) != "." and loaded_from.is_dir() else None
        return cls(
            saved_state(model),
            label,
            architecture=type(model).__name__,
            config=config_of(model),
            path=path,
        )

    @property
    def path(self) -> Path | None:
        """The folder the model was loaded from, if any."""
        return self._path

    @property
    def state(self) -> dict[str, Any]:
        """Every tensor by name, tied aliases included."""
        return self._state

    def names(self) -> list[str]:
        return list(self._names)

    def __contains__(self, name: str) -> bool:
        return name in self._state and name not in self._aliases

    def _get(self, name: str) -> Any:
        try:
            return self._state[name]
        except KeyError:
            raise MergeError(f"model {self.label}: no tensor {name!r}") from None

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(int(s) for s in self._get(name).shape)

    def dtype(self, name: str) -> str:
        return dtype_name(self._get(name))

    def is_float(self, name: str) -> bool:
        return self.dtype(name) in FLOAT_DTYPES

    def nbytes(self, name: str) -> int:
        t = self._get(name)
        itemsize = t.element_size() if hasattr(t, "element_size") else np.asarray(t).itemsize
        return int(np.prod(self.shape(name), dtype=np.int64)) * int(itemsize)

    def where(self, name: str) -> str:
        return ""

    def read(self, name: str) -> Any:
        return self._get(name)

    def digest(self, name: str, algorithm: str = DIGEST) -> str:
        key = (algorithm, name)
        if key not in self._digests:
            self._digests[key] = tensor_digest(self._get(name), algorithm)
        return self._digests[key]

    def architecture(self) -> str | None:
        return self._architecture

    def aliases(self) -> dict[str, str]:
        return dict(self._aliases)

    def total_bytes(self) -> int:
        return sum(self.nbytes(n) for n in self._names)


def config_of(model: Any) -> dict[str, Any]:
    """A Hugging Face model's configuration as ``save_pretrained`` writes it (its class
    in ``architectures``, its dtype); ``{}`` for a model without one."""
    cfg = getattr(model, "config", None)
    if cfg is None or not hasattr(cfg, "to_dict"):
        return {}
    out: dict[str, Any] = cfg.to_dict()
    out["architectures"] = [type(model).__name__]
    if hasattr(model, "dtype"):
        out["dtype"] = dtype_name(model)
    return out


def model_source(model: Any, label: str, *, progress: bool = True) -> StateDictSource:
    """A model for the in-memory merge: a torch module, a state dict or a model folder
    (loaded with the class its ``config.json`` names)."""
    if isinstance(model, (str, os.PathLike)):
        path = Path(model)
        return StateDictSource.of_model(load_model(path, progress=progress), label, path=path)
    if is_peft_model(model):
        raise MergeError(
            f"{label}: a PEFT model in memory; give its adapter folder (save_pretrained) with "
            "base= (the model it adapts), or merge it into its base first (merge_and_unload)"
        )
    return StateDictSource.of_model(model, label)


class AdapterSource:
    """A PEFT LoRA adapter over a base model (a :class:`TensorSource`), read as the model
    PEFT's ``merge_and_unload`` gives: each adapted weight ``W₀ + scaling · B A`` (float64,
    :class:`lmdx.files.peft.LoraAdapter`), each tensor the adapter replaces as the adapter
    stores it, everything else the base's. Shapes and dtypes are the base's.

    :meth:`low_rank` gives the merge the factors instead of the dense weight.
    """

    def __init__(self, base: TensorSource, adapter: LoraAdapter, label: str) -> None:
        adapter.bind(base.shape, base.names())
        self.base = base
        self.adapter = adapter
        self.label = label
        self.config = base.config

    @property
    def path(self) -> Path | None:
        """The adapter folder."""
        return self.adapter.path

    def names(self) -> list[str]:
        return self.base.names()

    def __contains__(self, name: str) -> bool:
        return name in self.base

    def shape(self, name: str) -> tuple[int, ...]:
        return self.base.shape(name)

    def dtype(self, name: str) -> str:
        return self.base.dtype(name)

    def is_float(self, name: str) -> bool:
        return self.base.is_float(name)

    def nbytes(self, name: str) -> int:
        return self.base.nbytes(name)

    def where(self, name: str) -> str:
        if name in self.adapter.targets or name in self.adapter.overrides:
            return f" (adapter {self.adapter.label})"
        return self.base.where(name)

    def read(self, name: str) -> Any:
        """The adapted tensor: float64 for a LoRA-adapted weight, else as stored."""
        replaced = name in self.adapter.overrides
        tensor = self.adapter.read_override(name) if replaced else self.base.read(name)
        if name in self.adapter.targets:
            return as_float64(tensor, name) + self.adapter.delta(name)
        return tensor

    def low_rank(self, name: str, layout: str) -> tuple[Any, Any] | None:
        """(``scaling · B``, ``A``) whose product is the update of weight ``name`` as the
        layer computes with it, ``[out, in]`` (the stored weight for ``layout="linear"``,
        its transpose for ``"conv1d"``); factors of rank 0 where the adapter leaves the
        weight unchanged; None where the adapter replaces the base weight by another."""
        if name in self.adapter.overrides and self.digest(name) != self.base.digest(name):
            return None
        target = self.adapter.targets.get(name)
        if target is None:
            rows, cols = self.shape(name)
            out, inp = (rows, cols) if layout == "linear" else (cols, rows)
            return np.zeros((out, 0)), np.zeros((0, inp))
        if target.transposed != (layout == "conv1d"):
            raise MergeError(
                f"adapter {self.adapter.label}: {name!r} is a {layout} layer but the adapter's "
                "update is oriented for the other layout (fan_in_fan_out); fix "
                "fan_in_fan_out in its adapter_config.json"
            )
        return self.adapter.factors(name)

    def digest(self, name: str, algorithm: str = DIGEST) -> str:
        if name in self.adapter.overrides:
            return str(self.adapter.tensors.digest(self.adapter.overrides[name], algorithm))
        return self.base.digest(name, algorithm)

    def architecture(self) -> str | None:
        return self.base.architecture()

    def aliases(self) -> dict[str, str]:
        return self.base.aliases()

    def total_bytes(self) -> int:
        return self.base.total_bytes() + self.adapter.total_bytes()


def base_as_named(base: TensorSource, ref: TensorSource) -> tuple[TensorSource, str | None]:
    """``base`` under the names the models (``ref``) give its tensors, and the prefix
    added (None: none). A bare encoder (``BertModel``: ``embeddings.*``) is the base of
    task classes (``BertForSequenceClassification``: ``bert.embeddings.*``): it is read
    with the models' ``base_model_prefix`` (:class:`PrefixedSource`), as transformers loads
    one into the other, when none of the models' names is the base's and some are so.
    (Only then is the prefix looked up: it imports transformers, seconds for a merge
    that otherwise needs none.)"""
    names = ref.names()
    if any(n in base for n in names):
        return base, None
    prefix, _ = base_model_info(ref.config)
    if prefix:
        mapped = PrefixedSource(base, prefix)
        if any(n in mapped for n in names):
            return mapped, prefix
    return base, None


class PrefixedSource:
    """A bare model's tensors under the names its task classes give them,
    ``PREFIX.name`` (the class's ``base_model_prefix``, as transformers maps a
    ``BertModel`` checkpoint into ``BertForSequenceClassification``: ``embeddings.*`` is
    ``bert.embeddings.*``)."""

    def __init__(self, inner: TensorSource, prefix: str) -> None:
        self.inner, self.prefix = inner, prefix
        self.label, self.config = inner.label, inner.config

    @property
    def path(self) -> Path | None:
        return self.inner.path

    def _inner(self, name: str) -> str:
        return name.removeprefix(self.prefix + ".")

    def names(self) -> list[str]:
        return [f"{self.prefix}.{n}" for n in self.inner.names()]

    def __contains__(self, name: str) -> bool:
        return name.startswith(self.prefix + ".") and self._inner(name) in self.inner

    def shape(self, name: str) -> tuple[int, ...]:
        return self.inner.shape(self._inner(name))

    def dtype(self, name: str) -> str:
        return self.inner.dtype(self._inner(name))

    def is_float(self, name: str) -> bool:
        return self.inner.is_float(self._inner(name))

    def nbytes(self, name: str) -> int:
        return self.inner.nbytes(self._inner(name))

    def where(self, name: str) -> str:
        return self.inner.where(self._inner(name))

    def read(self, name: str) -> Any:
        return self.inner.read(self._inner(name))

    def digest(self, name: str, algorithm: str = DIGEST) -> str:
        return self.inner.digest(self._inner(name), algorithm)

    def architecture(self) -> str | None:
        return self.inner.architecture()

    def aliases(self) -> dict[str, str]:
        p = self.prefix
        return {f"{p}.{a}": f"{p}.{b}" for a, b in self.inner.aliases().items()}

    def total_bytes(self) -> int:
        return self.inner.total_bytes()


def read_rows(source: TensorSource, name: str, start: int, stop: int) -> Any:
    """Rows ``start:stop`` of tensor ``name`` (its first axis): read alone from a
    checkpoint, sliced from any other source."""
    if isinstance(source, Checkpoint):
        return source.read_rows(name, start, stop)
    return source.read(name)[start:stop]
