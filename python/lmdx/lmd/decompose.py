"""The front door of LMD: collect sentence embeddings per split, then fit (see
:mod:`lmdx.lmd` for the method and its conventions)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..moments import DEFAULT_CHUNK_ROWS
from .fit import check_sample_size, fit_basis, fit_groups, ridge_plan, split_stats
from .names import renamed_keywords
from .results import DecompositionResult, LMDFit, Mode
from .split_moments import SPLITS, BlockLayout, SplitMoments, check_split

__all__ = ["Decomposition"]


class Decomposition:
    """Collect per-model sentence embeddings for each split, then fit LMD from moments.

    Parameters
    ----------
    names, dims
        Model names (used in every output) and their embedding sizes.
    seed
        Recorded in the result (e.g. the seed that shuffled the data into splits); the
        fits themselves are deterministic.
    chunk_rows
        Passed to :class:`lmdx.Moments`.

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
    ) -> None:
        self.layout = BlockLayout(names, dims)
        self.seed = None if seed is None else int(seed)
        self.splits: dict[str, SplitMoments] = {
            s: SplitMoments(names, dims, split=s, chunk_rows=chunk_rows) for s in SPLITS
        }

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
        self.splits[check_split(split)].add(embeddings, n_threads=n_threads)
        return self

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
        **renamed: Any,
    ) -> DecompositionResult:
        """All pairwise fits R²(a | b) and all group fits R²(f_i | all others).

        Parameters are as in :meth:`fit_one`; ``pairwise``/``group`` select the tables and
        ``keep_weights`` keeps W and b of every fit (m(m−1)·d² numbers for the pairwise
        table). Pairwise fits factor Σ_bb once per basis b and ridge value (all targets as
        right-hand sides); group fits factor the joint Σ once per ridge value.

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
        )

    def __repr__(self) -> str:
        counts = ", ".join(f"{s}={n}" for s, n in self.counts.items())
        return f"Decomposition(models={list(self.names)}, dims={list(self.dims)}, {counts})"
