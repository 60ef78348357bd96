"""Language Model Decomposition (LMD; Zhang, EMNLP 2022, arXiv 2210.10289) from moments.

A target model's sentence embeddings ``u(x)`` (``D_u`` numbers) are regressed on the
stacked embeddings of basis models ``z(x) = [v_1(x); …; v_k(x)]`` (``D_z`` numbers;
hidden sizes may differ)::

    W = Σ_uz (Σ_zz + λI)⁻¹,    b = E[u] − W E[z]
    R²(u | z) = 1 − SSR / SST      (pooled over the target's dimensions)

Nothing here keeps embeddings. Each split (``train``, ``validation``, ``test``) holds one
streaming :class:`lmdx.Moments` of the concatenated embeddings ``[f_1(x); …; f_m(x)]``
(:class:`SplitMoments`), and every quantity is a function of those moments:

* the fit uses the train split's mean and centered covariance Σ;
* a split with mean μ and centered covariance S (both over that split's own rows,
  ``ddof=0``) scores a fit ``(W, b)`` as::

      SSR/n = tr(S_uu) − 2 tr(W S_zu) + tr(W S_zz Wᵀ) + ‖μ_u − W μ_z − b‖²
      SST/n = tr(S_uu)

  so SST is centered on the scored split's own mean (the usual held-out R²; it can be
  negative). Besides the pooled, variance-weighted R² of the paper, the average of the
  per-dimension R² values ``1 − SSR_j/SST_j`` is reported (dimensions with zero variance
  on the scored split are left out of that average). A pooled R² with SST = 0 is NaN.

Conventions (``mode``)
----------------------
``"default"``
    Population moments (``ddof=0``). The ridge is relative to the basis scale,
    ``λ = ρ·tr(Σ_zz)/D_z`` (the mean eigenvalue of Σ_zz), so ρ means the same thing for
    any embedding scale or basis size; ρ is fixed (``rho=``) or chosen per fit on the
    validation split from a grid (``rho_grid=``, default :data:`DEFAULT_RHO_GRID`).
``"compat"``
    The reference code's conventions (haozhg/lmd): sample covariances with N − 1, an
    absolute ``α = 1e-6`` added to the diagonal of Σ_zz, the same W and b, pooled R².
    Differences from the default mode: the ridge does not follow the embedding scale
    (α = 1e-6 is negligible for embeddings of unit scale but dominant for embeddings of
    scale 1e-3), it is never tuned, and with N − 1 the effective population-scale ridge
    is α·(N−1)/N. lmdx computes in float64 where the reference uses float32, so numbers
    agree to float32 accuracy. Orientation of the reference's pairwise CSV files is
    basis (row) × target (column); lmdx names both columns explicitly instead.
    (These are the conventions stated for the reference in the project's design notes.
    Early revisions of its ``lmd/cli.py`` differ: uncentered second moments divided by
    the stacked dimension rather than N, no intercept, and an uncentered SST.)

Group fits R²(f_i | all others)
-------------------------------
All m leave-one-out fits come from one Cholesky factorization per ridge value of the
joint regularized covariance ``M = Σ + λI`` (all ``D = Σ d_j`` dimensions): with
``P = M⁻¹``, the ridge regression of block i on the rest is ``W_i = −P_ii⁻¹ P_i,rest``
(block-inverse identity: ``P_ii⁻¹ = M_ii − M_ir M_rr⁻¹ M_ri`` and
``−P_ii⁻¹ P_ir = M_ir M_rr⁻¹``; the λ on the target block's own diagonal does not enter
``W_i``). One factorization means one λ for all m fits, so group fits use
``λ = ρ·tr(Σ)/D`` over the joint matrix; this equals the per-fit convention
``ρ·tr(Σ_rest)/D_rest`` of a direct fit only when the blocks have equal mean variance.
(In compat mode λ = α for every fit, so group fits equal the reference's m separate
fits exactly.) The "dependency of the set" is the mean of the m group R² values.

Memory: a fit needs the D × D covariance of every scored split (8·D² bytes each) and,
for group fits, two more D × D matrices.

Float32 embeddings are accumulated by the native core in float32 chunks; to keep the
centered covariance accurate when an embedding's mean is large against its spread (common
for language models), each split subtracts a fixed shift (the mean of its first batch)
before accumulating, and adds it back in :meth:`SplitMoments.mean`.
"""

