"""Statistics written tensor by tensor, in any order, to one file or a sharded folder,
with the content hashes of :mod:`lmdx.stats.format` (every tensor's and the metadata's)."""

from __future__ import annotations

import contextlib
import json
import os
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from numpy.typing import NDArray

from .._util import parse_size, split_in_order
from ..files.atomic import atomic_directory
from ..files.safetensors import SafetensorsWriter, TensorSpec
from .format import FORMAT_VERSION, HASHES, INDEX_FORMAT, INDEX_NAME, metadata_hash, stored_hash

__all__ = ["StatisticsWriter"]


class StatisticsWriter:
    """Write statistics tensor by tensor, in any order, to one file or a sharded folder.

    All tensors are announced up front (their shapes are known before any data is seen)
    and disk space is reserved then; each tensor is written as soon as it is final; the
    metadata, whose counts are known only at the end, is given to :meth:`close`. The
    file (or folder) appears only when complete; on any error (including Ctrl-C)
    nothing is left behind.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        specs: Sequence[TensorSpec],
        metadata: Mapping[str, Any],
        *,
        max_shard_size: int | str | None = None,
    ) -> None:
        self.path = Path(path)
        self._stack = contextlib.ExitStack()
        self._writers: dict[str, SafetensorsWriter] = {}
        self._left: dict[str, int] = {}
        self._shard_of: dict[str, str] = {}
        self._hashes: dict[str, str] = {}
        try:
            if max_shard_size is None:
                # room for the counts, the content hashes and anything else that grows by
                # the end (names are escaped twice: JSON in a JSON string)
                reserve = 4096 + sum(2 * len(json.dumps(json.dumps(s.name))) + 96 for s in specs)
                w = SafetensorsWriter(
                    self.path, specs, {"lmdx": json.dumps(metadata)}, header_reserve=reserve
                )
                self._single: SafetensorsWriter | None = w
                return
            self._single = None
            limit = parse_size(max_shard_size)
            if self.path.suffix == ".safetensors":
                raise ValueError(
                    f"{self.path}: sharded statistics are a folder; give a name without "
                    ".safetensors"
                )
            self._tmp = self._stack.enter_context(atomic_directory(self.path))
            self.id = uuid.uuid4().hex
            groups = split_in_order([spec.nbytes for spec in specs], limit)
            shards = [[specs[i] for i in group] for group in groups]
            n = len(shards)
            for j, members in enumerate(shards):
                fname = f"stats-{j + 1:05d}-of-{n:05d}.safetensors"
                tag = json.dumps({"id": self.id, "shard": j + 1, "of": n})
                self._writers[fname] = SafetensorsWriter(
                    self._tmp / fname, members, {"lmdx_shard": tag}
                )
                self._left[fname] = len(members)
                for spec in members:
                    self._shard_of[spec.name] = fname
        except BaseException as exc:
            self.abort(exc)
            raise

    def write(self, name: str, arr: NDArray[Any]) -> None:
        self._hashes[name] = stored_hash(arr)
        if self._single is not None:
            self._single.write(name, arr)
            return
        fname = self._shard_of.get(name)
        if fname is None:
            raise ValueError(f"{self.path}: tensor {name!r} was not announced")
        self._writers[fname].write(name, arr)
        self._left[fname] -= 1
        if self._left[fname] == 0:  # shard complete: flush and close it now
            self._writers[fname].close()

    def _hashed(self, metadata: Mapping[str, Any]) -> dict[str, Any]:
        """``metadata`` with its content hashes (JSON round trip first, so the hash is of
        exactly what a reader will parse)."""
        meta: dict[str, Any] = json.loads(json.dumps(dict(metadata)))
        for key in HASHES.values():
            meta.pop(key, None)
        meta["format_version"] = FORMAT_VERSION  # the version whose hashes are written
        meta[HASHES[FORMAT_VERSION]] = {
            "tensors": dict(self._hashes),
            "metadata": metadata_hash(meta),
        }
        return meta

    def close(self, metadata: Mapping[str, Any]) -> Path:
        """Finish with the final metadata (counts included); the content hashes are added."""
        try:
            metadata = self._hashed(metadata)
            if self._single is not None:
                self._single.set_metadata({"lmdx": json.dumps(metadata)})
                self._single.close()
                return self.path
            missing = [n for n, left in self._left.items() if left]
            if missing:
                raise ValueError(f"{self.path}: shard {missing[0]} was never completed")
            index = {
                "format": INDEX_FORMAT,
                "id": self.id,
                "metadata": dict(metadata),
                "weight_map": self._shard_of,
            }
            (self._tmp / INDEX_NAME).write_text(json.dumps(index, indent=1))
        except BaseException as exc:
            self.abort(exc)
            raise
        self._stack.close()
        return self.path

    def abort(self, exc: BaseException) -> None:
        single = getattr(self, "_single", None)
        if single is not None:
            single.abort(exc)
        for w in self._writers.values():
            if w.missing() or w.is_open:
                w.abort(exc)
        with contextlib.suppress(BaseException):
            self._stack.__exit__(type(exc), exc, exc.__traceback__)

    def __enter__(self) -> StatisticsWriter:
        return self

    def __exit__(self, typ: Any, exc: Any, tb: Any) -> None:
        if exc is not None:
            self.abort(exc)
