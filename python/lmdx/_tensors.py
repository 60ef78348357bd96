"""The only place where user arrays and torch tensors become arrays for the native core,
and where tensors change dtype.

Everything the core receives is a C-contiguous float32 or float64 NumPy array -- except
rows for the Gram kernel (:func:`as_gram_rows`), where float16 and bfloat16 stay 16-bit
(the kernel widens them while packing). Torch tensors are detached and moved to the CPU;
elsewhere bfloat16/float16 are widened to float32; integer inputs become float64. Copies
happen here, visibly, never in the bindings.

bfloat16 NumPy arrays use the ``ml_dtypes`` dtype (:func:`bfloat16_dtype`), so an array
always says what it holds; files and merges work on NumPy arrays without importing torch
(:func:`as_numpy` and :func:`to_torch` cross over where torch is in use). Narrowing casts
(:func:`cast_float`) round exactly as torch does.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
from numpy.typing import NDArray

__all__ = [
    "FLOAT_DTYPES",
    "OUTPUT_DTYPES",
    "ST_NUMPY",
    "TORCH_OF_ST",
    "as_float64",
    "as_gram_rows",
    "as_numpy",
    "as_rows",
    "as_tensor_array",
    "as_weights",
    "bfloat16_dtype",
    "cast_float",
    "dtype_name",
    "float_dtype_name",
    "is_bfloat16",
    "is_tensor",
    "itemsize",
    "numpy_dtype",
    "to_torch",
    "widen",
]


@functools.cache
def bfloat16_dtype() -> np.dtype[Any]:
    """NumPy's bfloat16, from ``ml_dtypes`` (imported on first use: importing it took 0.8-1.5 s
    with ml_dtypes 0.7.0, where no bfloat16 is involved that would be all of a command's
    start-up; after it, ``np.dtype("bfloat16")`` works too)."""
    import ml_dtypes

    dtype: np.dtype[Any] = np.dtype(ml_dtypes.bfloat16)
    return dtype


def is_bfloat16(dtype: np.dtype[Any]) -> bool:
    """Whether a NumPy dtype is bfloat16 (without importing ``ml_dtypes``)."""
    return bool(dtype.name == "bfloat16")


def itemsize(name: str) -> int:
    """Bytes per element of a dtype name of :data:`DTYPES` (without importing ``ml_dtypes``)."""
    return 2 if name == "bfloat16" else int(np.dtype(name).itemsize)


def numpy_dtype(name: str) -> np.dtype[Any]:
    """The NumPy dtype of a dtype name of :data:`DTYPES` (``"bfloat16"``:
    :func:`bfloat16_dtype`)."""
    return bfloat16_dtype() if name == "bfloat16" else np.dtype(name)


#: The one dtype table: safetensors code -> (NumPy dtype name, torch dtype name).
DTYPES: dict[str, tuple[str, str]] = {
    "F64": ("float64", "float64"),
    "F32": ("float32", "float32"),
    "F16": ("float16", "float16"),
    "BF16": ("bfloat16", "bfloat16"),
    "I64": ("int64", "int64"),
    "I32": ("int32", "int32"),
    "I16": ("int16", "int16"),
    "I8": ("int8", "int8"),
    "U8": ("uint8", "uint8"),
    "BOOL": ("bool", "bool"),
}
ST_NUMPY: dict[str, str] = {code: stored for code, (stored, _) in DTYPES.items()}
TORCH_OF_ST: dict[str, str] = {code: torch for code, (_, torch) in DTYPES.items()}
#: Floating-point dtype names (torch spelling): the tensors a merge computes.
FLOAT_DTYPES = frozenset(("float64", "float32", "float16", "bfloat16"))
#: What a merge can write: each tensor's input dtype ("auto") or one float dtype.
OUTPUT_DTYPES = ("auto", "float32", "bfloat16", "float16")


def float_dtype_name(value: Any) -> str | None:
    """The name in :data:`FLOAT_DTYPES` of a floating-point dtype given as a name
    (``"bfloat16"``, ``"torch.float16"``), a torch dtype, or a NumPy dtype or scalar type;
    None for anything else (integer, bool, complex, float8 types, unknown names)."""
    if isinstance(value, str):
        name = value.removeprefix("torch.")
    elif type(value).__module__ == "torch":  # a torch.dtype (torch is not imported here)
        name = str(value).removeprefix("torch.")
    else:
        try:
            name = np.dtype(value).name
        except TypeError:
            return None
    return name if name in FLOAT_DTYPES else None


_NARROW_TORCH = ("torch.bfloat16", "torch.float16")


def _is_torch(x: Any) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "detach")


def is_tensor(x: Any) -> bool:
    """Whether ``x`` is a torch tensor (checked without importing torch)."""
    return _is_torch(x)


def _cpu_tensor(x: Any) -> Any:
    """``x`` detached from autograd and on the CPU (no copy when it already is)."""
    t = x.detach()
    return t if t.device.type == "cpu" else t.cpu()


def as_tensor_array(x: Any, name: str) -> NDArray[np.floating[Any]]:
    """A C-contiguous float32/float64 NumPy array holding the values of ``x``."""
    if _is_torch(x):
        t = _cpu_tensor(x)
        if str(t.dtype) in _NARROW_TORCH:
            t = t.float()
        elif t.dtype.is_complex:
            raise ValueError(f"{name}: complex tensors are not supported, got {t.dtype}")
        elif not t.dtype.is_floating_point:
            t = t.double()
        arr = t.contiguous().numpy()
    else:
        arr = np.asarray(x)
    if arr.dtype == np.float16 or is_bfloat16(arr.dtype):
        arr = widen(arr)
    elif arr.dtype not in (np.float32, np.float64):
        if arr.dtype.kind not in "biuf":
            raise ValueError(f"{name}: expected numbers, got an array of dtype {arr.dtype}")
        arr = arr.astype(np.float64)
    return np.asarray(arr, order="C")  # keeps 0-d arrays 0-d, unlike ascontiguousarray


def as_float64(x: Any, name: str) -> NDArray[np.float64]:
    """A C-contiguous float64 copy-or-view of ``x``."""
    return np.asarray(as_tensor_array(x, name), dtype=np.float64, order="C")


def _rows_of(arr: NDArray[Any], dim: int, name: str) -> tuple[NDArray[Any], tuple[int, ...]]:
    """View a C-contiguous (..., dim) array as (rows, dim); also return its leading shape."""
    if arr.ndim == 0 or arr.shape[-1] != dim:
        raise ValueError(f"{name}: expected shape (..., {dim}), got {arr.shape}")
    return arr.reshape(-1, dim), tuple(arr.shape[:-1])


def as_rows(x: Any, dim: int, name: str = "x") -> tuple[NDArray[np.floating[Any]], tuple[int, ...]]:
    """View ``x`` of shape (..., dim) as C-contiguous (rows, dim); also return x.shape[:-1]."""
    return _rows_of(as_tensor_array(x, name), dim, name)


def as_gram_rows(x: Any, dim: int, name: str = "x") -> tuple[NDArray[Any], tuple[int, ...], bool]:
    """Rows for ``Moments.update``: like :func:`as_rows`, but float16 and bfloat16 inputs
    stay 16-bit (no widened copy; the kernel converts exactly while packing). Returns
    ``(rows, leading, is_bfloat16)``; bfloat16 rows are a uint16 view of the bits."""
    bfloat16 = False
    if _is_torch(x) and str(x.dtype) in _NARROW_TORCH:
        t = _cpu_tensor(x).contiguous()
        bfloat16 = str(t.dtype) == "torch.bfloat16"
        if bfloat16:
            import torch  # present: x is a torch tensor

            arr = t.view(torch.int16).numpy().view(np.uint16)
        else:
            arr = t.numpy()
    elif isinstance(x, np.ndarray) and (x.dtype == np.float16 or is_bfloat16(x.dtype)):
        bfloat16 = is_bfloat16(x.dtype)
        arr = np.ascontiguousarray(x)
        if bfloat16:
            arr = arr.view(np.uint16)
    else:
        arr = as_tensor_array(x, name)
    rows, leading = _rows_of(arr, dim, name)
    return rows, leading, bfloat16


def as_weights(
    mask: Any, weights: Any, leading_shape: tuple[int, ...], rows: int
) -> NDArray[np.float64] | None:
    """Combine an optional 0/1 ``mask`` and optional ``weights`` into per-row float64."""
    out: NDArray[np.float64] | None = None
    for label, value in (("mask", mask), ("weights", weights)):
        if value is None:
            continue
        arr = as_float64(value, label)
        if arr.shape != leading_shape and arr.size != rows:
            raise ValueError(
                f"{label}: expected shape {leading_shape} (one value per row of x), got {arr.shape}"
            )
        if label == "mask" and not np.isin(arr, (0.0, 1.0)).all():
            raise ValueError("mask: expected 0/1 or boolean values; use weights= for weights")
        arr = arr.reshape(rows)
        out = arr if out is None else out * arr
    return None if out is None else np.ascontiguousarray(out)


def dtype_name(t: Any) -> str:
    """The dtype of a torch tensor or NumPy array in torch's spelling (``"bfloat16"``)."""
    return str(t.dtype).removeprefix("torch.")