from __future__ import annotations

import csv
import io
import itertools
import json
import math
import os
import tempfile
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
from numpy.typing import NDArray

from .. import _core
from .._errors import SampleSizeWarning
from .._tensors import as_float64, as_tensor_array
from ..moments import DEFAULT_CHUNK_ROWS, Moments
from ..spd import spd_solve

__all__ = [
    "COMPAT_ALPHA",
    "DEFAULT_RHO_GRID",
    "MIN_ROWS_PER_DIM",
    "SPLITS",
    "BlockLayout",
    "Decomposition",
    "DecompositionResult",
    "LMDFit",
    "SplitMoments",
]

#: Split names, in the order they are reported.
SPLITS: tuple[str, ...] = ("train", "validation", "test")

#: Relative ridges ρ (λ = ρ·tr(Σ_zz)/D_z) tried when ρ is chosen on the validation split.
#: ρ is relative to the mean eigenvalue of Σ_zz, so one grid fits every embedding scale.
#: The smallest value, 1e-8, is ordinary least squares for all practical purposes: it
#: only lifts directions with less than 1e-8 of the average variance, and it keeps the
#: Cholesky factorization valid when Σ_zz is singular (n_train ≤ D_z, constant or
#: duplicated embedding dimensions, a basis containing near-copies of a model), where an
#: exact 0 would fail. ρ = 1 halves the fitted coefficient along a direction of average
#: variance; larger values mostly measure the penalty, not the models. Decades suffice
#: because validation R² varies slowly in log ρ near its maximum.
DEFAULT_RHO_GRID: tuple[float, ...] = (1e-8, 1e-7, 1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0)

#: The reference code's absolute ridge (compat mode).
COMPAT_ALPHA: float = 1e-6

#: Warn when n_train < MIN_ROWS_PER_DIM · D_z: train R² is then inflated by about D_z/n.
MIN_ROWS_PER_DIM: int = 10

Mode = Literal["default", "compat"]
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


def _check_split(split: str) -> str:
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; use one of {', '.join(map(repr, SPLITS))}")
    return split


# --------------------------------------------------------------------------- moments


class SplitMoments:
    """Streaming moments of the concatenated embeddings of m models over one data split.

    One :class:`lmdx.Moments` of dimension ``D = Σ d_j`` accumulates (in float64) the
    rows ``[f_1(x); …; f_m(x)] − c``, where the shift ``c`` is the mean of the first batch
    (it keeps the centered covariance accurate for float32 input; see the module notes).

    Parameters
    ----------
    names, dims
        Model names and embedding sizes, in block order.
    split
        Which split this is (``"train"``, ``"validation"`` or ``"test"``); used in errors.
    chunk_rows
        Passed to :class:`lmdx.Moments`.
    """

    def __init__(
        self,
        names: Sequence[str],
        dims: Sequence[int],
        *,
        split: str = "train",
        chunk_rows: int = DEFAULT_CHUNK_ROWS,
    ) -> None:
        self.layout = BlockLayout(names, dims)
        self.split = _check_split(split)
        self.moments = Moments(self.layout.dim, chunk_rows=chunk_rows)
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
        obj.moments = moments.copy()
        if shift is not None:
            c = as_float64(shift, "shift").reshape(-1)
            if c.shape != (obj.layout.dim,) or not np.isfinite(c).all():
                raise ValueError(f"shift: expected {obj.layout.dim} finite numbers")
            obj._shift = c.copy()
        elif moments.count > 0:
            obj._shift = np.zeros(obj.layout.dim)
        return obj

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
        return round(self.moments.count)

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
        if other._shift is None:
            return self
        if self._shift is None:
            self._shift = other._shift.copy()
        delta = other._shift - self._shift
        n, s, g = other.moments.count, other.moments.sum, other.moments.gram()
        # Σ (x − c_self)(x − c_self)ᵀ = G + s δᵀ + δ sᵀ + n δ δᵀ with x − c_other summed in G, s.
        g += np.outer(s, delta) + np.outer(delta, s) + n * np.outer(delta, delta)
        moved = Moments.from_state(n, s + n * delta, g, chunk_rows=self.moments.chunk_rows)
        self.moments.merge(moved)
        return self

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
        if self.moments.count < k:
            raise ValueError(
                f"split {self.split!r}: has {self.count} rows, needs at least {k}; "
                f"add embeddings with .add({self.split!r}, ...)"
            )

    def __repr__(self) -> str:
        blocks = ", ".join(f"{n}:{d}" for n, d in zip(self.names, self.dims, strict=True))
        return f"SplitMoments(split={self.split!r}, count={self.count}, blocks=[{blocks}])"


