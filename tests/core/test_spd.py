"""lmdx.spd_solve against scipy/numpy solves of the regularized system built here."""

from __future__ import annotations

import re

import lmdx
import numpy as np
import pytest
import scipy.linalg
import torch
from hypothesis import given
from hypothesis import strategies as st

ALPHAS = (1.0, 0.9, 0.1, 0.0)
seeds = st.integers(0, 2**32 - 1)


def regularized(a: np.ndarray, alpha: float, ridge: float) -> np.ndarray:
    """α·offdiag(A) + diag(A) + ridge·mean(diag A)·I in float64 (DESIGN.md, spd.hpp)."""
    a = np.asarray(a, dtype=np.float64)
    diag = np.diag(np.diag(a))
    return alpha * (a - diag) + diag + ridge * np.mean(np.diag(a)) * np.eye(len(a))


def reference_solve(a, b, alpha, ridge):
    return scipy.linalg.solve(regularized(a, alpha, ridge), np.asarray(b, dtype=np.float64))


def random_gram(rng: np.random.Generator, d: int, rows: int | None = None) -> np.ndarray:
    x = rng.standard_normal((rows if rows is not None else 3 * d + 4, d)) * rng.uniform(0.5, 2, d)
    return x.T @ x


def assert_solution_close(x, ref, m, *, factor: float = 1.0) -> None:
    """Norm-wise forward error bounded by the condition number of the system m."""
    tol = max(1e-12, 1e-14 * np.linalg.cond(m)) * factor
    assert x.shape == ref.shape and x.dtype == np.float64
    assert np.linalg.norm(x - ref) <= tol * np.linalg.norm(ref) + 1e-300


# --------------------------------------------------------------------------- accuracy


@given(
    d=st.integers(1, 40),
    k=st.sampled_from([None, 1, 3, 7]),
    alpha=st.sampled_from(ALPHAS),
    ridge=st.sampled_from([0.0, 1e-6, 0.3]),
    seed=seeds,
    threads=st.sampled_from([1, 2]),
)
def test_matches_reference_solve(d, k, alpha, ridge, seed, threads):
    rng = np.random.default_rng(seed)
    a = random_gram(rng, d)
    b = rng.standard_normal(d if k is None else (d, k))
    res = lmdx.spd_solve(a, b, alpha=alpha, ridge=ridge, n_threads=threads)
    assert res.x.shape == b.shape
    assert_solution_close(res.x, reference_solve(a, b, alpha, ridge), regularized(a, alpha, ridge))
    assert not res.info.escalated and res.info.ridge == ridge and res.info.attempts == 1


@given(d=st.integers(1, 30), alpha=st.sampled_from(ALPHAS), seed=seeds)
def test_info_describes_the_factorization(d, alpha, seed):
    rng = np.random.default_rng(seed)
    a = random_gram(rng, d)
    info = lmdx.spd_solve(a, np.ones(d), alpha=alpha, ridge=0.01).info
    pivots = np.diag(np.linalg.cholesky(regularized(a, alpha, 0.01)))
    mean_diag = np.mean(np.diag(a))
    assert info.mean_diagonal == pytest.approx(mean_diag, rel=1e-14)
    assert info.ridge_absolute == pytest.approx(0.01 * mean_diag, rel=1e-14)
    assert info.min_pivot == pytest.approx(pivots.min(), rel=1e-10)
    assert info.max_pivot == pytest.approx(pivots.max(), rel=1e-10)
    assert info.rcond_estimate == pytest.approx((pivots.min() / pivots.max()) ** 2, rel=1e-9)


@pytest.mark.parametrize(("d", "alpha"), [(300, a) for a in ALPHAS] + [(600, 1.0), (600, 0.1)])
def test_blocked_threaded_path_matches_reference(rng, d, alpha):
    # d > 256 runs the blocked Cholesky (panel + trailing update); 130 right-hand sides
    # span two column blocks of the threaded triangular solve.
    a = random_gram(rng, d, rows=2 * d)
    b = rng.standard_normal((d, 130))
    one = lmdx.spd_solve(a, b, alpha=alpha, n_threads=1)
    two = lmdx.spd_solve(a, b, alpha=alpha, n_threads=2)
    assert np.array_equal(one.x, two.x), "1 and 2 threads must give bit-identical solutions"
    assert_solution_close(one.x, reference_solve(a, b, alpha, 0.0), regularized(a, alpha, 0.0))
    vec = lmdx.spd_solve(a, b[:, 0], alpha=alpha, n_threads=2).x
    np.testing.assert_allclose(vec, one.x[:, 0], rtol=1e-12, atol=1e-14 * np.abs(vec).max())


