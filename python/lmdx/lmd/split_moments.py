"""Moments per split: where each model's block sits in the concatenated embedding, and
the streaming moments of those concatenated embeddings over one data split.

Float32 embeddings are accumulated by the native core in float32 chunks; to keep the
centered covariance accurate when an embedding's mean is large against its spread (common
for language models), each split subtracts a fixed shift (the mean of its first batch)
before accumulating, and adds it back in :meth:`SplitMoments.mean`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from .._tensors import as_float64, as_tensor_array
from ..moments import DEFAULT_CHUNK_ROWS, Moments
from .norm_moments import NormMoments

__all__ = ["SPLITS", "BlockLayout", "SplitMoments", "check_split"]

#: Split names, in the order they are reported.
SPLITS: tuple[str, ...] = ("train", "validation", "test")

Array = NDArray[np.float64]

_ROW_BLOCK = 1024  # rows per step when centering a Gram in place (bounds the temporary)


@dataclass(frozen=True)
class BlockLayout:
    """Model names and embedding sizes, and where each model's block sits in the
    concatenated vector ``[f_1(x); …; f_m(x)]`` of length :attr:`dim`."""

    names: tuple[str, ...]
    dims: tuple[int, ...]

    def __init__(self, names: Sequence[str], dims: Sequence[int]) -> None:
        names_t = tuple(str(n) for n in names)
        dims_t = tuple(int(d) for d in dims)
        if not names_t:
            raise ValueError("names: need at least one model")
        if len(names_t) != len(dims_t):
            raise ValueError(f"names has {len(names_t)} models but dims has {len(dims_t)} sizes")
        seen: set[str] = set()
        for name, d in zip(names_t, dims_t, strict=True):
            if name in seen:
                raise ValueError(f"names: model {name!r} is listed twice")
            seen.add(name)
            if d < 1:
                raise ValueError(f"dims: model {name!r} has dimension {d}; must be >= 1")
        object.__setattr__(self, "names", names_t)
        object.__setattr__(self, "dims", dims_t)

    @property
    def offsets(self) -> tuple[int, ...]:
        """Start of each model's block in the concatenated vector."""
        return tuple(int(o) for o in np.cumsum((0, *self.dims))[:-1])

    @property
    def dim(self) -> int:
        """D = Σ d_j."""
        return sum(self.dims)

    def index(self, name: str) -> int:
        """Position of a model in :attr:`names`."""
        try:
            return self.names.index(name)
        except ValueError:
            raise ValueError(
                f"unknown model {name!r}; the models are {', '.join(map(repr, self.names))}"
            ) from None

    def block(self, name: str) -> slice:
        """The model's columns in the concatenated vector."""
        i = self.index(name)
        lo = self.offsets[i]
        return slice(lo, lo + self.dims[i])

    def indices(self, names: Iterable[str]) -> NDArray[np.intp]:
        """Concatenated column indices of the given models, in the given order."""
        parts = [np.arange(self.block(n).start, self.block(n).stop) for n in names]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.intp)