def widen(arr: NDArray[Any]) -> NDArray[np.float32]:
    """A float16 or bfloat16 array widened (exactly) to float32."""
    if is_bfloat16(arr.dtype):  # the bits in the upper half of a float32: exact, fast
        bits = np.ascontiguousarray(arr).view(np.uint16).astype(np.uint32)
        bits <<= 16
        return bits.view(np.float32)
    return arr.astype(np.float32)


def cast_float(arr: NDArray[Any], dtype: str) -> NDArray[Any]:
    """A float array as float dtype ``dtype`` (``"float32"``, ``"bfloat16"``, ...),
    rounded to nearest even exactly as torch's ``Tensor.to`` rounds: float64 values are
    rounded to float32 first, then to the 16-bit type. Values beyond the type's range
    become infinite (check with :func:`numpy.isfinite`)."""
    target = numpy_dtype(dtype)
    if arr.dtype == target:
        return arr
    with np.errstate(over="ignore", invalid="ignore"):  # (beyond the range: infinite)
        if target.itemsize == 2 and arr.dtype == np.float64:
            arr = arr.astype(np.float32)
        return arr.astype(target)


def as_numpy(x: Any) -> NDArray[Any]:
    """A torch tensor or NumPy array as a C-contiguous NumPy array of the same dtype
    (a view where possible; bfloat16 as :func:`bfloat16_dtype`)."""
    if _is_torch(x):
        t = _cpu_tensor(x).contiguous()
        if str(t.dtype) == "torch.bfloat16":
            import torch  # present: x is a torch tensor

            return np.asarray(t.view(torch.int16).numpy().view(bfloat16_dtype()))
        return np.asarray(t.numpy())
    return np.asarray(x, order="C")  # (np.ascontiguousarray makes a 0-d array 1-d)


def to_torch(arr: Any) -> Any:
    """A NumPy array (any dtype of the table, bfloat16 included) as a torch tensor of the
    same dtype, sharing its memory (a copy when the array is read-only); torch tensors
    are returned as they are."""
    import torch

    if _is_torch(arr):
        return arr
    arr = np.asarray(arr, order="C")  # 0-d stays 0-d (CLIP's logit_scale)
    if not arr.flags.writeable:  # e.g. arrays from Ray's object store
        arr = arr.copy()
    if is_bfloat16(arr.dtype):
        return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(arr)
