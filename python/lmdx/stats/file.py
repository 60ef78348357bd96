"""Statistics files: the artifact contributors share instead of their data.

One safetensors file holds, in float64,

* ``kind = "regmean-gram"``: per *input group* (one or more linear modules that read the
  same input tensor) the packed upper triangle of the Gram ``G = Σ x xᵀ`` (row-major,
  ``d(d+1)/2`` values, tensor ``gram/<group>``) and the sum ``s = Σ x`` (``sum/<group>``);
* ``kind = "fisher"``: per parameter the sum over examples of squared gradients
  (``fisher/<parameter>``);

plus JSON metadata (``__metadata__["lmdx"]``): format version, kind, the identity of the
model they were computed on (architecture, every parameter's name, shape, dtype and
content hash), the user's data description, the padding policy, counts and, for Grams,
which module reads which group and in which layout. Sums (not means) are stored, so
statistics of disjoint data shards add exactly: :func:`add_statistics`.

Loading (:meth:`Statistics.load`) validates the whole header against the file; tensors
are read one group at a time when merging (each Gram memory-mapped while the merge holds
it, :meth:`Statistics.gram_stored`; nothing stays resident after). No pickle is involved.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from .._errors import (
    MergeError,
    MissingStatisticsError,
    ModelMismatchError,
    StatisticsFileError,
)
from ..files.identity import describe_mismatch
from ..files.parse import parse_json, read_json
from ..files.safetensors import (
    SafetensorsFile,
    TensorSpec,
    open_shards,
    read_safetensors_header,
)
from ..moments import Moments
from .format import (
    FORMAT,
    FORMAT_VERSION,
    INDEX_FORMAT,
    INDEX_NAME,
    KINDS,
    check_content,
    content_sha256,
    stored_hash,
    validate_metadata,
)
from .packing import pack_upper, unpack_upper
from .writer import StatisticsWriter

__all__ = ["ACCUMULATIONS", "Statistics", "coarsest_accumulation"]


#: How Grams are accumulated, from the coarsest to the finest (``Statistics.accumulation``):
#: float32 products summed by torch in blocks of rows on the collecting device, then in
#: float64 (:mod:`lmdx.stats.torch_gram`); lmdx's kernel: float32 sums over at most 64
#: rows, then float64 (the bf16 dot-product kernel adds up to 8 such sums in float32
#: first, :mod:`lmdx.moments`); float64 throughout.
ACCUMULATIONS = ("torch-float32", "mixed", "float64")


def coarsest_accumulation(parts: Sequence[Statistics]) -> str | None:
    """The coarsest accumulation of ``parts`` (statistics combined from them are no finer),
    or None if any part does not record one."""
    found = [p.accumulation for p in parts]
    if any(a not in ACCUMULATIONS for a in found):
        return None
    return min((str(a) for a in found), key=ACCUMULATIONS.index)


class Statistics:
    """Gram (RegMean) or diagonal Fisher statistics of one model on one dataset.

    Build with :func:`lmdx.stats.collect.collect_regmean_stats` /
    :func:`lmdx.stats.fisher.collect_fisher`, or :meth:`load` a file. Tensors are read lazily
    (one group at a time) from a loaded file.

    Attributes
    ----------
    kind
        ``"regmean-gram"`` or ``"fisher"``.
    model
        Identity of the model the statistics belong to (:func:`lmdx.files.identity.model_identity`).
    data
        The user's description of the data.
    padding
        ``"excluded"`` or ``"included"`` (Grams), None for Fisher.
    modules
        Grams: module name -> ``{"group", "layout", "weight", "dim"}``.
    groups
        Grams: group name -> ``{"dim", "count"}``.
    parameters
        Fisher: parameter name -> ``{"shape"}``.
    files
        The files or folders the statistics are read from (:attr:`files`).
    """

    def __init__(
        self,
        *,
        kind: str,
        model: Mapping[str, Any],
        data: str = "",
        padding: str | None = None,
        modules: Mapping[str, Mapping[str, Any]] | None = None,
        groups: Mapping[str, Mapping[str, Any]] | None = None,
        parameters: Mapping[str, Mapping[str, Any]] | None = None,
        count: float | None = None,
        tensors: Mapping[str, NDArray[Any] | Callable[[], NDArray[Any]]] | None = None,
        moments: Mapping[str, Moments] | None = None,
        source: str | None = None,
        extra: Mapping[str, Any] | None = None,
        files: Sequence[str] | None = None,
    ) -> None:
        if kind not in KINDS:
            raise ValueError(f"kind: expected one of {KINDS}, got {kind!r}")
        self.kind = kind
        self.model = dict(model)
        self.data = str(data)
        self.padding = padding
        self.modules = {k: dict(v) for k, v in (modules or {}).items()}
        self.groups = {k: dict(v) for k, v in (groups or {}).items()}
        self.parameters = {k: dict(v) for k, v in (parameters or {}).items()}
        self._count = count
        self._tensors: dict[str, Any] = dict(tensors or {})
        self._moments: dict[str, Moments] = dict(moments or {})
        self._file: Any = None
        self._hashes: dict[str, str] = {}  # a loaded file's tensors' content hashes
        self._version = FORMAT_VERSION  # ... in the hash of this format version
        self._content_sha256: str | None = None
        self.source = source
        self._files = None if files is None else tuple(str(f) for f in files)
        self.extra = dict(extra or {})
        if kind == "regmean-gram" and "precision" in self.extra:
            # older files call the Gram accumulation "precision" (its earlier name)
            self.extra.setdefault("accumulation", self.extra["precision"])
            del self.extra["precision"]

    # ------------------------------------------------------------------ accessors

    @property
    def accumulation(self) -> str | None:
        """Grams: how they were accumulated (:data:`ACCUMULATIONS`: ``"mixed"``, float32
        products of chunks of rows summed in float64 by lmdx's kernel; ``"torch-float32"``,
        the same by torch's matmul in blocks of 256 rows on the collecting device;
        ``"float64"``), or None where the statistics do not say (files
        written before lmdx recorded it). Files that call it ``extra["precision"]`` read
        the same."""
        found = self.extra.get("accumulation")
        return found if isinstance(found, str) else None

    @property
    def content_sha256(self) -> str | None:
        """Loaded statistics' identity, from the file's (or sharded folder's) metadata
        without reading a tensor: SHA-256 over the content hashes it holds, the metadata's
        and every tensor's (:func:`lmdx.stats.format.content_sha256`); each tensor is
        checked against its hash whenever read. None for statistics held in memory."""
        return self._content_sha256

    @property
    def format_version(self) -> int:
        """The statistics format of the file (or sharded folder) these statistics were
        read from (:data:`lmdx.stats.format.HASHES`: 2 holds SHA-256 content hashes, 3
        BLAKE3); the version this lmdx writes for statistics held in memory."""
        return self._version

    @property
    def files(self) -> tuple[str, ...] | None:
        """The files or folders these statistics are read from, as given: a loaded one's
        own, joined ones' parts' (:func:`lmdx.stats.join_statistics`); None where they are
        (partly) held in memory. Another process can open them again from these."""
        return self._files

    @property
    def not_solved(self) -> dict[str, str]:
        """Grams: linear weights of the model that got no statistics, with why (e.g. MoE
        experts of an interface lmdx does not know): a merge averages them. Entries of
        ``extra["not_solved"]`` that are not text are left out."""
        found = self.extra.get("not_solved")
        if not isinstance(found, Mapping):
            return {}
        return {str(k): v for k, v in found.items() if isinstance(v, str)}

    def group_of(self, module: str) -> str:
        try:
            return str(self.modules[module]["group"])
        except KeyError:
            raise MissingStatisticsError(
                f"{self._where()}: no statistics for module {module!r}"
            ) from None

    def rows_seen(self, module: str, owner: str) -> float:
        """:meth:`count` of ``module``, refused in one line naming ``owner`` (whose
        statistics these are) when the module saw no rows: there is nothing to weigh by."""
        n = self.count(module)
        if not n > 0:
            raise MergeError(
                f"statistics {self.source or owner} (of {owner}): module {module!r} saw no "
                "rows; collect them on data that reaches it, or exclude it"
            )
        return n

    def count(self, module: str | None = None) -> float:
        """Rows seen by a module's input (Grams) or examples (Fisher)."""
        if self.kind == "fisher":
            return float(self._count or 0.0)
        g = self.group_of(str(module))
        if g in self._moments:
            return self._moments[g].count
        return float(self.groups[g]["count"])

    def gram(self, module: str) -> NDArray[np.float64]:
        """The (d, d) float64 Gram ``Σ x xᵀ`` of a module's input."""
        g = self.group_of(module)
        if g in self._moments:
            return self._moments[g].gram()
        return unpack_upper(self.tensor(f"gram/{g}"), int(self.groups[g]["dim"]))

    def gram_stored(self, module: str) -> NDArray[np.float64]:
        """A module's input Gram as held: its upper triangle packed row by row (1-D, as
        files store it) when read from a file, the full (d, d) matrix when accumulated in
        memory. :func:`lmdx.regmean_merge_layer` takes either, so a merge never unpacks.
        From a file it is read as ``SafetensorsFile.get_mapped`` reads it: little-endian
        float64, as lmdx writes it, comes read-only and mapped, the file held open while
        the array lives."""
        g = self.group_of(module)
        if g in self._moments:
            return self._moments[g].gram()
        return np.asarray(self._stored(f"gram/{g}", mapped=True), dtype=np.float64)

    def sum(self, module: str) -> NDArray[np.float64]:
        """The (d,) float64 sum ``Σ x`` of a module's input."""
        g = self.group_of(module)
        if g in self._moments:
            return self._moments[g].sum
        return np.asarray(self.tensor(f"sum/{g}"), dtype=np.float64)

    def fisher(self, parameter: str) -> NDArray[np.float64]:
        """Sum over examples of squared gradients of a parameter (divide by :meth:`count`)."""
        if parameter not in self.parameters:
            raise MissingStatisticsError(f"{self._where()}: no Fisher statistics for {parameter!r}")
        return np.asarray(self.tensor(f"fisher/{parameter}"), dtype=np.float64)

    def tensor(self, name: str) -> NDArray[Any]:
        """A stored tensor by its file name (``gram/<group>``, ``sum/<group>``,
        ``fisher/<parameter>``), as held in memory or read from the file."""
        return self._stored(name, mapped=False)

    def _stored(self, name: str, *, mapped: bool) -> NDArray[Any]:
        """:meth:`tensor`; with ``mapped``, a tensor of the file read-only and mapped
        rather than copied (``SafetensorsFile.get_mapped``)."""
        if name in self._tensors:
            v = self._tensors[name]
            return np.asarray(v() if callable(v) else v)
        if self._file is not None and name in self._hashes:
            try:
                read = self._file.get_mapped if mapped else self._file.get_tensor
                arr = np.asarray(read(name))
            except (OSError, ValueError) as exc:
                raise StatisticsFileError(
                    f"{self._where()}: cannot read tensor {name!r} ({exc}); the file may be "
                    "truncated or corrupted"
                ) from None
            if stored_hash(arr, self._version) != self._hashes[name]:
                raise StatisticsFileError(
                    f"{self._where()}: tensor {name!r} does not match its content hash; the "
                    "file was corrupted or edited after it was written: get an intact copy"
                )
            return arr
        raise MissingStatisticsError(f"{self._where()}: tensor {name!r} is missing")

    def _where(self) -> str:
        return f"statistics {self.source}" if self.source else "statistics"

    def __repr__(self) -> str:
        n = len(self.modules) if self.kind == "regmean-gram" else len(self.parameters)
        what = "modules" if self.kind == "regmean-gram" else "parameters"
        return f"Statistics(kind={self.kind!r}, {what}={n}, model={self.model['architecture']})"

    # ------------------------------------------------------------------ checks

    def check_model(self, identity: Mapping[str, Any], model_name: str = "model") -> None:
        """Raise :class:`ModelMismatchError` unless these statistics belong to ``identity``
        (:func:`lmdx.files.identity.model_identity` of the model, with the hash these
        statistics' identity holds: ``model_identity(model,
        lmdx.files.digest.identity_digest(stats.model))``)."""
        if identity["weights_sha256"] == self.model["weights_sha256"]:
            return
        raise ModelMismatchError(
            f"{self._where()} do not belong to {model_name}: "
            f"{describe_mismatch(self.model, identity)}. Collect statistics on the model "
            "being merged (lmdx stats MODEL DATA --out FILE)."
        )

    # ------------------------------------------------------------------ files

    def metadata(self) -> dict[str, Any]:
        """The JSON metadata written to the file."""
        from .._core import core

        meta: dict[str, Any] = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "lmdx_version": core.__version__,
            "kind": self.kind,
            "dtype": "float64",
            "data": self.data,
            "model": self.model,
            "extra": self.extra,
        }
        if self.kind == "regmean-gram":
            meta["padding"] = self.padding
            meta["modules"] = self.modules
            meta["groups"] = {
                g: {"dim": int(v["dim"]), "count": self.group_count(g)}
                for g, v in self.groups.items()
            }
        else:
            meta["count"] = self.count()
            meta["parameters"] = self.parameters
        return meta

    def rebuilt(
        self, tensors: Mapping[str, NDArray[Any] | Callable[[], NDArray[Any]]], **changes: Any
    ) -> Statistics:
        """New statistics with these statistics' description (kind, model, data, padding,
        modules, groups with their row counts, Fisher parameters and example count, extra)
        and ``tensors`` (as stored, or callables that read them); ``changes`` replace
        description fields or set ``source`` and ``files`` (the one way statistics are
        made from others: added, joined, sent between processes)."""
        fields: dict[str, Any] = {
            "kind": self.kind,
            "model": self.model,
            "data": self.data,
            "padding": self.padding,
            "modules": self.modules,
            "groups": {g: {**v, "count": self.group_count(g)} for g, v in self.groups.items()},
            "parameters": self.parameters,
            "count": self._count,
            "extra": self.extra,
        }
        return Statistics(**{**fields, **changes}, tensors=tensors)

    def group_count(self, g: str) -> float:
        """Rows seen by input group ``g``."""
        if g in self._moments:
            return self._moments[g].count
        return float(self.groups[g]["count"])

    def specs(self) -> list[TensorSpec]:
        """Name, dtype and shape of every tensor the file holds, in file order."""
        specs = []
        if self.kind == "regmean-gram":
            for g, v in self.groups.items():
                d = int(v["dim"])
                specs.append(TensorSpec(f"gram/{g}", np.float64, (d * (d + 1) // 2,)))
                specs.append(TensorSpec(f"sum/{g}", np.float64, (d,)))
        else:
            for p, v in self.parameters.items():
                specs.append(TensorSpec(f"fisher/{p}", np.float64, v["shape"]))
        return specs

    def packed(self, name: str) -> NDArray[Any]:
        """Tensor ``name`` as stored in the file (a Gram as its packed triangle)."""
        kind, _, key = name.partition("/")
        if key in self._moments:
            m = self._moments[key]
            return pack_upper(m.gram()) if kind == "gram" else m.sum
        return np.asarray(self.tensor(name), dtype=np.float64)

    def save(
        self, path: str | os.PathLike[str], *, max_shard_size: int | str | None = None
    ) -> Path:
        """Write to ``path``, one tensor at a time, atomically.

        Without ``max_shard_size``: one safetensors file. With it: a folder ``path``
        holding shards of at most that size (``"2GB"`` or bytes; a tensor larger than
        that gets a shard of its own) and the index ``lmdx_stats.index.json``.
        """
        path = Path(path)
        specs = self.specs()
        meta = self.metadata()
        with StatisticsWriter(path, specs, meta, max_shard_size=max_shard_size) as w:
            for spec in specs:
                w.write(spec.name, self.packed(spec.name))
            w.close(meta)
        return path

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Statistics:
        """Open and validate a statistics file; tensors are read on demand."""
        path = Path(path)
        handle: SafetensorsFile | _ShardedStatistics
        if path.is_dir():
            handle = _ShardedStatistics(path)
            where = f"statistics folder {path}"
            meta = handle.meta
        else:
            handle = read_safetensors_header(path, "statistics file", StatisticsFileError)
            where = f"statistics file {path}"
            raw = (handle.metadata() or {}).get("lmdx")
            if raw is None:
                raise StatisticsFileError(
                    f"{where}: no lmdx metadata; this is not an lmdx statistics file"
                )
            meta = parse_json(raw, f"{where}: metadata", StatisticsFileError)
        validate_metadata(meta, where)
        assert isinstance(meta, dict)
        stats = cls(
            kind=meta["kind"],
            model=meta["model"],
            data=meta.get("data", ""),
            padding=meta.get("padding"),
            modules=meta.get("modules"),
            groups=meta.get("groups"),
            parameters=meta.get("parameters"),
            count=meta.get("count"),
            source=str(path),
            extra=meta.get("extra"),
            files=[str(path)],
        )
        stats._file = handle
        present = {}
        for key in handle.keys():
            present[key] = handle.shape(key)
        for spec in stats.specs():
            if spec.name not in present:
                raise StatisticsFileError(f"{where}: tensor {spec.name!r} is missing")
            if present[spec.name] != list(spec.shape):
                raise StatisticsFileError(
                    f"{where}: tensor {spec.name!r} has shape {present[spec.name]}, the "
                    f"metadata says {list(spec.shape)}"
                )
        for m, info in stats.modules.items():
            if info["dim"] != stats.groups[info["group"]]["dim"]:
                raise StatisticsFileError(
                    f"{where}: module {m!r} has dimension {info['dim']}, its input group "
                    f"{info['group']!r} {stats.groups[info['group']]['dim']}"
                )
        extra = sorted(set(present) - {spec.name for spec in stats.specs()})
        if extra:
            raise StatisticsFileError(f"{where}: tensor {extra[0]!r} is not in the metadata")
        stats._hashes = check_content(meta, set(present), where)
        stats._version = meta["format_version"]
        stats._content_sha256 = content_sha256(meta)
        return stats


class _ShardedStatistics:
    """The shards of a statistics folder behind one ``get_tensor``/``keys``/``shape``."""

    def __init__(self, folder: Path) -> None:
        index = folder / INDEX_NAME
        where = f"statistics folder {folder}"
        if not index.is_file():
            raise StatisticsFileError(
                f"{where}: no {INDEX_NAME}; give a statistics file or a folder written by "
                "lmdx (stats ... --max-shard-size)"
            )
        data = read_json(index, f"{where}: index", StatisticsFileError)
        if not isinstance(data, dict) or data.get("format") != INDEX_FORMAT:
            raise StatisticsFileError(f"{where}: {INDEX_NAME} is not an lmdx statistics index")
        weight_map, self.id = data.get("weight_map"), data.get("id")
        if not isinstance(weight_map, dict) or not isinstance(self.id, str):
            raise StatisticsFileError(f"{where}: {INDEX_NAME} lacks weight_map/id")
        self.meta = data.get("metadata")
        self._where = open_shards(
            folder, weight_map, INDEX_NAME, "statistics folder", StatisticsFileError, self._same_id
        )

    def _same_id(self, handle: SafetensorsFile) -> None:
        """A shard must carry this collection's id (no files of different runs mixed)."""
        try:
            tag = parse_json(handle.metadata().get("lmdx_shard", "{}"), "tag", ValueError)
        except ValueError:
            tag = {}
        if not isinstance(tag, dict) or tag.get("id") != self.id:
            raise StatisticsFileError(
                f"statistics shard {handle.path}: belongs to another statistics collection "
                f"(id {tag.get('id') if isinstance(tag, dict) else None!r}, the index says "
                f"{self.id!r}); the folder mixes files of different runs"
            )

    def keys(self) -> list[str]:
        return list(self._where)

    def shape(self, name: str) -> list[int]:
        return self._where[name].shape(name)

    def get_tensor(self, name: str) -> NDArray[Any]:
        return self._where[name].get_tensor(name)

    def get_mapped(self, name: str) -> NDArray[Any]:
        return self._where[name].get_mapped(name)
