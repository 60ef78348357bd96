"""k-fold cross-validated LMD R² from per-fold moments.

Rows are dealt to the k folds in turn, in the order they are added (row t of everything
added, over all splits, goes to fold ``t mod k``), so the folds are deterministic and
differ in size by at most one row. Each fold keeps its own moments about one shared shift,
so the moments of the other k − 1 folds are the total minus the fold's, exactly. Fold f's
fit (:func:`~lmdx.lmd.fit.fit_basis` for the pairwise table, :func:`~lmdx.lmd.fit.fit_groups`
for the group fits) is trained on the other folds' moments with one fixed relative ridge
(default :data:`DEFAULT_CV_RIDGE`, practically ordinary least squares) and scored on fold
f's moments (pooled R², SST about fold f's own mean). Reported: the k held-out R² values
of every fit, their mean and their standard deviation across folds (ddof = 1).

Memory: one D × D Gram per fold (8·k·D² bytes), which is why ``cv_r2`` is not among the
default measures.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from ..moments import DEFAULT_CHUNK_ROWS, Moments
from .fit import SplitStats, fit_basis, fit_groups, ridge_plan
from .split_moments import BlockLayout, SplitMoments

__all__ = ["DEFAULT_CV_RIDGE", "DEFAULT_FOLDS", "CrossValidation", "FoldMoments", "cross_validate"]

#: Folds of ``cv_r2`` unless told otherwise.
DEFAULT_FOLDS: int = 5

#: Relative ridge of the cross-validated fits unless told otherwise (the smallest value of
#: :data:`~lmdx.lmd.fit.DEFAULT_RIDGE_GRID`: it only keeps singular Σ_zz factorizable).
DEFAULT_CV_RIDGE: float = 1e-8

Array = NDArray[np.float64]


class FoldMoments:
    """The moments of k folds of the rows, about one shared shift.

    Parameters
    ----------
    names, dims
        As in :class:`~lmdx.lmd.split_moments.SplitMoments`.
    folds
        k ≥ 2.
    """

    def __init__(
        self,
        names: Sequence[str],
        dims: Sequence[int],
        folds: int = DEFAULT_FOLDS,
        *,
        chunk_rows: int = DEFAULT_CHUNK_ROWS,
    ) -> None:
        if int(folds) != folds or folds < 2:
            raise ValueError(f"folds: need an integer >= 2, got {folds}")
        self.layout = BlockLayout(names, dims)
        self.k = int(folds)
        self._chunk_rows = chunk_rows
        self._folds: list[SplitMoments] = []
        self.rows = 0

    def add(
        self,
        embeddings: Sequence[Any] | Mapping[str, Any],
        rows: int,
        shift: Array,
        *,
        n_threads: int | None = None,
    ) -> None:
        """Deal ``rows`` rows (already checked by the split they were added to) to the
        folds; ``shift`` is used by every fold (set on the first call)."""
        if not self._folds:
            self._folds = [
                SplitMoments.from_moments(
                    self.layout.names,
                    self.layout.dims,
                    Moments(self.layout.dim, chunk_rows=self._chunk_rows),
                    shift=shift,
                )
                for _ in range(self.k)
            ]
        items = (
            [embeddings[n] for n in self.layout.names]
            if isinstance(embeddings, Mapping)
            else list(embeddings)
        )
        for f in range(self.k):
            start = (f - self.rows) % self.k
            if start < rows:
                self._folds[f].add([a[start :: self.k] for a in items], n_threads=n_threads)
        self.rows += rows

    @property
    def counts(self) -> list[int]:
        """Rows per fold."""
        return [f.count for f in self._folds] if self._folds else [0] * self.k

    def held_out(self) -> list[tuple[SplitStats, SplitStats]]:
        """(stats of the other folds, stats of the fold) for every fold."""
        if min(self.counts) < 2:
            raise ValueError(
                f"cv_r2: the {self.k} folds have {self.counts} rows; every fold needs at "
                "least 2 (add more rows or use fewer folds)"
            )
        shift = self._folds[0].shift
        assert shift is not None
        parts = [(f.moments.count, f.moments.sum, f.moments.gram()) for f in self._folds]
        n_all = sum(p[0] for p in parts)
        s_all = sum(p[1] for p in parts)
        g_all = sum(p[2] for p in parts)
        out = []
        for n, s, g in parts:
            out.append(
                (_stats(n_all - n, s_all - s, g_all - g, shift), _stats(n, s, g.copy(), shift))
            )
        return out


def _stats(n: float, s: Array, g: Array, shift: Array) -> SplitStats:
    g -= np.outer(s, s) / n
    g /= n
    g = 0.5 * (g + g.T)
    return SplitStats(n, s / n + shift, g, np.diag(g).copy())


@dataclass(frozen=True)
class CrossValidation:
    """Held-out R² of every fold.

    Attributes
    ----------
    names
        The models.
    folds, ridge
        k and the relative ridge of every fit.
    counts
        Rows per fold.
    pairwise
        (k, m, m): entry [f, a, b] is R²(target a | basis b) on fold f, trained on the
        other folds (NaN on the diagonal).
    group
        (k, m): R²(model | all others) on fold f.
    """

    names: tuple[str, ...]
    folds: int
    ridge: float
    counts: tuple[int, ...]
    pairwise: Array
    group: Array

    def mean(self) -> Array:
        """Pairwise mean over folds, (m, m), target × basis."""
        return np.asarray(self.pairwise.mean(axis=0))

    def std(self) -> Array:
        """Pairwise standard deviation over folds (ddof = 1), (m, m)."""
        return np.asarray(self.pairwise.std(axis=0, ddof=1))

    def to_dict(self) -> dict[str, Any]:
        def clean(a: Array) -> Any:
            return [None if not np.isfinite(v) else float(v) for v in a.ravel()]

        m = len(self.names)
        return {
            "folds": self.folds,
            "rho": self.ridge,
            "rows_per_fold": list(self.counts),
            "assignment": "row t (in the order added, over all splits) is in fold t mod k",
            "orientation": "pairwise[fold][target][basis] = R²(target | basis) on the fold",
            "pairwise": [np.reshape(clean(p), (m, m)).tolist() for p in self.pairwise],
            "pairwise_mean": np.reshape(clean(self.mean()), (m, m)).tolist(),
            "pairwise_std": np.reshape(clean(self.std()), (m, m)).tolist(),
            "group": {n: clean(self.group[:, i]) for i, n in enumerate(self.names)},
            "group_mean": dict(zip(self.names, clean(self.group.mean(axis=0)), strict=True)),
            "group_std": dict(zip(self.names, clean(self.group.std(axis=0, ddof=1)), strict=True)),
        }


def cross_validate(
    folds: FoldMoments,
    *,
    ridge: float = DEFAULT_CV_RIDGE,
    pairwise: bool = True,
    group: bool = True,
    allow_regularization: bool = True,
    n_threads: int | None = None,
) -> CrossValidation:
    """k-fold cross-validated pairwise and group R² from the folds' moments."""
    layout = folds.layout
    names = layout.names
    m = len(names)
    plan = ridge_plan("default", ridge=ridge)
    options: dict[str, Any] = {
        "keep_weights": False,
        "allow_regularization": allow_regularization,
        "n_threads": n_threads,
    }
    pair = np.full((folds.k, m, m), np.nan)
    grp = np.full((folds.k, m), np.nan)
    for f, (train, test) in enumerate(folds.held_out()):
        stats = {"train": train, "test": test}
        if pairwise:
            for j, b in enumerate(names):
                others = [(a,) for a in names if a != b]
                for fit in fit_basis(layout, stats, plan, (b,), others, **options):
                    pair[f, names.index(fit.target[0]), j] = fit.r2["test"]
        if group:
            for i, fit in enumerate(fit_groups(layout, stats, plan, **options)):
                grp[f, i] = fit.r2["test"]
    return CrossValidation(
        names=names,
        folds=folds.k,
        ridge=float(ridge),
        counts=tuple(folds.counts),
        pairwise=pair,
        group=grp,
    )