# --------------------------------------------------------------------------- results


def _json_float(x: float | None) -> float | None:
    return None if x is None or not math.isfinite(x) else float(x)


@dataclass(frozen=True)
class LMDFit:
    """One fit R²(target | basis).

    Attributes
    ----------
    target, basis
        Model names: the target's embeddings are predicted from the basis's.
    rho
        Ridge relative to the mean diagonal of the matrix that was factored (Σ_zz for a
        direct fit, the joint Σ for a group fit).
    lam
        Absolute ridge λ added to the diagonal, on the covariance scale of the mode
        (``ddof=0`` in the default mode, N − 1 in compat mode, where it equals α).
    r2, r2_per_dim
        Pooled (variance-weighted) R² and the mean per-dimension R², per scored split.
    rho_scores
        Validation pooled R² for each value of the result's ``rho_grid`` (None when ρ
        was not chosen on validation).
    weight, bias
        W, shape (D_u, D_z), and b, shape (D_u,), if kept.
    """

    target: tuple[str, ...]
    basis: tuple[str, ...]
    rho: float
    lam: float
    r2: dict[str, float]
    r2_per_dim: dict[str, float]
    rho_scores: tuple[float, ...] | None = None
    weight: Array | None = field(default=None, repr=False, compare=False)
    bias: Array | None = field(default=None, repr=False, compare=False)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able summary (without W and b); NaN becomes None."""
        return {
            "target": list(self.target),
            "basis": list(self.basis),
            "rho": _json_float(self.rho),
            "lambda": _json_float(self.lam),
            "r2": {k: _json_float(v) for k, v in self.r2.items()},
            "r2_per_dim": {k: _json_float(v) for k, v in self.r2_per_dim.items()},
            "rho_scores": None
            if self.rho_scores is None
            else [_json_float(v) for v in self.rho_scores],
        }


_ORIENTATION = (
    "R²(target | basis): the target model's embeddings are predicted from the basis "
    "models'; in r2_target_by_basis rows are targets and columns are bases"
)


@dataclass(frozen=True)
class DecompositionResult:
    """Pairwise and group LMD fits of a set of models, with what is needed to report them.

    ``pairwise`` holds R²(a | b) for every ordered pair a ≠ b (target a, basis b);
    ``group`` holds R²(f_i | all others) for every model i.
    """

    names: tuple[str, ...]
    dims: tuple[int, ...]
    counts: dict[str, int]
    mode: Mode
    ddof: int
    rho_grid: tuple[float, ...] | None
    alpha: float | None
    pairwise: tuple[LMDFit, ...]
    group: tuple[LMDFit, ...]
    seed: int | None = None
    version: str = field(default_factory=lambda: str(_core.core.__version__))
    warnings: tuple[str, ...] = ()

    orientation = _ORIENTATION

    def r2_target_by_basis(self, split: str, *, per_dim: bool = False) -> Array:
        """Pairwise R² as an (m, m) matrix: entry [a, b] is R²(target a | basis b).

        The diagonal, and pairs not scored on ``split``, are NaN.
        """
        _check_split(split)
        out = np.full((len(self.names), len(self.names)), np.nan)
        for fit in self.pairwise:
            table = fit.r2_per_dim if per_dim else fit.r2
            if split in table:
                out[self.names.index(fit.target[0]), self.names.index(fit.basis[0])] = table[split]
        return out

    def group_r2(self, split: str, *, per_dim: bool = False) -> dict[str, float]:
        """R²(f_i | all others) per model i on ``split``."""
        _check_split(split)
        return {
            fit.target[0]: (fit.r2_per_dim if per_dim else fit.r2).get(split, math.nan)
            for fit in self.group
        }

    def dependency(self, split: str) -> float:
        """Dependency of the set: the mean group R² on ``split`` (NaN without group fits)."""
        values = list(self.group_r2(split).values())
        return float(np.mean(values)) if values else math.nan

    def to_dict(self) -> dict[str, Any]:
        """Everything as JSON-able types (NaN becomes None)."""
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
                "rho_grid": None if self.rho_grid is None else list(self.rho_grid),
                "alpha": self.alpha,
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
        }

    def to_json(self, path: str | os.PathLike[str] | None = None, *, indent: int = 2) -> str:
        """The :meth:`to_dict` content as JSON text; also written to ``path`` if given."""
        text = json.dumps(self.to_dict(), indent=indent, allow_nan=False, ensure_ascii=False) + "\n"
        if path is not None:
            _write_atomic(path, text)
        return text

    def to_csv(self, path: str | os.PathLike[str]) -> None:
        """Write the pairwise and group tables as one long CSV: one row per fit and split,
        columns ``kind`` (pairwise | group), ``target``, ``basis`` (model names joined by
        ``;``), ``split``, ``n``, ``r2``, ``r2_per_dim``, ``rho``, ``lambda``. Written to a
        temporary file and renamed, so a failure leaves no partial file."""
        buf = io.StringIO()
        writer = csv.writer(buf, lineterminator="\n")
        writer.writerow(
            ["kind", "target", "basis", "split", "n", "r2", "r2_per_dim", "rho", "lambda"]
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
                            repr(fit.rho),
                            repr(fit.lam),
                        ]
                    )
        _write_atomic(path, buf.getvalue())


def _write_atomic(path: str | os.PathLike[str], text: str) -> None:
    target = os.fspath(path)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(target) or ".", prefix=".lmdx-", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
            f.write(text)
        os.chmod(tmp, 0o644)  # mkstemp creates 0600
        os.replace(tmp, target)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


# --------------------------------------------------------------------------- fitting


@dataclass(frozen=True)
class _Stats:
    """Population moments of one split: n, mean (D,), centered covariance (D, D)."""

    n: float
    mean: Array
    cov: Array
    diag: Array


@dataclass(frozen=True)
class _Plan:
    mode: Mode
    ddof: int
    rhos: tuple[float, ...]  # default mode: relative ridges to try
    alpha: float | None  # compat mode: absolute ridge on the N - 1 covariance
    select: bool  # choose among rhos by validation pooled R²

    def ridges(self, mean_diagonal: float, n: float) -> tuple[float, ...]:
        """Relative ridges for spd_solve on a population (ddof=0) covariance."""
        if self.alpha is None:
            return self.rhos
        # (Σ₁ + αI) with Σ₁ = Σ₀·n/(n−1) is proportional to Σ₀ + α(n−1)/n·I.
        return (self.alpha * (n - self.ddof) / n / mean_diagonal,)

    def lam_scale(self, n: float) -> float:
        """Factor from a ridge on the ddof=0 covariance to one on this mode's covariance."""
        return n / (n - self.ddof)