def check_split(split: str) -> str:
    """``split`` if it is one of :data:`SPLITS`, else a ValueError listing them."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; use one of {', '.join(map(repr, SPLITS))}")
    return split


class SplitMoments:
    """Streaming moments of the concatenated embeddings of m models over one data split.

    One :class:`lmdx.Moments` of dimension ``D = Σ d_j`` accumulates (in float64) the
    rows ``[f_1(x); …; f_m(x)] − c``, where the shift ``c`` is the mean of the first batch
    (it keeps the centered covariance accurate for float32 input; see the module notes).

    Parameters
    ----------
    names
        Model names, in block order.
    dims
        Their embedding sizes, in the same order.
    split
        Which split this is (``"train"``, ``"validation"`` or ``"test"``); used in errors.
    chunk_rows
        Passed to :class:`lmdx.Moments`.
    norms
        Also accumulate the sums of squared norms that debiased CKA needs
        (:class:`~lmdx.lmd.norm_moments.NormMoments`, about the same shift).
    """

    def __init__(
        self,
        names: Sequence[str],
        dims: Sequence[int],
        *,
        split: str = "train",
        chunk_rows: int = DEFAULT_CHUNK_ROWS,
        norms: bool = False,
    ) -> None:
        self.layout = BlockLayout(names, dims)
        self.split = check_split(split)
        self._norms = NormMoments(self.layout.dims) if norms else None
        # The D-dim accumulator (8·D² bytes) is allocated on first use, so a split that never
        # gets rows costs nothing; a 1-dim one checks chunk_rows now.
        self._chunk_rows = Moments(1, chunk_rows=chunk_rows).chunk_rows
        self._moments: Moments | None = None
        self._shift: Array | None = None

    @classmethod
    def from_moments(
        cls,
        names: Sequence[str],
        dims: Sequence[int],
        moments: Moments,
        *,
        shift: Any = None,
        split: str = "train",
    ) -> SplitMoments:
        """Wrap saved moments of ``[f_1(x); …; f_m(x)] − shift`` (shift defaults to 0)."""
        obj = cls(names, dims, split=split, chunk_rows=moments.chunk_rows)
        if moments.dim != obj.layout.dim:
            raise ValueError(
                f"split {split!r}: moments have dimension {moments.dim}, "
                f"but the models' dims add up to {obj.layout.dim}"
            )
        obj._moments = moments.copy()
        if shift is not None:
            c = as_float64(shift, "shift").reshape(-1)
            if c.shape != (obj.layout.dim,) or not np.isfinite(c).all():
                raise ValueError(f"shift: expected {obj.layout.dim} finite numbers")
            obj._shift = c.copy()
        elif moments.count > 0:
            obj._shift = np.zeros(obj.layout.dim)
        return obj

    @property
    def moments(self) -> Moments:
        """The :class:`lmdx.Moments` of the shifted rows (allocated on first access)."""
        if self._moments is None:
            self._moments = Moments(self.layout.dim, chunk_rows=self._chunk_rows)
        return self._moments

    @property
    def names(self) -> tuple[str, ...]:
        return self.layout.names

    @property
    def dims(self) -> tuple[int, ...]:
        return self.layout.dims

    @property
    def offsets(self) -> tuple[int, ...]:
        return self.layout.offsets

    @property
    def count(self) -> int:
        """Rows (sentences) added."""
        return 0 if self._moments is None else round(self._moments.count)

    @property
    def shift(self) -> Array | None:
        """The vector subtracted from every row before accumulation (None before any row)."""
        return None if self._shift is None else self._shift.copy()

    def add(
        self, embeddings: Sequence[Any] | Mapping[str, Any], *, n_threads: int | None = None
    ) -> SplitMoments:
        """Add one batch: row t of every model's array embeds the same sentence.

        Parameters
        ----------
        embeddings
            m arrays or tensors of shape (n, d_j), in model order, or a mapping from every
            model name to its array (NumPy or torch). If every model's batch is float32
            (float16/bfloat16 are widened to float32) the batch stays float32 and the core
            accumulates it in float64; otherwise it is converted to float64.

        Returns
        -------
        SplitMoments
            ``self``.
        """
        arrays = self._check_batch(embeddings)
        rows = arrays[0].shape[0]
        if rows == 0:
            return self
        if self._shift is None:
            self._shift = np.concatenate([a.mean(axis=0, dtype=np.float64) for a in arrays])
        dtype = np.float32 if all(a.dtype == np.float32 for a in arrays) else np.float64
        batch = np.empty((rows, self.layout.dim), dtype=dtype)
        for lo, d, a in zip(self.offsets, self.dims, arrays, strict=True):
            np.subtract(a, self._shift[lo : lo + d], out=batch[:, lo : lo + d], casting="unsafe")
        self.moments.update(batch, n_threads=n_threads)
        if self._norms is not None:
            self._norms.update(batch)
        return self

    def _check_batch(
        self, embeddings: Sequence[Any] | Mapping[str, Any]
    ) -> list[NDArray[np.floating[Any]]]:
        where = f"split {self.split!r}"
        if isinstance(embeddings, Mapping):
            missing = [n for n in self.names if n not in embeddings]
            extra = [str(k) for k in embeddings if k not in self.names]
            if missing or extra:
                raise ValueError(
                    f"{where}: embeddings must have one entry per model; missing {missing}, "
                    f"unknown {extra}"
                )
            items = [embeddings[n] for n in self.names]
        else:
            items = list(embeddings)
            if len(items) != len(self.names):
                raise ValueError(
                    f"{where}: expected {len(self.names)} arrays (one per model: "
                    f"{', '.join(self.names)}), got {len(items)}"
                )
        arrays: list[NDArray[np.floating[Any]]] = []
        for name, d, item in zip(self.names, self.dims, items, strict=True):
            a = as_tensor_array(item, f"{where}, model {name!r}")
            if a.ndim != 2 or a.shape[1] != d:
                raise ValueError(
                    f"{where}, model {name!r}: expected embeddings of shape (n, {d}), got {a.shape}"
                )
            if arrays and a.shape[0] != arrays[0].shape[0]:
                raise ValueError(
                    f"{where}: model {name!r} has {a.shape[0]} rows but model "
                    f"{self.names[0]!r} has {arrays[0].shape[0]}; every model must embed the "
                    "same sentences in the same order"
                )
            finite = np.isfinite(a)
            if not finite.all():
                r, c = np.argwhere(~finite)[0]
                raise ValueError(
                    f"{where}, model {name!r}: embeddings contain NaN or Inf (first at row "
                    f"{r}, column {c}); check the model's output for this batch"
                )
            arrays.append(a)
        return arrays

    def merge(self, other: SplitMoments) -> SplitMoments:
        """Add the moments of another accumulator (same models, disjoint rows)."""
        if not isinstance(other, SplitMoments):
            raise TypeError(f"other: expected SplitMoments, got {type(other).__name__}")
        if other.layout != self.layout:
            raise ValueError(
                f"cannot merge moments of models {other.names} {other.dims} into "
                f"{self.names} {self.dims}"
            )
        if (self._norms is None) != (other._norms is None):
            raise ValueError("cannot merge moments with norm sums and moments without them")
        if other._shift is None:
            return self
        if self._shift is None:
            self._shift = other._shift.copy()
        delta = other._shift - self._shift
        n, s, g = other.moments.count, other.moments.sum, other.moments.gram()
        if self._norms is not None and other._norms is not None:
            self._norms.add(other._norms.shifted(-delta, n, s, g))
        # Σ (x − c_self)(x − c_self)ᵀ = G + s δᵀ + δ sᵀ + n δ δᵀ with x − c_other summed in G, s.
        g += np.outer(s, delta) + np.outer(delta, s) + n * np.outer(delta, delta)
        moved = Moments.from_state(n, s + n * delta, g, chunk_rows=self.moments.chunk_rows)
        self.moments.merge(moved)
        return self

    @property
    def has_norms(self) -> bool:
        """Whether the sums of squared norms are accumulated (``norms=True``)."""
        return self._norms is not None

    def centered_norms(self) -> NormMoments:
        """The sums of squared norms of the rows centered on this split's mean (needs
        ``norms=True``)."""
        if self._norms is None:
            raise ValueError(
                f"split {self.split!r}: no norm sums; create the moments with norms=True"
            )
        self._require_rows(1)
        n, s = self.moments.count, self.moments.sum
        return self._norms.shifted(s / n, n, s, self.moments.gram())

    def copy(self) -> SplitMoments:
        """An independent copy (moments, shift and norm sums)."""
        out = SplitMoments(
            self.names,
            self.dims,
            split=self.split,
            chunk_rows=self._chunk_rows,
            norms=self._norms is not None,
        )
        if self._moments is not None:
            out._moments = self._moments.copy()
        out._shift = None if self._shift is None else self._shift.copy()
        if self._norms is not None:
            out._norms = self._norms.copy()
        return out

    def mean(self) -> Array:
        """Mean of the concatenated embeddings, shape (D,)."""
        self._require_rows(1)
        assert self._shift is not None
        return self.moments.sum / self.moments.count + self._shift

    def covariance(self, ddof: int = 0) -> Array:
        """Centered covariance ``Σ (x − x̄)(x − x̄)ᵀ / (n − ddof)``, shape (D, D), exactly
        symmetric."""
        self._require_rows(ddof + 1)
        n = self.moments.count
        s = self.moments.sum
        g = self.moments.gram()
        for lo in range(0, len(s), _ROW_BLOCK):
            hi = min(lo + _ROW_BLOCK, len(s))
            g[lo:hi] -= np.outer(s[lo:hi], s) / n
        g /= n - ddof
        return g

    def _require_rows(self, k: int) -> None:
        if self._moments is None or self._moments.count < k:
            raise ValueError(
                f"split {self.split!r}: has {self.count} rows, needs at least {k}; "
                f"add embeddings with .add({self.split!r}, ...)"
            )

    def __repr__(self) -> str:
        blocks = ", ".join(f"{n}:{d}" for n, d in zip(self.names, self.dims, strict=True))
        return f"SplitMoments(split={self.split!r}, count={self.count}, blocks=[{blocks}])"