@given(d=st.integers(1, 20), alpha=st.sampled_from(ALPHAS), seed=seeds)
def test_alpha_zero_is_diagonal_division(d, alpha, seed):
    # Independent of the reduction formula: at alpha=0 only the diagonal remains.
    rng = np.random.default_rng(seed)
    a = random_gram(rng, d)
    b = rng.standard_normal((d, 2))
    x = lmdx.spd_solve(a, b, alpha=0.0).x
    np.testing.assert_allclose(x, b / np.diag(a)[:, None], rtol=1e-13)


def test_accepts_torch_and_lists(rng):
    a = random_gram(rng, 4)
    b = rng.standard_normal(4)
    x = lmdx.spd_solve(torch.from_numpy(a), b.tolist()).x
    assert_solution_close(x, reference_solve(a, b, 1.0, 0.0), a)


def test_inputs_not_modified(rng):
    a = random_gram(rng, 6)
    b = rng.standard_normal((6, 2))
    a0, b0 = a.copy(), b.copy()
    lmdx.spd_solve(a, b, alpha=0.5, ridge=0.1)
    assert np.array_equal(a, a0) and np.array_equal(b, b0)


# --------------------------------------------------------------------------- singular systems


def singular_cases(rng, d=8):
    zero_row = random_gram(rng, d)
    zero_row[3, :] = 0.0
    zero_row[:, 3] = 0.0
    rank_deficient = random_gram(rng, d, rows=d - 3)
    return {"zero_row": (zero_row, 3), "rank_deficient": (rank_deficient, None)}


@pytest.mark.parametrize(
    ("case", "alpha"),
    [("zero_row", 1.0), ("zero_row", 0.9), ("zero_row", 0.0), ("rank_deficient", 1.0)],
)
def test_singular_is_regularized_with_warning(rng, case, alpha):
    a, _ = singular_cases(rng)[case]
    b = rng.standard_normal((8, 2))
    with pytest.warns(lmdx.RegularizationWarning, match=r"^my\.layer: not numerically positive"):
        res = lmdx.spd_solve(a, b, alpha=alpha, name="my.layer")
    info = res.info
    assert info.escalated
    assert info.attempts >= 2
    assert info.ridge >= 1e-10
    # ×10 escalation from 1e-10: the ridge used is 1e-10 · 10^(attempts - 2).
    assert info.ridge == pytest.approx(1e-10 * 10.0 ** (info.attempts - 2), rel=1e-12)
    assert info.ridge_absolute == pytest.approx(info.ridge * np.mean(np.diag(a)), rel=1e-14)
    m = regularized(a, alpha, info.ridge)
    # The system is ill-conditioned by construction: bound the error by its condition number.
    assert_solution_close(res.x, reference_solve(a, b, alpha, info.ridge), m, factor=10.0)


def test_rank_deficient_with_alpha_below_one_needs_no_ridge(rng):
    # α < 1 keeps the (positive) diagonal whole and shrinks the rest: positive definite.
    a, _ = singular_cases(rng)["rank_deficient"]
    b = rng.standard_normal(8)
    res = lmdx.spd_solve(a, b, alpha=0.9)  # filterwarnings=error: no warning allowed here
    assert not res.info.escalated and res.info.ridge == 0.0
    assert_solution_close(res.x, reference_solve(a, b, 0.9, 0.0), regularized(a, 0.9, 0.0))


def test_zero_row_solution_is_exact_in_the_decoupled_coordinate(rng):
    a, bad = singular_cases(rng)["zero_row"]
    b = rng.standard_normal(8)
    with pytest.warns(lmdx.RegularizationWarning):
        res = lmdx.spd_solve(a, b)
    expected = b[bad] / (res.info.ridge * np.mean(np.diag(a)))
    assert res.x[bad] == pytest.approx(expected, rel=1e-12)


def test_requested_ridge_large_enough_does_not_escalate(rng):
    a, _ = singular_cases(rng)["zero_row"]
    b = rng.standard_normal(8)
    res = lmdx.spd_solve(a, b, ridge=1e-3)  # filterwarnings=error: no warning allowed here
    assert not res.info.escalated and res.info.ridge == 1e-3 and res.info.attempts == 1
    assert_solution_close(res.x, reference_solve(a, b, 1.0, 1e-3), regularized(a, 1.0, 1e-3))


def test_small_requested_ridge_escalates_from_1e10(rng):
    a, _ = singular_cases(rng)["zero_row"]
    with pytest.warns(lmdx.RegularizationWarning):
        res = lmdx.spd_solve(a, np.ones(8), ridge=1e-14)
    assert res.info.escalated and res.info.ridge == pytest.approx(1e-10, rel=1e-12)


