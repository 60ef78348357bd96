"""A symmetric Gram stored as its packed upper triangle (row by row)."""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

__all__ = ["pack_upper", "packed_diagonal", "packed_times", "unpack_upper"]

#: Rows handled at a time by the blocked passes below (a block of 256 rows of a d = 4096
#: Gram is 8 MB).
BLOCK = 256


def _row_starts(d: int) -> NDArray[np.int64]:
    """Where row i of the packed triangle starts: after rows 0..i-1 (d, d-1, ... values)."""
    i = np.arange(d, dtype=np.int64)
    return i * d - i * (i - 1) // 2


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
    out = np.empty((d, d), dtype=np.float64)
    pos = 0
    for i in range(d):  # contiguous row writes of the upper triangle ...
        out[i, i:] = packed[pos : pos + d - i]
        pos += d - i
    for i0 in range(0, d, BLOCK):  # ... then the lower one, a block of columns at a time
        i1 = min(d, i0 + BLOCK)
        out[i1:, i0:i1] = out[i0:i1, i1:].T
        block = out[i0:i1, i0:i1]
        lower = np.tril_indices(i1 - i0, -1)
        block[lower] = block.T[lower]
    return out


def packed_diagonal(packed: NDArray[np.float64], d: int) -> NDArray[np.float64]:
    """The diagonal of the symmetric (d, d) matrix of :func:`pack_upper`'s layout."""
    return np.asarray(packed[_row_starts(d)], dtype=np.float64)


def packed_times(
    packed: NDArray[np.float64], d: int, x: NDArray[np.float64]
) -> NDArray[np.float64]:
    """``G @ x`` for the symmetric (d, d) ``G`` of :func:`pack_upper`'s layout and ``x`` of
    shape (d, k), without forming ``G``: per block of rows, the block's part of the upper
    triangle times ``x`` and its transpose times ``x`` (the diagonal counted once)."""
    if packed.shape != (d * (d + 1) // 2,):
        raise ValueError(f"packed triangle of dimension {d}: expected {d * (d + 1) // 2} values")
    starts = _row_starts(d)
    out = np.zeros((d, x.shape[1]), dtype=np.float64)
    for i0 in range(0, d, BLOCK):
        i1 = min(d, i0 + BLOCK)
        rows = np.zeros((i1 - i0, d - i0))  # G[i0:i1, i0:], upper triangle only
        for i in range(i0, i1):
            rows[i - i0, i - i0 :] = packed[starts[i] : starts[i] + d - i]
        out[i0:i1] += rows @ x[i0:]
        out[i0:] += rows.T @ x[i0:i1]
        out[i0:i1] -= packed[starts[i0:i1]][:, None] * x[i0:i1]
    return out
