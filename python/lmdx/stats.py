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
are read one group at a time when merging (plain reads, nothing stays resident). No
pickle is involved.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from .io import (
    SafetensorsFile,
    SafetensorsWriter,
    TensorSpec,
    atomic_directory,
    open_shards,
    read_safetensors_header,
)
from .moments import Moments

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "KINDS",
    "ModelMismatchError",
    "Statistics",
    "StatisticsFileError",
    "StatisticsWriter",
    "add_statistics",
    "model_identity",
    "pack_upper",
    "unpack_upper",
]

FORMAT = "lmdx-stats"
FORMAT_VERSION = 1
INDEX_FORMAT = "lmdx-stats-index"
#: The index of a sharded statistics folder (shards ``stats-00001-of-0000N.safetensors``).
INDEX_NAME = "lmdx_stats.index.json"
KINDS = ("regmean-gram", "fisher")
PADDING_POLICIES = ("excluded", "included")


class StatisticsFileError(ValueError):
    """A statistics file is unreadable, truncated, foreign or inconsistent."""


class ModelMismatchError(ValueError):
    """Statistics were computed on a different model than the one they are used with."""


# --------------------------------------------------------------------------- packing


def pack_upper(gram: NDArray[np.float64]) -> NDArray[np.float64]:
    """Upper triangle of a (d, d) matrix, row by row: ``d(d+1)/2`` values."""
    d = gram.shape[0]
    out = np.empty(d * (d + 1) // 2, dtype=np.float64)
    pos = 0
    for i in range(d):
        out[pos : pos + d - i] = gram[i, i:]
        pos += d - i
    return out


def unpack_upper(packed: NDArray[np.float64], d: int) -> NDArray[np.float64]:
    """Symmetric (d, d) matrix from :func:`pack_upper`'s layout."""
    if packed.shape != (d * (d + 1) // 2,):
        raise ValueError(f"packed triangle of dimension {d}: expected {d * (d + 1) // 2} values")
    out = np.zeros((d, d), dtype=np.float64)
    pos = 0
    for i in range(d):  # contiguous row writes of the upper triangle ...
        out[i, i:] = packed[pos : pos + d - i]
        pos += d - i
    out += np.triu(out, 1).T  # ... then the lower one in a single vectorized pass
    return out


# --------------------------------------------------------------------------- identity


def _tensor_bytes(t: Any) -> memoryview:
    """Raw bytes of a CPU tensor or array, without a copy when it is contiguous."""
    if hasattr(t, "detach"):
        import torch

        t = t.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())
    return memoryview(np.ascontiguousarray(t).reshape(-1).view(np.uint8))  # type: ignore[arg-type]


def model_identity(model: Any) -> dict[str, Any]:
    """Architecture and per-parameter name, shape, dtype and SHA-256 of a model.

    ``model`` is a torch module (its ``state_dict()``) or a mapping name -> tensor.
    ``weights_sha256`` hashes the per-parameter hashes in name order.
    """
    if hasattr(model, "state_dict") and not isinstance(model, Mapping):
        state = model.state_dict()
        architecture = type(model).__name__
        model_type = getattr(getattr(model, "config", None), "model_type", None)
    else:
        state = dict(model)
        architecture, model_type = "state_dict", None
    params: dict[str, Any] = {}
    total = hashlib.sha256()
    for name in sorted(state):
        t = state[name]
        dtype = str(t.dtype).removeprefix("torch.")
        h = hashlib.sha256(_tensor_bytes(t)).hexdigest()
        params[name] = {"shape": list(t.shape), "dtype": dtype, "sha256": h}
        total.update(f"{name}:{dtype}:{list(t.shape)}:{h};".encode())
    return {
        "architecture": architecture,
        "model_type": model_type,
        "weights_sha256": total.hexdigest(),
        "parameters": params,
    }


def describe_mismatch(expected: Mapping[str, Any], actual: Mapping[str, Any]) -> str:
    """First difference between two :func:`model_identity` dicts, in words."""
    if expected.get("architecture") != actual.get("architecture"):
        return (
            f"architecture {expected.get('architecture')} (statistics) vs "
            f"{actual.get('architecture')} (model)"
        )
    p_exp, p_act = expected["parameters"], actual["parameters"]
    for name in sorted(set(p_exp) | set(p_act)):
        if name not in p_act:
            return f"parameter {name!r} is in the statistics' model but not in this model"
        if name not in p_exp:
            return f"parameter {name!r} is in this model but not in the statistics' model"
        a, b = p_exp[name], p_act[name]
        if a["shape"] != b["shape"]:
            return f"parameter {name!r} has shape {a['shape']} there and {b['shape']} here"
        if a["dtype"] != b["dtype"]:
            return f"parameter {name!r} has dtype {a['dtype']} there and {b['dtype']} here"
        if a["sha256"] != b["sha256"]:
            return (
                f"parameter {name!r} has different values (sha256 {a['sha256'][:12]}… there, "
                f"{b['sha256'][:12]}… here)"
            )
    return "content hashes differ"


# --------------------------------------------------------------------------- Statistics


class Statistics:
    """Gram (RegMean) or diagonal Fisher statistics of one model on one dataset.

    Build with :func:`lmdx.capture.collect_regmean_stats` /
    :func:`lmdx.capture.collect_fisher`, or :meth:`load` a file. Tensors are read lazily
    (one group at a time) from a loaded file.

    Attributes
    ----------
    kind
        ``"regmean-gram"`` or ``"fisher"``.
    model
        Identity of the model the statistics belong to (:func:`model_identity`).
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
        self.source = source
        self.extra = dict(extra or {})

    # ------------------------------------------------------------------ accessors

    def group_of(self, module: str) -> str:
        try:
            return str(self.modules[module]["group"])
        except KeyError:
            raise KeyError(f"{self._where()}: no statistics for module {module!r}") from None

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
        return unpack_upper(self._tensor(f"gram/{g}"), int(self.groups[g]["dim"]))

    def sum(self, module: str) -> NDArray[np.float64]:
        """The (d,) float64 sum ``Σ x`` of a module's input."""
        g = self.group_of(module)
        if g in self._moments:
            return self._moments[g].sum
        return np.asarray(self._tensor(f"sum/{g}"), dtype=np.float64)

    def fisher(self, parameter: str) -> NDArray[np.float64]:
        """Sum over examples of squared gradients of a parameter (divide by :meth:`count`)."""
        if parameter not in self.parameters:
            raise KeyError(f"{self._where()}: no Fisher statistics for {parameter!r}")
        return np.asarray(self._tensor(f"fisher/{parameter}"), dtype=np.float64)

    def _tensor(self, name: str) -> NDArray[Any]:
        if name in self._tensors:
            v = self._tensors[name]
            return np.asarray(v() if callable(v) else v)
        if self._file is not None:
            try:
                return np.asarray(self._file.get_tensor(name))
            except Exception as exc:
                raise StatisticsFileError(
                    f"{self._where()}: cannot read tensor {name!r} ({exc}); the file may be "
                    "truncated or corrupted"
                ) from None
        raise KeyError(f"{self._where()}: tensor {name!r} is missing")

    def _where(self) -> str:
        return f"statistics {self.source}" if self.source else "statistics"

    def __repr__(self) -> str:
        n = len(self.modules) if self.kind == "regmean-gram" else len(self.parameters)
        what = "modules" if self.kind == "regmean-gram" else "parameters"
        return f"Statistics(kind={self.kind!r}, {what}={n}, model={self.model['architecture']})"

    # ------------------------------------------------------------------ checks

    def check_model(self, identity: Mapping[str, Any], model_name: str = "model") -> None:
        """Raise :class:`ModelMismatchError` unless these statistics belong to ``identity``."""
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
        from . import __version__

        meta: dict[str, Any] = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "lmdx_version": __version__,
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
                g: {"dim": int(v["dim"]), "count": self._group_count(g)}
                for g, v in self.groups.items()
            }
        else:
            meta["count"] = self.count()
            meta["parameters"] = self.parameters
        return meta

    def _group_count(self, g: str) -> float:
        if g in self._moments:
            return self._moments[g].count
        return float(self.groups[g]["count"])

    def _specs(self) -> list[TensorSpec]:
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

    def _packed(self, name: str) -> NDArray[Any]:
        kind, _, key = name.partition("/")
        if key in self._moments:
            m = self._moments[key]
            return pack_upper(m.gram()) if kind == "gram" else m.sum
        return np.asarray(self._tensor(name), dtype=np.float64)

    def save(
        self, path: str | os.PathLike[str], *, max_shard_size: int | str | None = None
    ) -> Path:
        """Write to ``path``, one tensor at a time, atomically.

        Without ``max_shard_size``: one safetensors file. With it: a folder ``path``
        holding shards of at most that size (``"2GB"`` or bytes; a tensor larger than
        that gets a shard of its own) and the index ``lmdx_stats.index.json``.
        """
        path = Path(path)
        specs = self._specs()
        meta = self.metadata()
        with StatisticsWriter(path, specs, meta, max_shard_size=max_shard_size) as w:
            for spec in specs:
                w.write(spec.name, self._packed(spec.name))
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
            try:
                meta = json.loads(raw)
            except json.JSONDecodeError as exc:
                raise StatisticsFileError(f"{where}: metadata is not valid JSON ({exc})") from None
        _validate_metadata(meta, where)
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
        )
        stats._file = handle
        present = {}
        for key in handle.keys():
            present[key] = handle.shape(key)
        for spec in stats._specs():
            if spec.name not in present:
                raise StatisticsFileError(f"{where}: tensor {spec.name!r} is missing")
            if present[spec.name] != list(spec.shape):
                raise StatisticsFileError(
                    f"{where}: tensor {spec.name!r} has shape {present[spec.name]}, the "
                    f"metadata says {list(spec.shape)}"
                )
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
        try:
            data = json.loads(index.read_text())
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise StatisticsFileError(f"{where}: {INDEX_NAME} is not valid JSON ({exc})") from None
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
            tag = json.loads(handle.metadata().get("lmdx_shard", "{}"))
        except json.JSONDecodeError:
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


