"""Streamed sums of squared norms, for the unbiased HSIC (debiased CKA) of every pair of
models, and how they move with the shift the rows were accumulated about.

For rows ``z̃_t = z_t − c`` of the concatenated embeddings (the shift ``c`` of
:class:`~lmdx.lmd.split_moments.SplitMoments`) and model j's block ``x̃_{j,t}`` of it, let
``a_{j,t} = ‖x̃_{j,t}‖²``. :class:`NormMoments` accumulates, in float64,

* ``norm_sum``   (m,)    ``Σ_t a_{j,t}``,
* ``norm_gram``  (m, m)  ``Σ_t a_{j,t} a_{k,t}``           (Σ‖x‖⁴ on the diagonal),
* ``norm_cross`` (m, D)  ``Σ_t a_{j,t} z̃_tᵀ``              (Σ‖x‖² x and Σ‖x‖² y),

m(m + 1 + D) numbers next to the D² of the joint Gram, and n·m·D flops per n rows
against the Gram's n·D²/2.

Moving the shift by δ (rows ``z̃' = z̃ − δ``; ``δ_j`` the block of model j; the columns
of ``B`` (D, m) hold ``δ_j`` in block j and zeros elsewhere, ``e_j = ‖δ_j‖²``,
``u_{j,t} = δ_jᵀ x̃_{j,t}``, so ``a'_{j,t} = a_{j,t} − 2 u_{j,t} + e_j``), with the
count n, sum s and Gram G of the same rows::

    Σ a'        = Σ a − 2 Bᵀs + n e
    Σ a' a'ᵀ    = Σ a aᵀ − 2 (P B + (P B)ᵀ) + (Σa) eᵀ + e (Σa)ᵀ + 4 BᵀG B
                  − 2 ((Bᵀs) eᵀ + e (Bᵀs)ᵀ) + n e eᵀ
    Σ a' z̃'ᵀ    = P − (Σa) δᵀ − 2 BᵀG + 2 (Bᵀs) δᵀ + e sᵀ − n e δᵀ

(P = Σ a z̃ᵀ), exact expansions of the products; :meth:`NormMoments.shifted` applies
them. Accumulators with different shifts are thus merged exactly, and the sums about
the mean (δ = s/n) that debiased CKA needs come from the streamed ones.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.typing import NDArray

__all__ = ["NormMoments"]

Array = NDArray[np.float64]


class NormMoments:
    """Sums of each model's squared row norms, their pairwise products, and their products
    with the concatenated rows (see the module notes).

    Parameters
    ----------
    dims
        Embedding size of each model, in block order (D = Σ d_j).
    """

    def __init__(self, dims: Sequence[int]) -> None:
        self.dims = tuple(int(d) for d in dims)
        self.offsets = tuple(int(o) for o in np.cumsum((0, *self.dims))[:-1])
        m, dim = len(self.dims), sum(self.dims)
        self.norm_sum = np.zeros(m)
        self.norm_gram = np.zeros((m, m))
        self.norm_cross = np.zeros((m, dim))

    def copy(self) -> NormMoments:
        out = NormMoments(self.dims)
        out.norm_sum[:] = self.norm_sum
        out.norm_gram[:] = self.norm_gram
        out.norm_cross[:] = self.norm_cross
        return out

    def squared_norms(self, rows: NDArray[np.floating]) -> Array:
        """``a`` (n, m): each model's squared norm of each row, summed in float64 (for float32
        rows each square is rounded to float32 first: at most 2⁻²⁴ relative, all terms
        positive)."""
        out = np.empty((rows.shape[0], len(self.dims)))
        for j, (lo, d) in enumerate(zip(self.offsets, self.dims, strict=True)):
            np.square(rows[:, lo : lo + d]).sum(axis=1, dtype=np.float64, out=out[:, j])
        return out

    def update(self, rows: NDArray[np.floating]) -> NormMoments:
        """Add shifted rows (n, D) (the same rows the joint moments get).

        For float32 rows the product Σ a z̃ᵀ of this batch is multiplied in float32 (a
        float64 one would need a float64 copy of the batch) and added in float64. It only
        enters through the shift to the mean (:meth:`shifted`), multiplied by δ, so its
        ~1e-6 relative error is below that of the float32 Gram. Float64 rows are multiplied
        in float64. The m × n by n × D product is a single-threaded ``einsum``: with m rows
        it is memory-bound, and threaded BLAS on a busy machine made it over 10 times
        slower (measured: 76 ms against 6 ms for 1000 × 1152 float32 rows, m = 3).
        """
        a = self.squared_norms(rows)
        self.norm_sum += a.sum(axis=0)
        self.norm_gram += a.T @ a
        weights = a.astype(np.float32) if rows.dtype == np.float32 else a
        self.norm_cross += np.einsum("tj,td->jd", weights, rows, optimize=False)
        return self

    def add(self, other: NormMoments) -> NormMoments:
        """Add the sums of another accumulator over disjoint rows, about the same shift."""
        self.norm_sum += other.norm_sum
        self.norm_gram += other.norm_gram
        self.norm_cross += other.norm_cross
        return self

    def shifted(self, delta: Array, count: float, total: Array, gram: Array) -> NormMoments:
        """The sums of the rows ``z̃ − delta``, from these sums of rows ``z̃`` and their
        ``count``, ``total`` (Σ z̃, shape (D,)) and ``gram`` (Σ z̃ z̃ᵀ, shape (D, D))."""
        m = len(self.dims)
        b = np.zeros((len(delta), m))
        for j, (lo, d) in enumerate(zip(self.offsets, self.dims, strict=True)):
            b[lo : lo + d, j] = delta[lo : lo + d]
        e = np.einsum("dj,dj->j", b, b)
        bs = b.T @ total
        btg = b.T @ gram  # (m, D)
        pb = self.norm_cross @ b
        sa = self.norm_sum
        out = NormMoments(self.dims)
        out.norm_sum = sa - 2.0 * bs + count * e
        gram_ab = (
            self.norm_gram
            - 2.0 * (pb + pb.T)
            + np.outer(sa, e)
            + np.outer(e, sa)
            + 4.0 * (btg @ b)
            - 2.0 * (np.outer(bs, e) + np.outer(e, bs))
            + count * np.outer(e, e)
        )
        out.norm_gram = 0.5 * (gram_ab + gram_ab.T)
        out.norm_cross = (
            self.norm_cross
            - np.outer(sa, delta)
            - 2.0 * btg
            + 2.0 * np.outer(bs, delta)
            + np.outer(e, total)
            - count * np.outer(e, delta)
        )
        return out
