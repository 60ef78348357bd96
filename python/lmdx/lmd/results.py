"""Results of LMD fits: one fit (:class:`LMDFit`), the pairwise and group tables of a set
of models (:class:`DecompositionResult`), and their JSON and CSV files.

The files keep their keys from before the ridges were renamed: ``rho`` is the relative
ridge (:attr:`LMDFit.ridge`), ``rho_scores`` its validation scores, ``lambda`` the
absolute ridge (:attr:`LMDFit.ridge_absolute`), and ``regularization`` holds
``rho_grid`` (:attr:`DecompositionResult.ridge_grid`) and ``alpha``
(:attr:`DecompositionResult.ridge_absolute`).
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from numpy.typing import NDArray

from .. import _core
from ..files.atomic import atomic_file
from .names import Renamed
from .split_moments import SPLITS, check_split

if TYPE_CHECKING:
    from .similarity_results import SimilarityResult

__all__ = ["ORIENTATION", "DecompositionResult", "LMDFit", "Mode"]

#: The conventions of a fit: ``"default"`` or ``"compat"`` (see :mod:`lmdx.lmd`).
Mode = Literal["default", "compat"]
Array = NDArray[np.float64]

#: How every output orients a fit; stated in result.json.
ORIENTATION = (
    "R²(target | basis): the target model's embeddings are predicted from the basis "
    "models'; in r2_target_by_basis rows are targets and columns are bases"
)


def _json_float(x: float | None) -> float | None:
    return None if x is None or not math.isfinite(x) else float(x)


@dataclass(frozen=True)
class LMDFit:
    """One fit R²(target | basis).

    Attributes
    ----------
    target, basis
        Model names: the target's embeddings are predicted from the basis's.
    ridge
        Ridge relative to the mean diagonal of the matrix that was factored (Σ_zz for a
        direct fit, the joint Σ for a group fit). Key ``rho`` in the files.
    ridge_absolute
        Absolute ridge λ added to the diagonal, on the covariance scale of the mode
        (``ddof=0`` in the default mode, N − 1 in compat mode, where it equals the
        mode's ``ridge_absolute``). Key ``lambda`` in the files.
    r2, r2_per_dim
        Pooled (variance-weighted) R² and the mean per-dimension R², per scored split.
    ridge_scores
        Validation pooled R² for each value of the result's ``ridge_grid`` (None when the
        ridge was not chosen on validation). Key ``rho_scores`` in the files.
    weight, bias
        W, shape (D_u, D_z), and b, shape (D_u,), if kept.

    Notes
    -----
    ``rho``, ``lam`` and ``rho_scores`` are deprecated names of ``ridge``,
    ``ridge_absolute`` and ``ridge_scores``.
    """

    target: tuple[str, ...]
    basis: tuple[str, ...]
    ridge: float
    ridge_absolute: float
    r2: dict[str, float]
    r2_per_dim: dict[str, float]
    ridge_scores: tuple[float, ...] | None = None
    weight: Array | None = field(default=None, repr=False, compare=False)
    bias: Array | None = field(default=None, repr=False, compare=False)

    rho = Renamed()
    lam = Renamed()
    rho_scores = Renamed()

    def to_dict(self) -> dict[str, Any]:
        """JSON-able summary (without W and b); NaN becomes None. Keys as in the files."""
        return {
            "target": list(self.target),
            "basis": list(self.basis),
            "rho": _json_float(self.ridge),
            "lambda": _json_float(self.ridge_absolute),
            "r2": {k: _json_float(v) for k, v in self.r2.items()},
            "r2_per_dim": {k: _json_float(v) for k, v in self.r2_per_dim.items()},
            "rho_scores": None
            if self.ridge_scores is None
            else [_json_float(v) for v in self.ridge_scores],
        }


@dataclass(frozen=True)
class DecompositionResult:
    """Pairwise and group LMD fits of a set of models, with what is needed to report them.

    ``pairwise`` holds R²(a | b) for every ordered pair a ≠ b (target a, basis b);
    ``group`` holds R²(f_i | all others) for every model i. ``ridge_grid`` is the grid
    the relative ridges were chosen from (None when fixed), ``ridge_absolute`` the
    absolute ridge of compat mode (None in the default mode); ``rho_grid`` and ``alpha``
    are their deprecated names (and their keys in result.json). ``similarity`` holds the
    representation-similarity measures of the same pass (None when none were asked for).
    """

    names: tuple[str, ...]
    dims: tuple[int, ...]
    counts: dict[str, int]
    mode: Mode
    ddof: int
    ridge_grid: tuple[float, ...] | None
    ridge_absolute: float | None
    pairwise: tuple[LMDFit, ...]
    group: tuple[LMDFit, ...]
    seed: int | None = None
    version: str = field(default_factory=lambda: str(_core.core.__version__))
    warnings: tuple[str, ...] = ()
    similarity: SimilarityResult | None = field(default=None, compare=False, repr=False)

    orientation = ORIENTATION
    rho_grid = Renamed()
    alpha = Renamed()

    def r2_target_by_basis(self, split: str, *, per_dim: bool = False) -> Array:
        """Pairwise R² as an (m, m) matrix: entry [a, b] is R²(target a | basis b).

        The diagonal, and pairs not scored on ``split``, are NaN.
        """
        check_split(split)
        out = np.full((len(self.names), len(self.names)), np.nan)
        for fit in self.pairwise:
            table = fit.r2_per_dim if per_dim else fit.r2
            if split in table:
                out[self.names.index(fit.target[0]), self.names.index(fit.basis[0])] = table[split]
        return out

    def group_r2(self, split: str, *, per_dim: bool = False) -> dict[str, float]:
        """R²(f_i | all others) per model i on ``split``."""
        check_split(split)
        return {
            fit.target[0]: (fit.r2_per_dim if per_dim else fit.r2).get(split, math.nan)
            for fit in self.group
        }

    def dependency(self, split: str) -> float:
        """Dependency of the set: the mean group R² on ``split`` (NaN without group fits)."""
        values = list(self.group_r2(split).values())
        return float(np.mean(values)) if values else math.nan

    def to_dict(self) -> dict[str, Any]:
        """Everything as JSON-able types (NaN becomes None), keys as in result.json."""
        scored = [s for s in SPLITS if self.counts.get(s, 0) > 0]
        return {
            "method": "LMD (Zhang, EMNLP 2022, arXiv 2210.10289)",
            "lmdx_version": self.version,
            "mode": self.mode,
            "covariance_ddof": self.ddof,
            "models": [{"name": n, "dim": d} for n, d in zip(self.names, self.dims, strict=True)],
            "n": dict(self.counts),
            "seed": self.seed,
            "regularization": {
                "rho_grid": None if self.ridge_grid is None else list(self.ridge_grid),
                "alpha": self.ridge_absolute,
                "pairwise": "absolute alpha on the N-1 covariance"
                if self.mode == "compat"
                else "lambda = rho * trace(Sigma_zz) / D_z",
                "group": "absolute alpha on the N-1 covariance"
                if self.mode == "compat"
                else "lambda = rho * trace(Sigma) / D over all models (one factorization)",
            },
            "orientation": self.orientation,
            "pairwise": [f.to_dict() for f in self.pairwise],
            "group": [f.to_dict() for f in self.group],
            "dependency": {s: _json_float(self.dependency(s)) for s in scored}
            if self.group
            else {},
            "warnings": list(self.warnings),
            **({} if self.similarity is None else {"similarity": self.similarity.to_dict()}),
        }

    def to_json(self, path: str | os.PathLike[str] | None = None, *, indent: int = 2) -> str:
        """The :meth:`to_dict` content as JSON text; also written to ``path`` if given
        (to a temporary file, renamed at the end)."""
        text = json.dumps(self.to_dict(), indent=indent, allow_nan=False, ensure_ascii=False) + "\n"
        if path is not None:
            _write_text(path, text)
        return text

    def to_csv(self, path: str | os.PathLike[str]) -> None:
        """Write the pairwise and group tables as one long CSV: one row per fit and split,
        columns ``kind`` (pairwise | group), ``target``, ``basis`` (model names joined by
        ``;``), ``split``, ``n``, ``r2``, ``r2_per_dim``, ``rho`` (the relative ridge),
        ``lambda`` (the absolute ridge), ``value`` (empty). With similarity measures, one
        more row per table entry: ``kind`` the table (e.g. ``cka``), ``target`` the row
        model, ``basis`` the column model, ``split`` (or ``all``), ``n`` and ``value``.
        Written to a temporary file and renamed, so a failure leaves no partial file."""
        buf = io.StringIO()
        writer = csv.writer(buf, lineterminator="\n")
        writer.writerow(
            ["kind", "target", "basis", "split", "n", "r2", "r2_per_dim", "rho", "lambda", "value"]
        )
        for kind, fits in (("pairwise", self.pairwise), ("group", self.group)):
            for fit in fits:
                for split in SPLITS:
                    if split not in fit.r2:
                        continue
                    writer.writerow(
                        [
                            kind,
                            ";".join(fit.target),
                            ";".join(fit.basis),
                            split,
                            self.counts[split],
                            repr(fit.r2[split]),
                            repr(fit.r2_per_dim[split]),
                            repr(fit.ridge),
                            repr(fit.ridge_absolute),
                            "",
                        ]
                    )
        if self.similarity is not None:
            for kind, row, col, split, n, value in self.similarity.csv_rows():
                writer.writerow([kind, row, col, split, n, "", "", "", "", repr(float(value))])
        _write_text(path, buf.getvalue())


def _write_text(path: str | os.PathLike[str], text: str) -> None:
    """``text`` as UTF-8 in ``path``, readable by all (the temporary file is 0600)."""
    with atomic_file(path) as tmp:
        tmp.write_text(text, encoding="utf-8", newline="")
        os.chmod(tmp, 0o644)
