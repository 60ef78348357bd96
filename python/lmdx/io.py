"""Files: safetensors written tensor by tensor to a temporary name, atomic directories.

A safetensors file is an 8-byte little-endian header length, a JSON header (name ->
dtype, shape, byte range; plus ``__metadata__``, a str -> str map) and the raw bytes.
Because every shape is known before any data exists, :func:`write_safetensors` writes
the header first and then asks for one tensor at a time, so a file of many large
tensors never needs them all in memory. Files are read back with the ``safetensors``
package (memory-mapped, no pickle).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

__all__ = [
    "atomic_directory",
    "file_sha256",
    "open_safetensors",
    "write_safetensors",
]

_DTYPES: dict[str, str] = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "int64": "I64",
    "int32": "I32",
    "uint8": "U8",
}


class TensorSpec:
    """Name, NumPy dtype and shape of one tensor of a file being written."""

    __slots__ = ("dtype", "name", "shape")

    def __init__(self, name: str, dtype: Any, shape: Sequence[int]) -> None:
        self.name = name
        self.dtype = np.dtype(dtype)
        self.shape = tuple(int(s) for s in shape)
        if self.dtype.name not in _DTYPES:
            raise ValueError(f"{name}: dtype {self.dtype} cannot be written")

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * int(self.dtype.itemsize)


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
    path = Path(path)
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for spec in specs:
        if spec.name in header:
            raise ValueError(f"{path}: tensor {spec.name!r} listed twice")
        header[spec.name] = {
            "dtype": _DTYPES[spec.dtype.name],
            "shape": list(spec.shape),
            "data_offsets": [offset, offset + spec.nbytes],
        }
        offset += spec.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with atomic_file(path) as tmp, open(tmp, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for spec in specs:
            arr = np.asarray(produce(spec.name))
            if arr.dtype != spec.dtype or arr.shape != spec.shape:
                raise ValueError(
                    f"{path}: tensor {spec.name!r} announced as {spec.dtype}{list(spec.shape)}, "
                    f"got {arr.dtype}{list(arr.shape)}"
                )
            little = np.ascontiguousarray(arr).astype(arr.dtype.newbyteorder("<"), copy=False)
            f.write(little.tobytes() if little.ndim == 0 else memoryview(little.reshape(-1)))  # type: ignore[arg-type]


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; rename it to ``path`` if the block succeeds."""
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"{path}: is a directory; give a file name")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def atomic_directory(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield an empty temporary directory beside ``path``; rename it to ``path`` on success.

    ``path`` must not exist (nothing the user has is replaced). On any error, including
    KeyboardInterrupt, the temporary directory is removed.
    """
    path = Path(path)
    if path.exists():
        raise FileExistsError(f"{path}: already exists; choose a new output directory")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    try:
        yield tmp
        if path.exists():
            raise FileExistsError(f"{path}: appeared while writing; the output is left at {tmp}")
        os.rename(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def open_safetensors(
    path: str | os.PathLike[str], what: str = "file", error: type[Exception] = ValueError
) -> Any:
    """Open a safetensors file for lazy NumPy reads; ``error`` (naming the file) if it
    cannot be read."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{what} {path}: no such file")
    try:
        return safe_open(str(path), framework="numpy")
    except Exception as exc:  # SafetensorError and OSError carry little context
        raise error(
            f"{what} {path}: not a readable safetensors file ({exc}); it may be truncated, "
            "corrupted or of another format"
        ) from None


def file_sha256(path: str | os.PathLike[str], chunk: int = 1 << 22) -> str:
    """Hex SHA-256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()