def _plan(mode: str, rho: float | None, rho_grid: Sequence[float] | None, alpha: float) -> _Plan:
    if mode == "compat":
        if rho is not None or rho_grid is not None:
            raise ValueError(
                "mode='compat' uses the reference's absolute alpha; rho and rho_grid "
                "belong to mode='default'"
            )
        if not (math.isfinite(alpha) and alpha >= 0):
            raise ValueError(f"alpha: must be finite and >= 0, got {alpha}")
        return _Plan("compat", 1, (), float(alpha), False)
    if mode != "default":
        raise ValueError(f"mode: expected 'default' or 'compat', got {mode!r}")
    if rho is not None and rho_grid is not None:
        raise ValueError("pass either rho (fixed) or rho_grid (chosen on validation), not both")
    if rho is not None:
        values: tuple[float, ...] = (rho,)
    else:
        values = DEFAULT_RHO_GRID if rho_grid is None else tuple(rho_grid)
    if not values:
        raise ValueError("rho_grid: is empty")
    for v in values:
        if not (math.isfinite(float(v)) and float(v) >= 0):
            raise ValueError(f"rho: ridge values must be finite and >= 0, got {v}")
    grid = tuple(sorted({float(v) for v in values}))
    return _Plan("default", 0, grid, None, len(grid) > 1)


def _r2(ssr: Array, sst: Array) -> tuple[float, float]:
    """Pooled 1 − ΣSSR/ΣSST and the mean of 1 − SSR_j/SST_j over dims with SST_j > 0."""
    total = float(np.sum(sst))
    pooled = 1.0 - float(np.sum(ssr)) / total if total > 0 else math.nan
    ok = sst > 0
    per_dim = float(np.mean(1.0 - ssr[ok] / sst[ok])) if ok.any() else math.nan
    return pooled, per_dim