def _size(size: int | str) -> int:
    if isinstance(size, int):
        return size
    text = str(size).strip().upper()
    for unit, mult in (("GB", 10**9), ("MB", 10**6), ("KB", 10**3), ("B", 1)):
        if text.endswith(unit):
            with contextlib.suppress(ValueError):
                return int(float(text[: -len(unit)]) * mult)
            break
    raise ValueError(f"size: expected e.g. '2GB' or a number of bytes, got {size!r}")


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
        try:
            if max_shard_size is None:
                # room for the counts and anything else that grows by the end
                reserve = 4096 + 64 * len(specs)
                w = SafetensorsWriter(
                    self.path, specs, {"lmdx": json.dumps(metadata)}, header_reserve=reserve
                )
                self._single: SafetensorsWriter | None = w
                return
            self._single = None
            limit = _size(max_shard_size)
            if self.path.suffix == ".safetensors":
                raise ValueError(
                    f"{self.path}: sharded statistics are a folder; give a name without "
                    ".safetensors"
                )
            self._tmp = self._stack.enter_context(atomic_directory(self.path))
            self.id = uuid.uuid4().hex
            shards: list[list[TensorSpec]] = [[]]
            size = 0
            for spec in specs:
                if shards[-1] and size + spec.nbytes > limit:
                    shards.append([])
                    size = 0
                shards[-1].append(spec)
                size += spec.nbytes
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

    def close(self, metadata: Mapping[str, Any]) -> Path:
        """Finish with the final metadata (counts included)."""
        try:
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
            single._abort(exc)
        for w in self._writers.values():
            if w.missing() or getattr(w, "_fd", -1) >= 0:
                w._abort(exc)
        with contextlib.suppress(BaseException):
            self._stack.__exit__(type(exc), exc, exc.__traceback__)

    def __enter__(self) -> StatisticsWriter:
        return self

    def __exit__(self, typ: Any, exc: Any, tb: Any) -> None:
        if exc is not None:
            self.abort(exc)


