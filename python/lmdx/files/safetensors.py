"""safetensors files read and written tensor by tensor, strictly, without pickle.

A safetensors file is an 8-byte little-endian header length, a JSON header (name ->
dtype, shape, byte range; plus ``__metadata__``, a str -> str map) and the raw bytes.
Because every shape is known before any data exists, :class:`SafetensorsWriter` writes
the header first, reserves the whole file on disk (so a full disk is reported before
any work, not after) and then takes tensors one at a time, in any order, at their
offsets; a file of many large tensors never needs them all in memory. Files are read
back tensor by tensor with plain reads (:func:`read_safetensors_header`), not a memory map
of the whole file, so what was read and dropped does not stay resident;
:meth:`SafetensorsFile.get_mapped` maps one tensor alone, for as long as its array lives.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from .._errors import MissingFileError
from .._tensors import ST_NUMPY, is_bfloat16, itemsize, numpy_dtype, widen
from .atomic import atomic_file, disk_full, is_disk_full
from .digest import DIGEST, hasher
from .parse import parse_json

__all__ = [
    "MAX_HEADER_BYTES",
    "SafetensorsFile",
    "SafetensorsWriter",
    "TensorSpec",
    "open_shards",
    "read_safetensors_header",
    "write_safetensors",
]

_ST_OF: dict[str, str] = {v: k for k, v in ST_NUMPY.items()}


class TensorSpec:
    """Name, dtype and shape of one tensor of a file being written.

    ``dtype`` is a NumPy dtype or its name (``"bfloat16"``: :func:`lmdx._tensors.bfloat16_dtype`).
    """

    __slots__ = ("dtype", "name", "shape", "st_dtype")

    def __init__(self, name: str, dtype: Any, shape: Sequence[int]) -> None:
        self.name = name
        self.dtype = numpy_dtype(dtype) if isinstance(dtype, str) else np.dtype(dtype)
        if self.dtype.name not in _ST_OF:
            raise ValueError(f"{name}: dtype {self.dtype} cannot be written")
        self.st_dtype = _ST_OF[self.dtype.name]
        self.shape = tuple(int(s) for s in shape)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * int(self.dtype.itemsize)


class SafetensorsWriter:
    """Write one safetensors file whose tensors arrive one at a time, in any order.

    The header is written and the file's full size reserved when the writer opens;
    :meth:`write` puts a tensor at its offset; :meth:`close` checks every tensor was
    written and renames the temporary file to ``path``. Use as a context manager: on any
    error (including KeyboardInterrupt) the temporary file is removed and ``path`` is
    untouched.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        specs: Sequence[TensorSpec],
        metadata: Mapping[str, str] | None = None,
        *,
        header_reserve: int = 0,
    ) -> None:
        self.path = Path(path)
        self._specs = {s.name: s for s in specs}
        if len(self._specs) != len(specs):
            dup = next(s.name for s in specs if sum(t.name == s.name for t in specs) > 1)
            raise ValueError(f"{self.path}: tensor {dup!r} listed twice")
        header: dict[str, Any] = {}
        if metadata:
            header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
        offset = 0
        self._offsets: dict[str, int] = {}
        for spec in specs:
            header[spec.name] = {
                "dtype": spec.st_dtype,
                "shape": list(spec.shape),
                "data_offsets": [offset, offset + spec.nbytes],
            }
            self._offsets[spec.name] = offset
            offset += spec.nbytes
        self._header = header
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (header_reserve + (-(len(raw) + header_reserve) % 8))
        self._data_start = 8 + len(raw)
        self.size = self._data_start + offset
        self._written: set[str] = set()
        self._tmp_cm = atomic_file(self.path)
        self._tmp = self._tmp_cm.__enter__()
        try:
            self._fd = os.open(self._tmp, os.O_WRONLY)
            try:
                _reserve(self._fd, self.size)
            except OSError as exc:
                if is_disk_full(exc):
                    raise disk_full(self.path, exc, self.size) from None
                raise
            self._pwrite(len(raw).to_bytes(8, "little") + raw, 0)
        except BaseException as exc:
            self.abort(exc)
            raise

    def _pwrite(self, data: Any, offset: int) -> None:
        view = memoryview(data).cast("B")
        try:
            while view:
                n = os.pwrite(self._fd, view, offset)
                view = view[n:]
                offset += n
        except OSError as exc:
            if is_disk_full(exc):
                raise disk_full(self.path, exc, self.size) from None
            raise

    def set_metadata(self, metadata: Mapping[str, str]) -> None:
        """Replace the ``__metadata__`` written at open (e.g. counts known only at the end);
        the new header must fit in the space reserved with ``header_reserve``."""
        header = dict(self._header)
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
        raw = json.dumps(header, separators=(",", ":")).encode()
        room = self._data_start - 8
        if len(raw) > room:
            raise ValueError(
                f"{self.path}: new header needs {len(raw)} bytes, {room} were reserved"
            )
        self._pwrite(raw + b" " * (room - len(raw)), 8)

    def write(self, name: str, arr: NDArray[Any]) -> None:
        """Write tensor ``name`` (announced dtype and shape)."""
        spec = self._specs.get(name)
        if spec is None:
            raise ValueError(f"{self.path}: tensor {name!r} was not announced")
        if name in self._written:
            raise ValueError(f"{self.path}: tensor {name!r} written twice")
        arr = np.asarray(arr)
        if arr.dtype != spec.dtype or arr.shape != spec.shape:
            raise ValueError(
                f"{self.path}: tensor {name!r} announced as {spec.dtype}{list(spec.shape)}, "
                f"got {arr.dtype}{list(arr.shape)}"
            )
        little = np.ascontiguousarray(arr).astype(arr.dtype.newbyteorder("<"), copy=False)
        if little.size:
            raw = little.reshape(-1).view(np.uint8)  # bytes (bfloat16 has no buffer format)
            self._pwrite(raw, self._data_start + self._offsets[name])
        self._written.add(name)

    def missing(self) -> list[str]:
        return [n for n in self._specs if n not in self._written]

    def close(self) -> Path:
        """Check completeness, flush and rename to the final name."""
        try:
            missing = self.missing()
            if missing:
                raise ValueError(
                    f"{self.path}: {len(missing)} tensors never written (e.g. {missing[0]!r})"
                )
            os.fsync(self._fd)
            os.close(self._fd)
            self._fd = -1
        except BaseException as exc:
            self.abort(exc)
            raise
        self._tmp_cm.__exit__(None, None, None)
        return self.path

    @property
    def is_open(self) -> bool:
        """Still writing: neither closed nor aborted."""
        return getattr(self, "_fd", -1) >= 0

    def abort(self, exc: BaseException) -> None:
        """Give up: close and remove the temporary file (``exc`` is the cause)."""
        if self.is_open:
            os.close(self._fd)
            self._fd = -1
        with contextlib.suppress(BaseException):
            self._tmp_cm.__exit__(type(exc), exc, exc.__traceback__)

    def __enter__(self) -> SafetensorsWriter:
        return self

    def __exit__(self, typ: Any, exc: Any, tb: Any) -> None:
        if exc is None:
            self.close()
        else:
            self.abort(exc)


