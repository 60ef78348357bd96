"""The front door of LMD: collect sentence embeddings per split, then fit (see
:mod:`lmdx.lmd` for the method and its conventions)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..moments import DEFAULT_CHUNK_ROWS
from .cross_validation import DEFAULT_FOLDS, FoldMoments, cross_validate
from .fit import (
    DEFAULT_RIDGE_GRID,
    check_sample_size,
    fit_basis,
    fit_groups,
    ridge_plan,
    split_stats,
)
from .names import renamed_keywords
from .results import DecompositionResult, LMDFit, Mode
from .similarity import RANK_TOL, SVCCA_VARIANCE, SplitSimilarity, parse_measures, split_similarity
from .similarity_results import ALL_ROWS, SimilarityResult
from .split_moments import SPLITS, BlockLayout, SplitMoments, check_split

__all__ = ["Decomposition"]


class Decomposition:
    """Collect per-model sentence embeddings for each split, then fit LMD from moments.

    Parameters
    ----------
    names
        Model names (used in every output).
    dims
        Their embedding sizes, in the same order.
    seed
        Recorded in the result (e.g. the seed that shuffled the data into splits); the
        fits themselves are deterministic.
    chunk_rows
        Passed to :class:`lmdx.Moments`.
    measures
        Representation-similarity measures to compute from the same pass: ``"all"``, a
        comma/space separated string or a list of names of
        :data:`~lmdx.lmd.similarity.MEASURES`, ``()`` for none; default (None): the cheap
        ones, :data:`~lmdx.lmd.similarity.CHEAP_MEASURES` (all but ``cv_r2``).
        ``debiased_cka`` adds m(m + 1 + D) sums per split; ``cv_r2`` keeps one D × D Gram
        per fold.
    folds
        k of ``cv_r2`` (rows dealt to the folds in turn, in the order added).

    Examples
    --------
    >>> dec = Decomposition(["bert", "roberta"], [768, 768])
    >>> dec.add("train", [bert_train, roberta_train])          # doctest: +SKIP
    >>> dec.add("validation", [bert_val, roberta_val])          # doctest: +SKIP
    >>> result = dec.fit()                                      # doctest: +SKIP
    >>> result.r2_target_by_basis("validation")                 # doctest: +SKIP
    """

    def __init__(
        self,
        names: Sequence[str],
        dims: Sequence[int],
        *,
        seed: int | None = None,
        chunk_rows: int = DEFAULT_CHUNK_ROWS,
        measures: str | Sequence[str] | None = None,
        folds: int = DEFAULT_FOLDS,
    ) -> None:
        self.layout = BlockLayout(names, dims)
        self.seed = None if seed is None else int(seed)
        self.measures = parse_measures(measures)
        norms = "debiased_cka" in self.measures
        self.splits: dict[str, SplitMoments] = {
            s: SplitMoments(names, dims, split=s, chunk_rows=chunk_rows, norms=norms)
            for s in SPLITS
        }
        self.folds = (
            FoldMoments(names, dims, folds, chunk_rows=chunk_rows)
            if "cv_r2" in self.measures
            else None
        )

    @property
    def names(self) -> tuple[str, ...]:
        return self.layout.names

    @property
    def dims(self) -> tuple[int, ...]:
        return self.layout.dims

    @property
    def counts(self) -> dict[str, int]:
        """Rows added per split."""
        return {s: m.count for s, m in self.splits.items()}

    def add(
        self,
        split: str,
        embeddings: Sequence[Any] | Mapping[str, Any],
        *,
        n_threads: int | None = None,
    ) -> Decomposition:
        """Add a batch to ``split``: m arrays (n, d_j) in model order, or a name → array
        mapping; row t of each embeds the same sentence. See :meth:`SplitMoments.add`."""
        moments = self.splits[check_split(split)]
        before = moments.count
        moments.add(embeddings, n_threads=n_threads)
        if self.folds is not None and moments.count > before:
            shift = moments.shift
            assert shift is not None
            self.folds.add(embeddings, moments.count - before, shift, n_threads=n_threads)
        return self

    def similarity(
        self,
        *,
        cv_ridge: float | None = None,
        cv_ridge_grid: Sequence[float] | None = None,
        rank_tol: float = RANK_TOL,
        svcca_variance: float = SVCCA_VARIANCE,
        allow_regularization: bool = True,
        n_threads: int | None = None,
    ) -> SimilarityResult:
        """The measures given at construction, for every pair of models, on every split
        with at least 2 rows and on all rows together (``"all"``); see
        :mod:`lmdx.lmd.similarity` for the measures and their conventions.

        Parameters
        ----------
        cv_ridge
            Fixed relative ridge ρ of the cross-validated fits (``cv_r2``); None: chosen
            per fit from :data:`~lmdx.lmd.DEFAULT_RIDGE_GRID` on an inner fold (see
            :mod:`lmdx.lmd.cross_validation`).
        cv_ridge_grid
            The grid of that choice (default :data:`~lmdx.lmd.DEFAULT_RIDGE_GRID`).
        rank_tol
            Eigenvalues of a model's covariance at or below ``rank_tol`` × the largest are
            dropped by CCA, SVCCA and PWCCA.
        svcca_variance
            Fraction of each model's variance SVCCA keeps.
        allow_regularization
            As in :meth:`fit` (for ``cv_r2``).
        n_threads
            As in :meth:`fit` (for ``cv_r2``).
        """
        pieces = {s: m for s, m in self.splits.items() if m.count >= 2}
        if not pieces:
            raise ValueError("similarity: no split has 2 rows yet; add embeddings first")
        splits: dict[str, SplitSimilarity] = {}
        notes: list[str] = []
        if any(k != "cv_r2" for k in self.measures):
            whole: SplitMoments | None = None
            for m in self.splits.values():
                if m.count:
                    whole = m.copy() if whole is None else whole.merge(m)
            assert whole is not None
            for split, moments in (*pieces.items(), (ALL_ROWS, whole)):
                splits[split] = split_similarity(
                    self.layout,
                    moments.moments.count,
                    moments.covariance(0),
                    moments.centered_norms() if moments.has_norms else None,
                    self.measures,
                    where=f"split {split!r}",
                    rank_tol=rank_tol,
                    svcca_variance=svcca_variance,
                )
                notes.extend(splits[split].notes)
        cv = None
        if self.folds is not None:
            cv = cross_validate(
                self.folds,
                ridge=cv_ridge,
                ridge_grid=DEFAULT_RIDGE_GRID if cv_ridge_grid is None else cv_ridge_grid,
                allow_regularization=allow_regularization,
                n_threads=n_threads,
            )
        return SimilarityResult(
            names=self.names,
            measures=self.measures,
            splits=splits,
            cv=cv,
            rank_tol=rank_tol,
            svcca_variance=svcca_variance,
            notes=tuple(notes),
        )

    def fit_one(
        self,
        target: str | Sequence[str],
        basis: str | Sequence[str],
        *,
        ridge: float | None = None,
        ridge_grid: Sequence[float] | None = None,
        mode: Mode = "default",
        ridge_absolute: float | None = None,
        allow_regularization: bool = True,
        n_threads: int | None = None,
        **renamed: Any,
    ) -> LMDFit:
        """Fit the target model(s) on the basis model(s) and score every split with rows.

        Parameters
        ----------
        target, basis
            A model name or a list of names (disjoint sets).
        ridge
            Fixed relative ridge ρ (default mode): λ = ρ·tr(Σ_zz)/D_z, as ``ridge`` of
            :func:`lmdx.spd_solve`.
        ridge_grid
            Relative ridges tried when ``ridge`` is None; the best pooled validation R²
            wins (default :data:`~lmdx.lmd.DEFAULT_RIDGE_GRID`).
        mode
            ``"default"`` or ``"compat"`` (reference conventions; see :mod:`lmdx.lmd`).
        ridge_absolute
            Absolute ridge of compat mode, added to the N − 1 covariance (the reference's
            α; default :data:`~lmdx.lmd.COMPAT_RIDGE_ABSOLUTE`).
        allow_regularization
            Passed to :func:`lmdx.spd_solve` (a singular Σ_zz at ridge 0 escalates the
            ridge with a warning, or raises if False).
        **renamed
            ``rho``, ``rho_grid`` and ``alpha``: deprecated names of ``ridge``,
            ``ridge_grid`` and ``ridge_absolute`` (they warn).

        Returns
        -------
        LMDFit
            With ``weight`` (D_u, D_z) and ``bias`` (D_u,).
        """
        targets = (target,) if isinstance(target, str) else tuple(target)
        bases = (basis,) if isinstance(basis, str) else tuple(basis)
        if not targets or not bases:
            raise ValueError("target and basis must each name at least one model")
        for n in (*targets, *bases):
            self.layout.index(n)
        shared = sorted(set(targets) & set(bases))
        if shared:
            raise ValueError(f"models {shared} are in both target and basis")
        given = {"ridge": ridge, "ridge_grid": ridge_grid, "ridge_absolute": ridge_absolute}
        plan = ridge_plan(mode, **renamed_keywords("Decomposition.fit_one", renamed, given))
        stats = split_stats(self.splits, plan)
        notes: list[str] = []
        check_sample_size(stats, len(self.layout.indices(bases)), "this fit", notes)
        (fit,) = fit_basis(
            self.layout,
            stats,
            plan,
            bases,
            [targets],
            keep_weights=True,
            allow_regularization=allow_regularization,
            n_threads=n_threads,
        )
        return fit

    def fit(
        self,
        *,
        ridge: float | None = None,
        ridge_grid: Sequence[float] | None = None,
        mode: Mode = "default",
        ridge_absolute: float | None = None,
        pairwise: bool = True,
        group: bool = True,
        keep_weights: bool = False,
        allow_regularization: bool = True,
        n_threads: int | None = None,
        cv_ridge: float | None = None,
        rank_tol: float = RANK_TOL,
        svcca_variance: float = SVCCA_VARIANCE,
        **renamed: Any,
    ) -> DecompositionResult:
        """All pairwise fits R²(a | b) and all group fits R²(f_i | all others).

        Parameters are as in :meth:`fit_one`; ``pairwise``/``group`` select the tables and
        ``keep_weights`` keeps W and b of every fit (m(m−1)·d² numbers for the pairwise
        table). Pairwise fits factor Σ_bb once per basis b and ridge value (all targets as
        right-hand sides); group fits factor the joint Σ once per ridge value. The
        similarity measures given at construction are computed as by :meth:`similarity`
        (``cv_ridge``: default ``ridge`` when that is fixed, else ``ridge_grid`` (or the
        default grid) chosen on an inner fold) and returned as the result's ``similarity``.

        Returns
        -------
        DecompositionResult
        """
        if len(self.names) < 2:
            raise ValueError("fit: need at least two models")
        given = {"ridge": ridge, "ridge_grid": ridge_grid, "ridge_absolute": ridge_absolute}
        plan = ridge_plan(mode, **renamed_keywords("Decomposition.fit", renamed, given))
        stats = split_stats(self.splits, plan)
        notes: list[str] = []
        options: dict[str, Any] = {
            "keep_weights": keep_weights,
            "allow_regularization": allow_regularization,
            "n_threads": n_threads,
        }
        pair_fits: list[LMDFit] = []
        group_fits: list[LMDFit] = []
        if pairwise:
            check_sample_size(stats, max(self.dims), "the pairwise fits", notes)
            by_pair: dict[tuple[str, str], LMDFit] = {}
            for b in self.names:
                others = [(a,) for a in self.names if a != b]
                for f in fit_basis(self.layout, stats, plan, (b,), others, **options):
                    by_pair[(f.target[0], b)] = f
            pair_fits = [by_pair[(a, b)] for a in self.names for b in self.names if a != b]
        if group:
            d_rest = self.layout.dim - min(self.dims)
            check_sample_size(stats, d_rest, "the group fits", notes)
            group_fits = fit_groups(self.layout, stats, plan, **options)
        similarity = None
        if self.measures:
            if cv_ridge is None and plan.mode == "default" and not plan.select:
                cv_ridge = plan.ridges[0]
            similarity = self.similarity(
                cv_ridge=cv_ridge,
                cv_ridge_grid=plan.ridges if plan.select else None,
                rank_tol=rank_tol,
                svcca_variance=svcca_variance,
                allow_regularization=allow_regularization,
                n_threads=n_threads,
            )
            notes.extend(similarity.notes)
        return DecompositionResult(
            names=self.names,
            dims=self.dims,
            counts=self.counts,
            mode=plan.mode,
            ddof=plan.ddof,
            ridge_grid=plan.ridges if plan.select else None,
            ridge_absolute=plan.ridge_absolute,
            pairwise=tuple(pair_fits),
            group=tuple(group_fits),
            seed=self.seed,
            warnings=tuple(notes),
            similarity=similarity,
        )

    def __repr__(self) -> str:
        counts = ", ".join(f"{s}={n}" for s, n in self.counts.items())
        return f"Decomposition(models={list(self.names)}, dims={list(self.dims)}, {counts})"