def _validate_metadata(meta: Any, where: str) -> None:
    def fail(msg: str) -> None:
        raise StatisticsFileError(f"{where}: {msg}")

    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        fail("not an lmdx statistics file (format field missing or foreign)")
    version = meta.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION or version < 1:
        fail(f"format version {version!r} is not supported (this lmdx reads 1..{FORMAT_VERSION})")
    if meta.get("kind") not in KINDS:
        fail(f"kind {meta.get('kind')!r} is not one of {KINDS}")
    model = meta.get("model")
    if not isinstance(model, dict) or not {"weights_sha256", "parameters"} <= set(model):
        fail("model identity (weights_sha256, parameters) missing")
    if meta["kind"] == "regmean-gram":
        if meta.get("padding") not in PADDING_POLICIES:
            fail(f"padding policy {meta.get('padding')!r} is not one of {PADDING_POLICIES}")
        groups, modules = meta.get("groups"), meta.get("modules")
        if not isinstance(groups, dict) or not isinstance(modules, dict):
            fail("groups/modules tables missing")
        for g, v in groups.items():
            if not isinstance(v, dict) or not isinstance(v.get("dim"), int) or v["dim"] < 1:
                fail(f"group {g!r}: bad dimension")
            if not isinstance(v.get("count"), (int, float)) or v["count"] < 0:
                fail(f"group {g!r}: bad count")
        for m, v in modules.items():
            if not isinstance(v, dict) or v.get("group") not in groups:
                fail(f"module {m!r}: refers to an unknown group")
            if v.get("layout") not in ("linear", "conv1d"):
                fail(f"module {m!r}: unknown layout {v.get('layout')!r}")
    else:
        if not isinstance(meta.get("parameters"), dict):
            fail("parameters table missing")
        if not isinstance(meta.get("count"), (int, float)) or meta["count"] < 0:
            fail("bad example count")