@pytest.mark.parametrize("case", ["zero_row", "rank_deficient"])
def test_singular_without_regularization_raises_naming_the_system(rng, case):
    a, bad = singular_cases(rng)[case]
    assert issubclass(lmdx.NotPositiveDefiniteError, ValueError)
    pattern = r"^encoder\.layer\.3\.attn\.q: not numerically positive definite: pivot \d+ of 8"
    with pytest.raises(lmdx.NotPositiveDefiniteError, match=pattern) as exc:
        lmdx.spd_solve(a, np.ones(8), allow_regularization=False, name="encoder.layer.3.attn.q")
    if bad is not None:
        assert f"Input feature {bad} " in str(exc.value)


def test_solve_info_repr_shows_the_ridge_used(rng):
    a, _ = singular_cases(rng)["zero_row"]
    with pytest.warns(lmdx.RegularizationWarning):
        info = lmdx.spd_solve(a, np.ones(8)).info
    shown = re.search(r"ridge=([^,)]+)", repr(info))
    assert shown is not None, repr(info)
    assert float(shown.group(1)) == pytest.approx(info.ridge, rel=1e-3), repr(info)


# --------------------------------------------------------------------------- bad input


def test_indefinite_matrix_is_rejected():
    a = np.diag([1.0, -1.0, 2.0])
    with pytest.raises(lmdx.NotPositiveDefiniteError, match=r"indefinite"):
        lmdx.spd_solve(a, np.ones(3), name="sys")
    with pytest.raises(ValueError, match=r"^sys: not numerically positive definite: pivot 1 of 3"):
        lmdx.spd_solve(a, np.ones(3), allow_regularization=False, name="sys")


@pytest.mark.parametrize("allow", [True, False])
def test_zero_matrix_is_rejected(allow):
    with pytest.raises(ValueError, match=r"^empty\.layer: the mean diagonal is 0"):
        lmdx.spd_solve(np.zeros((3, 3)), np.ones(3), allow_regularization=allow, name="empty.layer")


def test_non_finite_inputs_are_rejected():
    a = np.eye(3)
    a[1, 2] = a[2, 1] = np.nan
    with pytest.raises(ValueError, match=r"^a: contains NaN at row 1, column 2"):
        lmdx.spd_solve(a, np.ones(3))
    with pytest.raises(ValueError, match=r"^a: contains Inf at row 0, column 0"):
        lmdx.spd_solve(np.diag([np.inf, 1.0, 1.0]), np.ones(3))
    with pytest.raises(ValueError, match=r"^b: contains Inf at row 1, column 0"):
        lmdx.spd_solve(np.eye(3), np.array([1.0, np.inf, 0.0]))
    with pytest.raises(ValueError, match=r"^b: contains NaN at row 2, column 1"):
        lmdx.spd_solve(np.eye(3), np.array([[1.0, 2], [3, 4], [5, np.nan]]))


def test_bad_shapes_are_rejected():
    with pytest.raises(ValueError, match=r"^a: expected a square matrix, got .* shape \(3, 4\)"):
        lmdx.spd_solve(np.ones((3, 4)), np.ones(3))
    with pytest.raises(ValueError, match=r"^a: expected .*2 dimension"):
        lmdx.spd_solve(np.ones(3), np.ones(3))
    with pytest.raises(ValueError, match=r"^a: expected a square matrix"):
        lmdx.spd_solve(np.zeros((0, 0)), np.zeros(0))
    with pytest.raises(ValueError, match=r"^b: expected 3 rows to match a, got .* shape \(4,\)"):
        lmdx.spd_solve(np.eye(3), np.ones(4))
    with pytest.raises(ValueError, match=r"^b: expected 3 rows to match a, got .* \(2, 3\)"):
        lmdx.spd_solve(np.eye(3), np.ones((2, 3)))
    with pytest.raises(ValueError, match=r"^b: expected .*2 dimension"):
        lmdx.spd_solve(np.eye(3), np.ones((3, 2, 1)))


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"alpha": 1.5}, r"^alpha: must be in \[0, 1\], got 1\.5"),
        ({"alpha": -0.1}, r"^alpha: must be in \[0, 1\], got -0\.1"),
        ({"alpha": float("nan")}, r"^alpha: must be in \[0, 1\], got nan"),
        ({"ridge": -1.0}, r"^ridge: must be finite and >= 0, got -1"),
        ({"ridge": float("inf")}, r"^ridge: must be finite and >= 0, got inf"),
        ({"ridge": float("nan")}, r"^ridge: must be finite and >= 0, got nan"),
        ({"n_threads": 0}, r"^n_threads: must be >= 1"),
    ],
)
def test_bad_options_are_rejected(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        lmdx.spd_solve(np.eye(3), np.ones(3), **kwargs)
