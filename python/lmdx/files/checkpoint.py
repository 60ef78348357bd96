"""The weights of a Hugging Face model folder, read one tensor at a time."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from numpy.typing import NDArray

from .._errors import MergeError, MissingFileError
from .._tensors import FLOAT_DTYPES, TORCH_OF_ST
from .digest import DIGEST
from .parse import read_json
from .safetensors import SafetensorsFile, open_shards, read_safetensors_header

__all__ = ["INDEX_FILE", "SINGLE_FILE", "Checkpoint"]

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


class Checkpoint:
    """The weights of a Hugging Face model folder, read one tensor at a time.

    ``path`` is a ``save_pretrained`` folder holding ``model.safetensors`` or
    ``model.safetensors.index.json`` with its shards (or a single ``.safetensors``
    file). Every shard's header is validated against its size when opened; a shard
    missing, cut short or not holding what the index says raises :class:`MergeError`
    naming the file.
    """

    def __init__(self, path: str | os.PathLike[str], label: str | None = None) -> None:
        self.path = Path(path)
        self.label = label or str(path)
        self.config: dict[str, Any] = {}
        self._files: dict[Path, SafetensorsFile] = {}
        self._where: dict[str, SafetensorsFile] = {}
        self._digests: dict[tuple[str, str], str] = {}
        if self.path.is_file():
            self._open_single(self.path)
            return
        if not self.path.is_dir():
            raise MissingFileError(f"model {self.path}: no such folder")
        cfg = self.path / "config.json"
        if cfg.is_file():
            config = read_json(cfg, "model configuration", MergeError, allow_nonfinite=True)
            archs = config.get("architectures") if isinstance(config, dict) else None
            names = isinstance(archs, list) and all(isinstance(a, str) for a in archs)
            if not isinstance(config, dict) or not (archs is None or names):
                raise MergeError(
                    f"model configuration {cfg}: expected an object whose architectures is a "
                    "list of class names; re-save the model"
                )
            self.config = config
        index = self.path / INDEX_FILE
        if index.is_file():
            self._open_index(index)
        elif (self.path / SINGLE_FILE).is_file():
            self._open_single(self.path / SINGLE_FILE)
        else:
            found = sorted(p.name for p in self.path.iterdir() if p.suffix in (".bin", ".pt"))
            hint = (
                f" (it has {found[0]}: a pickle checkpoint; re-save the model with "
                "save_pretrained(..., safe_serialization=True), or use the in-memory merge)"
                if found
                else ""
            )
            raise MergeError(f"model {self.path}: no {SINGLE_FILE} or {INDEX_FILE}{hint}")

    def _open_single(self, file: Path) -> None:
        handle = read_safetensors_header(file, "shard", MergeError)
        self._files[file] = handle
        for name in handle.keys():
            self._where[name] = handle

    def _open_index(self, index: Path) -> None:
        data = read_json(index, "model index", MergeError)
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict):
            raise MergeError(
                f"model index {index}: is not a valid index (no weight_map object); re-save "
                "the model"
            )
        self._where = open_shards(self.path, weight_map, index.name, "model", MergeError)
        self._files = {h.path: h for h in self._where.values()}

    # -- queries --------------------------------------------------------------------

    def names(self) -> list[str]:
        return list(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(name).shape(name))

    def dtype(self, name: str) -> str:
        """torch dtype name (``"float32"``, ``"bfloat16"``, ``"int64"``, ...)."""
        return TORCH_OF_ST[self._handle(name).dtype(name)]

    def is_float(self, name: str) -> bool:
        return self.dtype(name) in FLOAT_DTYPES

    def nbytes(self, name: str) -> int:
        return self._handle(name).nbytes(name)

    def file_of(self, name: str) -> Path:
        return self._handle(name).path

    def where(self, name: str) -> str:
        """`` (in FILE)``: the file holding ``name``, for messages."""
        return f" (in {self.file_of(name).name})"

    def aliases(self) -> dict[str, str]:
        """Tied weights are stored once and the file does not say so: none known here."""
        return {}

    def total_bytes(self) -> int:
        return sum(f.path.stat().st_size for f in self._files.values())

    def _handle(self, name: str) -> SafetensorsFile:
        try:
            return self._where[name]
        except KeyError:
            raise MergeError(f"model {self.label}: no tensor {name!r}") from None

    def read(self, name: str) -> NDArray[Any]:
        """One tensor as a NumPy array of its stored dtype (bfloat16 as
        :func:`lmdx._tensors.bfloat16_dtype`; :func:`lmdx._tensors.to_torch` makes it a torch
        tensor)."""
        handle = self._handle(name)
        try:
            return handle.get_raw(name)
        except ValueError as exc:
            raise MergeError(f"model {self.label}: {exc}") from None

    def read_rows(self, name: str, start: int, stop: int) -> NDArray[Any]:
        """Rows ``start:stop`` of a tensor (its first axis) as :meth:`read` returns them,
        without reading the rest."""
        handle = self._handle(name)
        try:
            return handle.get_rows(name, start, stop)
        except ValueError as exc:
            raise MergeError(f"model {self.label}: {exc}") from None

    def digest(self, name: str, algorithm: str = DIGEST) -> str:
        """The content hash of tensor ``name`` as stored (:mod:`lmdx.files.digest`)."""
        key = (algorithm, name)
        if key not in self._digests:
            self._digests[key] = self._handle(name).digest(name, algorithm)
        return self._digests[key]

    def architecture(self) -> str | None:
        archs = self.config.get("architectures") or []
        return str(archs[0]) if archs else None
