"""k-fold cross-validated LMD R² from per-fold moments.

Rows are dealt to the k folds in turn, in the order they are added (row t of everything
added, over all splits, goes to fold ``t mod k``), so the folds are deterministic and
differ in size by at most one row. Each fold keeps its own moments about one shared shift,
so the moments of any set of folds are the total minus the others', exactly. Fold f's
fit (:func:`~lmdx.lmd.fit.fit_basis` for the pairwise table, :func:`~lmdx.lmd.fit.fit_groups`
for the group fits) is scored on fold f's moments (pooled R², SST about fold f's own
mean) and trained

* with a fixed relative ridge ρ (``ridge=``): on the other k − 1 folds;
* otherwise with ρ chosen per fit from ``ridge_grid`` (default
  :data:`~lmdx.lmd.fit.DEFAULT_RIDGE_GRID`) by the pooled R² on the next fold,
  f + 1 mod k (an inner validation fold, as LMD chooses ρ on the validation split): on
  the other k − 2 folds. Fold f never takes part in choosing its own ρ. Needs k ≥ 3.

Reported: the k held-out R² values of every fit, their mean and their standard deviation
across folds (ddof = 1).

Memory: one D × D Gram per fold (8·k·D² bytes), which is why ``cv_r2`` is not among the
default measures.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from ..moments import DEFAULT_CHUNK_ROWS, Moments
from .fit import DEFAULT_RIDGE_GRID, SplitStats, fit_basis, fit_groups, ridge_plan
from .split_moments import BlockLayout, SplitMoments

__all__ = ["DEFAULT_FOLDS", "CrossValidation", "FoldMoments", "cross_validate"]

#: Folds of ``cv_r2`` unless told otherwise.
DEFAULT_FOLDS: int = 5

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

    def fold_stats(self, inner: bool) -> list[dict[str, SplitStats]]:
        """Per fold f: ``test`` (fold f) and ``train`` (the other folds), or with ``inner``
        ``validation`` (fold f + 1 mod k) and ``train`` (the other k − 2 folds)."""
        if min(self.counts) < 2:
            raise ValueError(
                f"cv_r2: the {self.k} folds have {self.counts} rows; every fold needs at "
                "least 2 (add more rows or use fewer folds)"
            )
        shift = self._folds[0].shift
        assert shift is not None
        parts = [(f.moments.count, f.moments.sum, f.moments.gram()) for f in self._folds]
        n_all = math.fsum(p[0] for p in parts)
        s_all = np.sum([p[1] for p in parts], axis=0)
        g_all = np.sum([p[2] for p in parts], axis=0)
        out = []
        for f, (n, s, g) in enumerate(parts):
            stats = {"test": _stats(n, s, g.copy(), shift)}
            n_tr, s_tr, g_tr = n_all - n, s_all - s, g_all - g
            if inner:
                n_v, s_v, g_v = parts[(f + 1) % self.k]
                stats["validation"] = _stats(n_v, s_v, g_v.copy(), shift)
                n_tr, s_tr, g_tr = n_tr - n_v, s_tr - s_v, g_tr - g_v
            stats["train"] = _stats(n_tr, s_tr, g_tr, shift)
            out.append(stats)
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
    folds
        k.
    ridge, ridge_grid
        The fixed relative ridge of every fit, or None and the grid each fit's ridge was
        chosen from on its inner validation fold.
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
    ridge: float | None
    ridge_grid: tuple[float, ...] | None
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
            "rho_grid": None if self.ridge_grid is None else list(self.ridge_grid),
            "rho_choice": "fixed"
            if self.ridge is not None
            else "per fit, by pooled R² on fold f + 1 mod k; trained on the other k - 2 folds",
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
    ridge: float | None = None,
    ridge_grid: Sequence[float] = DEFAULT_RIDGE_GRID,
    pairwise: bool = True,
    group: bool = True,
    allow_regularization: bool = True,
    n_threads: int | None = None,
) -> CrossValidation:
    """k-fold cross-validated pairwise and group R² from the folds' moments, with a fixed
    relative ``ridge`` or (None) one chosen per fit from ``ridge_grid`` on an inner fold
    (see the module notes)."""
    layout = folds.layout
    names = layout.names
    m = len(names)
    inner = ridge is None
    if inner and folds.k < 3:
        raise ValueError(
            "cv_r2: choosing the ridge on an inner fold needs at least 3 folds; use more "
            "folds or pass a fixed ridge"
        )
    plan = ridge_plan("default", ridge_grid=ridge_grid) if inner else ridge_plan("default", ridge)
    options: dict[str, Any] = {
        "keep_weights": False,
        "allow_regularization": allow_regularization,
        "n_threads": n_threads,
    }
    pair = np.full((folds.k, m, m), np.nan)
    grp = np.full((folds.k, m), np.nan)
    for f, stats in enumerate(folds.fold_stats(inner and plan.select)):
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
        ridge=None if plan.select else plan.ridges[0],
        ridge_grid=plan.ridges if plan.select else None,
        counts=tuple(folds.counts),
        pairwise=pair,
        group=grp,
    )
