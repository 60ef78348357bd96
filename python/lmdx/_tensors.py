"""The only place where user arrays and torch tensors become arrays for the native core.

Everything the core receives is a C-contiguous float32 or float64 NumPy array -- except
rows for the Gram kernel (:func:`as_gram_rows`), where float16 and bfloat16 stay 16-bit
(the kernel widens them while packing). Torch tensors are detached and moved to the CPU;
elsewhere bfloat16/float16 are widened to float32; integer inputs become float64. Copies
happen here, visibly, never in the bindings.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import NDArray

__all__ = ["as_float64", "as_gram_rows", "as_rows", "as_tensor_array", "as_weights"]

_NARROW_TORCH = ("torch.bfloat16", "torch.float16")


def _is_torch(x: Any) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "detach")


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
    if arr.dtype == np.float16:
        arr = arr.astype(np.float32)
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
    elif isinstance(x, np.ndarray) and x.dtype == np.float16:
        arr = np.ascontiguousarray(x)
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