def _direct_ss(
    x: Array, b: Array, iz: NDArray[np.intp], iu: NDArray[np.intp], st: _Stats
) -> tuple[Array, Array]:
    """Per-target-dim SSR/n and SST/n of u ≈ xᵀ z + b on a split (x = Wᵀ, (D_z, D_u))."""
    s_zu = st.cov[np.ix_(iz, iu)]
    szz_x = st.cov[np.ix_(iz, iz)] @ x
    resid_mean = st.mean[iu] - x.T @ st.mean[iz] - b
    ssr = (
        st.diag[iu]
        - 2.0 * np.einsum("kj,kj->j", x, s_zu)
        + np.einsum("kj,kj->j", x, szz_x)
        + resid_mean**2
    )
    # The expansion can round a tiny true SSR to a tiny negative one.
    return np.maximum(ssr, 0.0), st.diag[iu]


def _group_ss(a: Array, lo: int, hi: int, st: _Stats, train_mean: Array) -> tuple[Array, Array]:
    """SSR/n and SST/n of block lo:hi with residual a·(x − train mean), a = [I, −W] (d, D)."""
    resid_mean = a @ (st.mean - train_mean)
    ssr = np.einsum("jk,jk->j", a, a @ st.cov) + resid_mean**2
    return np.maximum(ssr, 0.0), st.diag[lo:hi]


