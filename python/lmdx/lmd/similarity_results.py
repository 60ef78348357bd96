"""The similarity measures of a set of models (:class:`SimilarityResult`): per split and
over all rows together, with the cross-validated R², their conventions, and their rows of
result.json and results.csv."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray

from .cross_validation import CrossValidation
from .similarity import MEASURES, TABLES, SplitSimilarity

__all__ = ["ALL_ROWS", "CONVENTIONS", "HEATMAPS", "SimilarityResult"]

#: The name of the pseudo-split of all rows together.
ALL_ROWS = "all"

#: One table per measure for the heatmaps: measure → (table, title, lower bound or None
#: for "from the data", upper bound).
HEATMAPS: dict[str, tuple[str, str, float | None, float]] = {
    "cka": ("cka", "linear CKA", 0.0, 1.0),
    "debiased_cka": ("debiased_cka", "debiased linear CKA", None, 1.0),
    "cca": ("cca_mean", "mean canonical correlation (CCA)", 0.0, 1.0),
    "svcca": ("svcca", "SVCCA (mean canonical correlation)", 0.0, 1.0),
    "pwcca": ("pwcca", "PWCCA (weights from the row model)", 0.0, 1.0),
    "procrustes": ("procrustes", "squared Procrustes distance (0 = same)", 0.0, 2.0),
    "cv_r2": ("cv_r2", "cross-validated LMD R²(row | column)", None, 1.0),
}

#: Centering, normalisation and regularisation of each measure (also in result.json).
CONVENTIONS: dict[str, dict[str, str]] = {
    "cka": {
        "centering": "split mean",
        "normalisation": "none needed (ratio of HSICs; invariant to isotropic scaling and "
        "orthogonal maps)",
        "regularisation": "none",
    },
    "debiased_cka": {
        "centering": "none needed (the unbiased HSIC is translation invariant); evaluated "
        "about the split mean",
        "normalisation": "ratio of unbiased HSICs (can be negative)",
        "regularisation": "none; NaN when n < 4 or an unbiased self-HSIC is <= 0",
    },
    "cca": {
        "centering": "split mean",
        "normalisation": "whitening of each model (invariant to invertible linear maps)",
        "regularisation": "rank truncation: covariance eigenvalues <= rank_tol x the largest "
        "are dropped",
    },
    "svcca": {
        "centering": "split mean",
        "normalisation": "PCA of each model to svcca_variance of its variance, then CCA",
        "regularisation": "rank truncation as CCA, then the variance cut",
    },
    "pwcca": {
        "centering": "split mean",
        "normalisation": "weights sum_j |<h_i, x_j>| of the row model's canonical variates",
        "regularisation": "rank truncation as CCA",
    },
    "procrustes": {
        "centering": "split mean",
        "normalisation": "each embedding divided by its Frobenius norm; narrower one padded "
        "with zero columns",
        "regularisation": "none",
    },
    "cv_r2": {
        "centering": "fit intercept on the training folds; SST about the held-out fold mean",
        "normalisation": "pooled (variance-weighted) R²",
        "regularisation": "relative ridge rho (lambda = rho * trace(Sigma_zz) / D_z): fixed, "
        "or chosen per fit from the grid on the inner fold f + 1 mod k (then trained on the "
        "other k - 2 folds)",
    },
}

Array = NDArray[np.float64]


def _clean(a: Array) -> Any:
    """A NumPy array as nested lists with NaN as None."""
    if a.ndim == 0:
        v = float(a)
        return v if math.isfinite(v) else None
    return [_clean(x) for x in a]


@dataclass(frozen=True)
class SimilarityResult:
    """Every requested measure for every pair of models.

    Attributes
    ----------
    names
        The models, in the order of every table's rows and columns.
    measures
        The measure names computed (see :data:`~lmdx.lmd.similarity.MEASURES`).
    splits
        ``"train"``, ``"validation"``, ``"test"`` (those with rows) and ``"all"`` (all
        rows together) → :class:`~lmdx.lmd.similarity.SplitSimilarity`.
    cv
        The cross-validated R² (measure ``cv_r2``), or None.
    rank_tol, svcca_variance
        The CCA family's rank tolerance and SVCCA's variance fraction.
    notes
        Edge cases met (constant embeddings, too few rows, degenerate CCA).
    """

    names: tuple[str, ...]
    measures: tuple[str, ...]
    splits: dict[str, SplitSimilarity]
    cv: CrossValidation | None
    rank_tol: float
    svcca_variance: float
    notes: tuple[str, ...] = field(default=())

    conventions = CONVENTIONS

    def table(self, name: str, split: str = ALL_ROWS) -> Array:
        """An (m, m) table: a key of :data:`~lmdx.lmd.similarity.TABLES`'s values
        (``cka``, ``debiased_cka``, ``cca_mean``, ``cca_r2``, ``pillai``, ``svcca``,
        ``pwcca``, ``procrustes``) on ``split``, or ``cv_r2`` / ``cv_r2_std`` (split
        ignored: the folds span all rows). Entry [i, j] compares row model i with column
        model j (for ``cv_r2``: R²(target i | basis j))."""
        if name in ("cv_r2", "cv_r2_std"):
            if self.cv is None:
                raise ValueError("table: cv_r2 was not computed (add it to measures)")
            return self.cv.mean() if name == "cv_r2" else self.cv.std()
        if split not in self.splits:
            raise ValueError(
                f"table: no split {split!r}; the result has {', '.join(map(repr, self.splits))}"
            )
        tables = self.splits[split].tables
        if name not in tables:
            known = [*tables, *(["cv_r2", "cv_r2_std"] if self.cv is not None else [])]
            raise ValueError(f"table: unknown table {name!r}; this result has {', '.join(known)}")
        out: Array = tables[name].copy()
        return out

    def to_dict(self) -> dict[str, Any]:
        """JSON-able content (NaN as None) of the ``similarity`` entry of result.json."""
        splits: dict[str, Any] = {}
        for split, res in self.splits.items():
            splits[split] = {
                "n": res.n,
                "tables": {k: _clean(v) for k, v in res.tables.items()},
                "canonical_correlations": {
                    kind: [
                        {"models": list(pair), "rho": _clean(rho)} for pair, rho in pairs.items()
                    ]
                    for kind, pairs in res.correlations.items()
                },
                "ranks": res.ranks,
                "svcca_dims": res.svcca_dims if "svcca" in self.measures else None,
            }
        return {
            "measures": list(self.measures),
            "descriptions": {m: MEASURES[m] for m in self.measures},
            "conventions": {m: CONVENTIONS[m] for m in self.measures},
            "rank_tol": self.rank_tol,
            "svcca_variance": self.svcca_variance,
            "orientation": "tables[name][i][j] compares row model i with column model j "
            "(models in the order of 'models'); symmetric except pwcca (weights from the row "
            "model) and cv_r2 (R²(row | column))",
            "splits": splits,
            "cv_r2": None if self.cv is None else self.cv.to_dict(),
            "notes": list(self.notes),
        }

    def csv_rows(self) -> list[tuple[str, str, str, str, int, float]]:
        """(kind, row model, column model, split, n, value) for every table entry off the
        diagonal; kind is the table name; cv_r2 rows have split ``all``."""
        rows: list[tuple[str, str, str, str, int, float]] = []
        m = len(self.names)
        for split, res in self.splits.items():
            for key in (t for measure in self.measures for t in TABLES.get(measure, ())):
                table = res.tables[key]
                for i in range(m):
                    for j in range(m):
                        if i != j:
                            rows.append(
                                (key, self.names[i], self.names[j], split, res.n, table[i, j])
                            )
        if self.cv is not None:
            n = sum(self.cv.counts)
            for key, table in (("cv_r2", self.cv.mean()), ("cv_r2_std", self.cv.std())):
                for i in range(m):
                    for j in range(m):
                        if i != j:
                            row = (key, self.names[i], self.names[j], ALL_ROWS, n, table[i, j])
                            rows.append(row)
            group = self.cv.group
            for key, values in (
                ("cv_r2_group", group.mean(axis=0)),
                ("cv_r2_group_std", group.std(axis=0, ddof=1)),
            ):
                for i, name in enumerate(self.names):
                    others = ";".join(o for o in self.names if o != name)
                    rows.append((key, name, others, ALL_ROWS, n, float(values[i])))
        return rows