def _reserve(fd: int, size: int) -> None:
    """Allocate ``size`` bytes for the file now (posix_fallocate where the filesystem
    supports it), so a full disk fails here, before any work."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            os.ftruncate(fd, size)
        else:
            raise
    except AttributeError:  # pragma: no cover - platforms without posix_fallocate
        os.ftruncate(fd, size)


def write_safetensors(
    path: str | os.PathLike[str],
    specs: Sequence[TensorSpec],
    produce: Callable[[str], NDArray[Any]],
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Write a safetensors file tensor by tensor, atomically.

    ``produce(name)`` is called once per spec, in order, and must return an array of the
    announced dtype and shape. The file appears at ``path`` only when complete; on any
    error the temporary file is removed and ``path`` is untouched.
    """
    with SafetensorsWriter(path, specs, metadata) as writer:
        for spec in specs:
            writer.write(spec.name, produce(spec.name))


class SafetensorsFile:
    """A safetensors file read with plain reads (no memory map of the whole file, so
    tensors read and dropped do not stay resident), its header validated against the file
    size. :meth:`get_mapped` maps one tensor alone, for as long as its array lives."""

    def __init__(self, path: Path, entries: dict[str, Any], data_start: int, meta: Any) -> None:
        self.path = path
        self._entries = entries
        self._data_start = data_start
        self._metadata = meta

    def metadata(self) -> dict[str, str]:
        return dict(self._metadata or {})

    def keys(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def shape(self, name: str) -> list[int]:
        return list(self._entries[name]["shape"])

    def dtype(self, name: str) -> str:
        """The safetensors dtype (``"F32"``, ``"BF16"``, ...)."""
        return str(self._entries[name]["dtype"])

    def nbytes(self, name: str) -> int:
        begin, end = self._entries[name]["data_offsets"]
        return int(end - begin)

    def _located(self, name: str) -> tuple[dict[str, Any], np.dtype[Any], int]:
        """A tensor's header entry, its stored dtype (the native dtype object: the core
        checks dtypes by identity) and the file offset of its first byte."""
        e = self._entries[name]
        return e, numpy_dtype(ST_NUMPY[e["dtype"]]), self._data_start + e["data_offsets"][0]

    def _read(self, name: str, stored: np.dtype[Any], offset: int, count: int) -> NDArray[Any]:
        """``count`` little-endian values of ``stored`` at ``offset``, read (1-D)."""
        little = stored.newbyteorder("<")
        arr = np.fromfile(self.path, dtype=little, count=count, offset=offset)
        if arr.size != count:
            raise ValueError(f"{self.path}: tensor {name!r} is cut short")
        out: NDArray[Any] = arr.view(stored) if little == stored else arr.astype(stored)
        return out

    def get_raw(self, name: str) -> NDArray[Any]:
        """The stored values as a NumPy array of the stored dtype (bfloat16 as
        :func:`lmdx._tensors.bfloat16_dtype`)."""
        e, stored, offset = self._located(name)
        count = int(np.prod(e["shape"], dtype=np.int64))
        out: NDArray[Any] = self._read(name, stored, offset, count).reshape(e["shape"])
        return out

    def get_mapped(self, name: str) -> NDArray[Any]:
        """The values as :meth:`get_tensor` gives them, read-only and without a copy: the
        tensor's bytes memory-mapped (pages read from the page cache on first touch; the
        mapping, and the file descriptor it holds, go when the array and its views are
        dropped). A tensor of another byte order, bfloat16, no elements or an offset its
        dtype does not divide, and a file system that cannot map, are read as
        :meth:`get_tensor` reads them. A file cut short before the mapping raises
        ``ValueError``; one truncated in place while the array lives ends the process
        (SIGBUS), and bytes rewritten in place show through: files are to be replaced by
        renaming (as lmdx writes them), which a mapping does not see."""
        e, stored, offset = self._located(name)
        count = int(np.prod(e["shape"], dtype=np.int64))
        if (
            count == 0
            or is_bfloat16(stored)
            or stored.newbyteorder("<") != stored
            or offset % stored.alignment
        ):
            return self.get_tensor(name)
        try:
            mapped = np.memmap(self.path, dtype=stored, mode="r", offset=offset, shape=(count,))
        except OSError:  # no mmap here (some FUSE mounts), or out of descriptors
            return self.get_tensor(name)
        out: NDArray[Any] = np.asarray(mapped).reshape(e["shape"])
        return out

    def get_rows(self, name: str, start: int, stop: int) -> NDArray[Any]:
        """Rows ``start:stop`` of a tensor's first axis as :meth:`get_raw` returns them,
        read alone (a contiguous range of the file)."""
        e, stored, offset = self._located(name)
        shape = [int(n) for n in e["shape"]]
        if not shape or not 0 <= start <= stop <= shape[0]:
            raise ValueError(f"{self.path}: tensor {name!r} has no rows {start}:{stop}")
        row = int(np.prod(shape[1:], dtype=np.int64))
        first = offset + start * row * stored.itemsize
        arr = self._read(name, stored, first, (stop - start) * row)
        out: NDArray[Any] = arr.reshape([stop - start, *shape[1:]])
        return out

    def get_tensor(self, name: str) -> NDArray[Any]:
        """The values as NumPy (bfloat16 widened to float32)."""
        arr = self.get_raw(name)
        return widen(arr) if is_bfloat16(arr.dtype) else arr

    def digest(self, name: str, algorithm: str = DIGEST) -> str:
        """The content hash (:mod:`lmdx.files.digest`) of a tensor's stored bytes (equal
        to hashing the tensor in memory)."""
        e = self._entries[name]
        begin, end = e["data_offsets"]
        h = hasher(algorithm)
        with open(self.path, "rb") as f:
            f.seek(self._data_start + begin)
            left = end - begin
            while left > 0:
                block = f.read(min(left, 1 << 24))
                if not block:
                    raise ValueError(f"{self.path}: tensor {name!r} is cut short")
                h.update(block)
                left -= len(block)
        return h.hexdigest()


def open_shards(
    folder: Path,
    weight_map: Any,
    index_name: str,
    what: str,
    error: type[Exception],
    check: Callable[[SafetensorsFile], None] | None = None,
) -> dict[str, SafetensorsFile]:
    """Tensor name -> its open shard, for the ``weight_map`` of a sharded folder's index.

    Every shard's header is validated once (``check``, if given, then inspects it); a bad
    shard name, a missing shard or a tensor that is not where the index says raises
    ``error`` naming the folder, the shard and the tensor.
    """
    if not isinstance(weight_map, dict):
        raise error(f"{what} {folder}: {index_name} has no weight_map")
    files: dict[str, SafetensorsFile] = {}
    where: dict[str, SafetensorsFile] = {}
    for name, shard in weight_map.items():
        if (
            not isinstance(shard, str)
            or not shard.endswith(".safetensors")
            or any(c in shard for c in "/\\\0")
            or shard.startswith(".")
        ):
            raise error(f"{what} {folder}: {index_name} names a bad shard {shard!r}")
        if shard not in files:
            file = folder / shard
            if not file.is_file():
                raise error(
                    f"{what} {folder}: shard {shard} listed in {index_name}: {file} is missing; "
                    "copy the complete folder"
                )
            files[shard] = read_safetensors_header(file, f"{what} shard", error)
            if check is not None:
                check(files[shard])
        if name not in files[shard]:
            raise error(
                f"{what} {folder}: shard {shard} lacks tensor {name!r} that {index_name} "
                "places there; the shard is from another run or was overwritten"
            )
        where[name] = files[shard]
    for shard, handle in files.items():
        unlisted = [n for n in handle.keys() if weight_map.get(n) != shard]
        if unlisted:
            raise error(
                f"{what} {folder}: shard {shard} holds tensor {unlisted[0]!r} that {index_name} "
                "does not place there; the shard is from another run or was overwritten"
            )
    return where


#: Largest header read (bytes), the safetensors library's own bound.
MAX_HEADER_BYTES = 100_000_000
_INT64_MAX = 2**63 - 1
_ENTRY_KEYS = {"dtype", "shape", "data_offsets"}


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def read_safetensors_header(
    path: str | os.PathLike[str], what: str = "file", error: type[Exception] = ValueError
) -> SafetensorsFile:
    """Parse and check a safetensors header by the safetensors library's own rules:
    a header of at most :data:`MAX_HEADER_BYTES` holding a JSON object, known dtypes,
    shapes within int64, each byte range as long as its shape needs, and the ranges
    disjoint and covering the data region exactly; ``__metadata__`` a str -> str map.
    ``error`` names the file and what is wrong; a missing file is a
    :class:`MissingFileError`."""
    path = Path(path)
    if not path.is_file():
        raise MissingFileError(f"{what} {path}: no such file")

    def fail(msg: str) -> Exception:
        return error(f"{what} {path}: {msg}; the file is truncated, corrupted or of another format")

    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise fail(f"only {size} bytes")
            n = int.from_bytes(prefix, "little")
            if n < 2 or n > MAX_HEADER_BYTES or 8 + n > size:
                raise fail(f"header length {n} does not fit in {size} bytes")
            raw = f.read(n)
    except OSError as exc:
        raise error(f"{what} {path}: cannot be read ({exc.strerror or exc})") from None
    if len(raw) != n or raw[:1] != b"{":
        raise fail("header is not a JSON object")
    try:
        header = parse_json(raw, "header", ValueError)
    except ValueError as exc:
        raise fail(str(exc)) from None
    if not isinstance(header, dict):
        raise fail("header is not a JSON object")
    meta = header.pop("__metadata__", None)
    if meta is not None and not (
        isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())
    ):
        raise fail("__metadata__ is not an object of strings")
    data_start = 8 + n
    spans = []
    for name, e in header.items():
        ok = (
            isinstance(e, dict)
            and set(e) == _ENTRY_KEYS
            and isinstance(e["shape"], list)
            and all(_is_int(d) and 0 <= d <= _INT64_MAX for d in e["shape"])
            and isinstance(e["data_offsets"], list)
            and len(e["data_offsets"]) == 2
            and all(_is_int(o) and 0 <= o <= _INT64_MAX for o in e["data_offsets"])
            and isinstance(e["dtype"], str)
        )
        if not ok:
            raise fail(f"entry {name!r} of the header is malformed")
        if e["dtype"] not in ST_NUMPY:
            raise error(
                f"{what} {path}: tensor {name!r} has dtype {e['dtype']!r}, which lmdx does not "
                f"read ({', '.join(ST_NUMPY)}); convert the file"
            )
        count = 1
        for d in e["shape"]:
            count *= d
        nbytes = count * itemsize(ST_NUMPY[e["dtype"]])
        begin, end = e["data_offsets"]
        if nbytes > _INT64_MAX or end - begin != nbytes:
            raise fail(f"tensor {name!r}: byte range does not match its shape")
        spans.append((begin, end, name))
    position = 0
    for begin, end, name in sorted(spans):
        if begin != position:
            how = "overlaps another tensor" if begin < position else "leaves a gap before it"
            raise fail(f"tensor {name!r}: byte range {begin}..{end} {how}")
        position = end
    if data_start + position != size:
        if data_start + position > size:
            raise fail(f"the tensors end at byte {data_start + position} of {size}")
        raise fail(f"{size - data_start - position} bytes after the last tensor")
    return SafetensorsFile(path, header, data_start, meta)