def _group_rows(p: Array, blk: slice, name: str, n_threads: int | None) -> Array:
    """[I, −W_i] in the columns of all models: P_ii⁻¹ P_i,: with P = (Σ + λI)⁻¹."""
    p_ii = p[blk, blk]
    p_ii = (p_ii + p_ii.T) / 2.0  # P from the solver is symmetric only to rounding
    a = spd_solve(
        p_ii,
        p[blk, :],
        allow_regularization=False,
        name=f"LMD group fit of {name}: precision block P_ii",
        n_threads=n_threads,
    ).x
    a[:, blk] = np.eye(blk.stop - blk.start)  # exactly P_ii⁻¹ P_ii
    return a


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
        self.splits[_check_split(split)].add(embeddings, n_threads=n_threads)
        return self

    # ------------------------------------------------------------------ public fits

    def fit_one(
        self,
        target: str | Sequence[str],
        basis: str | Sequence[str],
        *,
        rho: float | None = None,
        rho_grid: Sequence[float] | None = None,
        mode: Mode = "default",
        alpha: float = COMPAT_ALPHA,
        allow_regularization: bool = True,
        n_threads: int | None = None,
    ) -> LMDFit:
        """Fit the target model(s) on the basis model(s) and score every split with rows.

        Parameters
        ----------
        target, basis
            A model name or a list of names (disjoint sets).
        rho
            Fixed relative ridge (default mode): λ = ρ·tr(Σ_zz)/D_z.
        rho_grid
            Values tried when ``rho`` is None; the best pooled validation R² wins
            (default :data:`DEFAULT_RHO_GRID`).
        mode
            ``"default"`` or ``"compat"`` (reference conventions; see the module notes).
        alpha
            Absolute ridge of compat mode.
        allow_regularization
            Passed to :func:`lmdx.spd_solve` (a singular Σ_zz at ρ = 0 escalates the ridge
            with a warning, or raises if False).

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
        plan = _plan(mode, rho, rho_grid, alpha)
        stats = self._stats(plan)
        notes: list[str] = []
        self._check_sample_size(stats, len(self.layout.indices(bases)), "this fit", notes)
        (fit,) = self._fit_basis(
            stats, plan, bases, [targets], True, allow_regularization, n_threads
        )
        return fit

    def fit(
        self,
        *,
        rho: float | None = None,
        rho_grid: Sequence[float] | None = None,
        mode: Mode = "default",
        alpha: float = COMPAT_ALPHA,
        pairwise: bool = True,
        group: bool = True,
        keep_weights: bool = False,
        allow_regularization: bool = True,
        n_threads: int | None = None,
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
        plan = _plan(mode, rho, rho_grid, alpha)
        stats = self._stats(plan)
        notes: list[str] = []
        pair_fits: list[LMDFit] = []
        group_fits: list[LMDFit] = []
        if pairwise:
            self._check_sample_size(stats, max(self.dims), "the pairwise fits", notes)
            by_pair: dict[tuple[str, str], LMDFit] = {}
            for b in self.names:
                others = [(a,) for a in self.names if a != b]
                for f in self._fit_basis(
                    stats, plan, (b,), others, keep_weights, allow_regularization, n_threads
                ):
                    by_pair[(f.target[0], b)] = f
            pair_fits = [by_pair[(a, b)] for a in self.names for b in self.names if a != b]
        if group:
            d_rest = self.layout.dim - min(self.dims)
            self._check_sample_size(stats, d_rest, "the group fits", notes)
            group_fits = self._fit_groups(
                stats, plan, keep_weights, allow_regularization, n_threads
            )
        return DecompositionResult(
            names=self.names,
            dims=self.dims,
            counts=self.counts,
            mode=plan.mode,
            ddof=plan.ddof,
            rho_grid=plan.rhos if plan.select else None,
            alpha=plan.alpha,
            pairwise=tuple(pair_fits),
            group=tuple(group_fits),
            seed=self.seed,
            warnings=tuple(notes),
        )

    # ------------------------------------------------------------------ internals

    def _stats(self, plan: _Plan) -> dict[str, _Stats]:
        """Population moments of every split with rows (train always; validation when ρ is
        chosen on it)."""
        required = ["train", "validation"] if plan.select else ["train"]
        for s in required:
            if self.splits[s].count == 0:
                why = " (rho is chosen on it; pass rho= to fix ρ instead)" if s != "train" else ""
                raise ValueError(f"split {s!r} is empty{why}; add embeddings with .add({s!r}, ...)")
        out: dict[str, _Stats] = {}
        for s in SPLITS:
            sm = self.splits[s]
            if sm.count == 0:
                continue
            if sm.count < 2:
                raise ValueError(
                    f"split {s!r} has {sm.count} row; R² needs at least 2 rows per split"
                )
            cov = sm.covariance(0)
            out[s] = _Stats(sm.moments.count, sm.mean(), cov, np.diag(cov).copy())
        return out

    def _check_sample_size(
        self, stats: dict[str, _Stats], d_z: int, what: str, notes: list[str]
    ) -> None:
        n = stats["train"].n
        if n < MIN_ROWS_PER_DIM * d_z:
            msg = (
                f"{what}: n_train = {n:g} is less than {MIN_ROWS_PER_DIM} x the basis "
                f"dimension D_z = {d_z}; train R² is inflated by about D_z/n = {d_z / n:.2g}. "
                "Judge the fit by the validation/test R²."
            )
            notes.append(msg)
            warnings.warn(msg, SampleSizeWarning, stacklevel=3)

    def _fit_basis(
        self,
        stats: dict[str, _Stats],
        plan: _Plan,
        basis: tuple[str, ...],
        targets: Sequence[tuple[str, ...]],
        keep_weights: bool,
        allow_regularization: bool,
        n_threads: int | None,
    ) -> list[LMDFit]:
        """Fit each target set on one basis from one Σ_zz factorization per ridge value."""
        tr = stats["train"]
        iz = self.layout.indices(basis)
        ius = [self.layout.indices(t) for t in targets]
        iu = np.concatenate(ius)
        bounds = np.cumsum([0] + [len(i) for i in ius])
        cols = [slice(int(lo), int(hi)) for lo, hi in itertools.pairwise(bounds)]
        szz = tr.cov[np.ix_(iz, iz)]
        szu = tr.cov[np.ix_(iz, iu)]
        mean_diag = float(np.mean(np.diag(szz)))
        if not mean_diag > 0:
            raise ValueError(f"basis {list(basis)}: the embeddings are constant on the train split")
        name = f"LMD basis {'+'.join(basis)}: Σ_zz"
        ridges = plan.ridges(mean_diag, tr.n)
        scores = np.full((len(targets), len(ridges)), -np.inf)
        best_x = np.empty_like(szu)
        best_ridge = [(0.0, 0.0)] * len(targets)
        for r_i, ridge in enumerate(ridges):
            x, info = spd_solve(
                szz,
                szu,
                ridge=ridge,
                allow_regularization=allow_regularization,
                name=name,
                n_threads=n_threads,
            )
            if plan.select:
                b = tr.mean[iu] - x.T @ tr.mean[iz]
                ssr, sst = _direct_ss(x, b, iz, iu, stats["validation"])
                for t, c in enumerate(cols):
                    scores[t, r_i] = _r2(ssr[c], sst[c])[0]
            for t, c in enumerate(cols):
                if r_i == 0 or scores[t, r_i] > scores[t, :r_i].max():
                    best_x[:, c] = x[:, c]
                    best_ridge[t] = (float(info.ridge), float(info.ridge_absolute))
        fits = []
        for t, (c, idx) in enumerate(zip(cols, ius, strict=True)):
            x = best_x[:, c]
            b = tr.mean[idx] - x.T @ tr.mean[iz]
            r2: dict[str, float] = {}
            r2d: dict[str, float] = {}
            for s, st in stats.items():
                r2[s], r2d[s] = _r2(*_direct_ss(x, b, iz, idx, st))
            rho_used, lam = best_ridge[t]
            fits.append(
                LMDFit(
                    target=targets[t],
                    basis=basis,
                    rho=rho_used,
                    lam=lam * plan.lam_scale(tr.n),
                    r2=r2,
                    r2_per_dim=r2d,
                    rho_scores=tuple(float(v) for v in scores[t]) if plan.select else None,
                    weight=np.ascontiguousarray(x.T) if keep_weights else None,
                    bias=b if keep_weights else None,
                )
            )
        return fits

    def _fit_groups(
        self,
        stats: dict[str, _Stats],
        plan: _Plan,
        keep_weights: bool,
        allow_regularization: bool,
        n_threads: int | None,
    ) -> list[LMDFit]:
        """R²(f_i | all others) for every i from one factorization of Σ + λI per ridge."""
        tr = stats["train"]
        dim = self.layout.dim
        mean_diag = float(np.mean(tr.diag))
        if not mean_diag > 0:
            raise ValueError("group fits: all embeddings are constant on the train split")
        ridges = plan.ridges(mean_diag, tr.n)
        m = len(self.names)
        blocks = [self.layout.block(n) for n in self.names]
        scores = np.full((m, len(ridges)), -np.inf)
        best_a: list[Array] = [np.empty(0)] * m
        best_ridge = [(0.0, 0.0)] * m
        identity = np.eye(dim)
        for r_i, ridge in enumerate(ridges):
            p, info = spd_solve(
                tr.cov,
                identity,
                ridge=ridge,
                allow_regularization=allow_regularization,
                name="LMD group fits: Σ",
                n_threads=n_threads,
            )
            for i, blk in enumerate(blocks):
                a = _group_rows(p, blk, self.names[i], n_threads)
                if plan.select:
                    val = _group_ss(a, blk.start, blk.stop, stats["validation"], tr.mean)
                    scores[i, r_i] = _r2(*val)[0]
                if r_i == 0 or scores[i, r_i] > scores[i, :r_i].max():
                    best_a[i] = a
                    best_ridge[i] = (float(info.ridge), float(info.ridge_absolute))
            del p
        fits = []
        for i, (name, blk) in enumerate(zip(self.names, blocks, strict=True)):
            a = best_a[i]
            rest = np.r_[0 : blk.start, blk.stop : dim]
            r2: dict[str, float] = {}
            r2d: dict[str, float] = {}
            for s, st in stats.items():
                r2[s], r2d[s] = _r2(*_group_ss(a, blk.start, blk.stop, st, tr.mean))
            weight = bias = None
            if keep_weights:
                weight = np.ascontiguousarray(-a[:, rest])
                bias = tr.mean[blk] - weight @ tr.mean[rest]
            rho_used, lam = best_ridge[i]
            fits.append(
                LMDFit(
                    target=(name,),
                    basis=tuple(n for n in self.names if n != name),
                    rho=rho_used,
                    lam=lam * plan.lam_scale(tr.n),
                    r2=r2,
                    r2_per_dim=r2d,
                    rho_scores=tuple(float(v) for v in scores[i]) if plan.select else None,
                    weight=weight,
                    bias=bias,
                )
            )
        return fits

    def __repr__(self) -> str:
        counts = ", ".join(f"{s}={n}" for s, n in self.counts.items())
        return f"Decomposition(models={list(self.names)}, dims={list(self.dims)}, {counts})"
