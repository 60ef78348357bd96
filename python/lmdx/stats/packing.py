"""A symmetric Gram stored as its packed upper triangle (row by row)."""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

__all__ = ["pack_upper", "unpack_upper"]


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