# --------------------------------------------------------------------------- adding


def _same(field: str, values: Sequence[Any], names: Sequence[str]) -> None:
    for v, n in zip(values[1:], names[1:], strict=True):
        if v != values[0]:
            raise ValueError(f"cannot add statistics: {field} differs between {names[0]} and {n}")


def add_statistics(parts: Iterable[Statistics], *, data: str | None = None) -> Statistics:
    """Statistics of the union of disjoint data shards: counts, sums and Grams add.

    All parts must be of one kind, one model (same weights hash), one padding policy and
    one module/group layout. Tensors are summed lazily when read or saved (one group at a
    time), so adding large files does not hold them all in memory.
    """
    parts = list(parts)
    if not parts:
        raise ValueError("add_statistics: nothing to add")
    names = [p.source or f"statistics #{i}" for i, p in enumerate(parts)]
    _same("kind", [p.kind for p in parts], names)
    for p, n in zip(parts[1:], names[1:], strict=True):
        if p.model["weights_sha256"] != parts[0].model["weights_sha256"]:
            raise ModelMismatchError(
                f"cannot add statistics of different models: {names[0]} vs {n}: "
                f"{describe_mismatch(parts[0].model, p.model)}"
            )
    first = parts[0]

    def summed(name: str) -> Callable[[], NDArray[Any]]:
        def read() -> NDArray[Any]:
            total = np.array(parts[0]._packed(name), dtype=np.float64)
            for p in parts[1:]:
                total += p._packed(name)
            return total

        return read

    kwargs: dict[str, Any] = {}
    if first.kind == "regmean-gram":
        _same("padding policy", [p.padding for p in parts], names)
        _same("module layout", [p.modules for p in parts], names)
        _same(
            "group dimensions", [{g: v["dim"] for g, v in p.groups.items()} for p in parts], names
        )
        kwargs["padding"] = first.padding
        kwargs["modules"] = first.modules
        kwargs["groups"] = {
            g: {"dim": v["dim"], "count": sum(p._group_count(g) for p in parts)}
            for g, v in first.groups.items()
        }
    else:
        _same("parameter set", [p.parameters for p in parts], names)
        kwargs["parameters"] = first.parameters
        kwargs["count"] = sum(p.count() for p in parts)
    return Statistics(
        kind=first.kind,
        model=first.model,
        data=data if data is not None else " + ".join(p.data for p in parts),
        tensors={spec.name: summed(spec.name) for spec in first._specs()},
        extra={"added_from": names},
        **kwargs,
    )
