"""Streaming first and second moments (count, sum, Gram) accumulated in float64."""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import NDArray

from . import _core
from ._tensors import as_float64, as_gram_rows, as_weights
from .config import resolve_threads

__all__ = ["DEFAULT_CHUNK_ROWS", "Moments", "gram_product"]

#: Rows packed and multiplied per block by the native Gram kernel.
DEFAULT_CHUNK_ROWS = 512


def gram_product(
    gram: NDArray[np.float64], y: NDArray[np.float64], *, n_threads: int | None = None
) -> NDArray[np.float64]:
    """``G Y`` for a float64 Gram ``G`` held as statistics hold it, without unpacking it.

    Parameters
    ----------
    gram
        ``G``: full (d, d) and symmetric, or its upper triangle packed row by row,
        shape (d (d + 1) / 2,) (:meth:`lmdx.stats.Statistics.gram_stored`).
    y
        (d, p), float64.
    n_threads
        Threads (default: :func:`lmdx.config.default_threads`); the result does not
        depend on them.

    Returns
    -------
    ndarray
        (d, p) float64.
    """
    g = np.ascontiguousarray(gram, dtype=np.float64)
    rhs = np.ascontiguousarray(y, dtype=np.float64)
    out: NDArray[np.float64] = _core.core.gram_product(
        gram=g, y=rhs, n_threads=resolve_threads(n_threads)
    )
    return out


class Moments:
    """Count ``n``, sum ``s = Σ w_t x_t`` and Gram ``G = Σ w_t x_t x_tᵀ`` of row vectors.

    Rows are streamed in with :meth:`update` (float32 or float64; torch tensors and
    bfloat16/float16 are accepted and widened) and accumulated in float64 by the native
    core: float32 rows are multiplied in float32, each product summed over at most 64 rows
    before it is added into float64 (within 1e-6 relative of a float64 accumulation).
    Accumulators over disjoint data add exactly with :meth:`merge` or ``+=``.

    Parameters
    ----------
    dim
        Length ``d`` of each row vector.
    chunk_rows
        Rows packed and multiplied per block (float32 sums run over at most
        ``min(64, chunk_rows)`` rows). Results do not depend on the thread count (1 vs 2
        tested), but do on this when it is not a multiple of 64.
    """

    def __init__(self, dim: int, *, chunk_rows: int = DEFAULT_CHUNK_ROWS) -> None:
        self._native = _core.core.Moments(dim=int(dim), chunk_rows=int(chunk_rows))

    @classmethod
    def from_state(
        cls, count: float, sum: Any, gram: Any, *, chunk_rows: int = DEFAULT_CHUNK_ROWS
    ) -> Moments:
        """Rebuild an accumulator from saved ``count``, ``sum`` (d,) and ``gram`` (d, d)."""
        obj = cls.__new__(cls)
        obj._native = _core.core.Moments.from_state(
            count=float(count),
            sum=as_float64(sum, "sum"),
            gram=as_float64(gram, "gram"),
            chunk_rows=int(chunk_rows),
        )
        return obj

    def update(
        self,
        x: Any,
        *,
        mask: Any = None,
        weights: Any = None,
        n_threads: int | None = None,
    ) -> Moments:
        """Add rows.

        Parameters
        ----------
        x
            Array or tensor of shape (..., d); every leading index is one row.
        mask
            Optional 0/1 (or boolean) array of shape x.shape[:-1]; rows with 0 are skipped
            (e.g. a tokenizer's attention mask, to leave out padding).
        weights
            Optional non-negative per-row weights of shape x.shape[:-1].
        n_threads
            Threads for this call (default: :func:`lmdx.default_threads`).

        Returns
        -------
        Moments
            ``self``, so calls can be chained.
        """
        rows, leading, bfloat16 = as_gram_rows(x, self.dim, "x")
        w = as_weights(mask, weights, leading, rows.shape[0])
        self._native.update(
            x=rows,
            weights=w,
            n_threads=resolve_threads(n_threads),
            bfloat16=bfloat16,
            bf16_dot=bfloat16 and _core.bf16_dot(),
        )
        return self

    def merge(self, other: Moments) -> Moments:
        """Add another accumulator's statistics (over disjoint data) into this one."""
        if not isinstance(other, Moments):
            raise TypeError(f"other: expected lmdx.Moments, got {type(other).__name__}")
        self._native.merge(other=other._native)
        return self

    def __iadd__(self, other: Moments) -> Moments:
        return self.merge(other)

    def copy(self) -> Moments:
        """An independent copy."""
        return Moments.from_state(self.count, self.sum, self.gram(), chunk_rows=self.chunk_rows)

    @property
    def dim(self) -> int:
        return int(self._native.dim)

    @property
    def chunk_rows(self) -> int:
        return int(self._native.chunk_rows)

    @property
    def count(self) -> float:
        """Rows seen (sum of weights)."""
        return float(self._native.count)

    @property
    def sum(self) -> NDArray[np.float64]:
        """Σ w_t x_t, shape (d,) (a new array)."""
        return np.asarray(self._native.sum)

    def gram(self) -> NDArray[np.float64]:
        """Σ w_t x_t x_tᵀ, shape (d, d), symmetric (a new array)."""
        return np.asarray(self._native.gram())

    def mean(self) -> NDArray[np.float64]:
        """Mean row s / n."""
        self._require_rows()
        return self.sum / self.count

    def covariance(self, ddof: int = 0) -> NDArray[np.float64]:
        """Centered covariance (G - s sᵀ/n) / (n - ddof)."""
        self._require_rows()
        n = self.count
        if n - ddof <= 0:
            raise ValueError(f"covariance: need more than {ddof} rows, have {n}")
        s = self.sum
        return (self.gram() - np.outer(s, s) / n) / (n - ddof)

    def _require_rows(self) -> None:
        if self.count <= 0:
            raise ValueError("Moments: no rows have been added yet")

    def __repr__(self) -> str:
        return f"Moments(dim={self.dim}, count={self.count:g})"
