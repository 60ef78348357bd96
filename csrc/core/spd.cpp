#include "core/spd.hpp"

#include <Eigen/Cholesky>
#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <sstream>

#include "core/checks.hpp"
#include "core/parallel.hpp"
#include "core/reduction.hpp"
#include "core/workspace.hpp"

LMDX_NAMESPACE_BEGIN

namespace {

// Fixed block sizes: results must not depend on the thread count.
constexpr Index kFactorBlock = 256;    // Cholesky panel width
constexpr Index kPanelRowBlock = 256;  // rows per task in the panel triangular solve

std::string format_double(double v) {
  std::ostringstream s;
  s.precision(6);
  s << v;
  return s.str();
}

}  // namespace

namespace {

template <typename Scalar>
using Matrix = Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic>;

template <typename Scalar>
Index blocked_cholesky_impl(Eigen::Ref<Matrix<Scalar>> m, double tiny, int n_threads,
                            double* bad_pivot, double max_pivot_ratio) {
  const Index d = m.rows();
  const int threads = resolve_threads(n_threads);
  double largest = 0.0, smallest = INFINITY;  // the pivots so far
  for (Index k = 0; k < d; k += kFactorBlock) {
    const Index kb = std::min(kFactorBlock, d - k);
    // Diagonal block (serial, kb^3/3 flops): Eigen's in-place blocked LLT; if that fails
    // or leaves a pivot below the threshold, redo the block unblocked from a saved copy to
    // find the exact failing pivot for the error message.
    auto a11 = m.block(k, k, kb, kb);
    const Matrix<Scalar> saved = a11;
    bool ok = false;
    {
      Eigen::LLT<Eigen::Ref<Matrix<Scalar>>, Eigen::Lower> llt(a11);
      if (llt.info() == Eigen::Success) {
        const double smallest = a11.diagonal().minCoeff();
        ok = smallest * smallest > tiny && a11.diagonal().allFinite();
      }
    }
    if (!ok) {
      a11 = saved;
      for (Index j = 0; j < kb; ++j) {
        const Scalar ajj = a11(j, j) - a11.row(j).head(j).squaredNorm();
        if (!(ajj > tiny)) {
          if (bad_pivot != nullptr) *bad_pivot = ajj;
          return k + j;
        }
        const Scalar ljj = std::sqrt(ajj);
        a11(j, j) = ljj;
        const Index below = kb - j - 1;
        if (below > 0) {
          if (j > 0) {
            a11.col(j).tail(below).noalias() -=
                a11.bottomLeftCorner(below, j) * a11.row(j).head(j).transpose();
          }
          a11.col(j).tail(below) /= ljj;
        }
      }
      // The unblocked pass found every pivot above the threshold after all.
    }
    // The pivots are final once their diagonal block is factored: the ratio over all of
    // them can only grow from here.
    largest = std::max(largest, static_cast<double>(a11.diagonal().maxCoeff()));
    smallest = std::min(smallest, static_cast<double>(a11.diagonal().minCoeff()));
    if (largest > max_pivot_ratio * smallest) return kPivotRatioExceeded;
    const Index rest = d - k - kb;
    if (rest == 0) break;
    const Index n_row_blocks = (rest + kPanelRowBlock - 1) / kPanelRowBlock;
    const Index n_col_blocks = (rest + kFactorBlock - 1) / kFactorBlock;
    LMDX_PRAGMA(omp parallel num_threads(threads)) {
      // Panel: A21 <- A21 L11^{-T}.
      LMDX_PRAGMA(omp for schedule(dynamic, 1))
      for (Index rb = 0; rb < n_row_blocks; ++rb) {
        const Index r0 = k + kb + rb * kPanelRowBlock;
        const Index rows = std::min(kPanelRowBlock, d - r0);
        auto a21 = m.block(r0, k, rows, kb);
        m.block(k, k, kb, kb)
            .template triangularView<Eigen::Lower>()
            .transpose()
            .template solveInPlace<Eigen::OnTheRight>(a21);
      }
      // Trailing update of the lower triangle: A22 -= A21 A21^T, one column block a task.
      LMDX_PRAGMA(omp for schedule(dynamic, 1))
      for (Index cb = 0; cb < n_col_blocks; ++cb) {
        const Index j0 = k + kb + cb * kFactorBlock;
        const Index w = std::min(kFactorBlock, d - j0);
        m.block(j0, j0, d - j0, w).noalias() -=
            m.block(j0, k, d - j0, kb) * m.block(j0, k, w, kb).transpose();
      }
    }
  }
  return -1;
}

}  // namespace

Index blocked_cholesky(Eigen::Ref<MatrixXd> m, double scale, int n_threads, double* bad_pivot,
                       double max_pivot_ratio) {
  return blocked_cholesky_impl<double>(m, kSingularPivot * scale, n_threads, bad_pivot,
                                       max_pivot_ratio);
}

Index blocked_cholesky(Eigen::Ref<Eigen::MatrixXf> m, double scale, int n_threads,
                       double* bad_pivot, double max_pivot_ratio) {
  return blocked_cholesky_impl<float>(m, kSingularPivot32 * scale, n_threads, bad_pivot,
                                      max_pivot_ratio);
}

Index column_block_width(Index k) {
  if (k < 1) return 1;
  Index blocks = (k + 511) / 512;
  blocks = k >= 512 ? (blocks + 3) / 4 * 4 : (k + 127) / 128;
  const Index width = ((k + blocks - 1) / blocks + 15) / 16 * 16;
  return std::min(width, k);
}

SolveInfo spd_factor(const Eigen::Ref<const MatrixXd>& a, MatrixXd& l, const SolveOptions& opt) {
  resolve_threads(opt.n_threads);
  const Index d = a.rows();
  if (a.cols() != d) {
    throw std::invalid_argument(opt.name + ": matrix must be square, got " +
                                std::to_string(a.rows()) + " x " + std::to_string(a.cols()));
  }
  if (!(opt.alpha >= 0.0 && opt.alpha <= 1.0)) {
    throw std::invalid_argument("alpha: must be in [0, 1], got " + format_double(opt.alpha));
  }
  if (!(opt.ridge >= 0.0) || !std::isfinite(opt.ridge)) {
    throw std::invalid_argument("ridge: must be finite and >= 0, got " + format_double(opt.ridge));
  }
  SolveInfo info;
  info.mean_diagonal = a.diagonal().mean();
  if (!(info.mean_diagonal > 0.0) || !std::isfinite(info.mean_diagonal)) {
    throw NotPositiveDefiniteError(
        opt.name + ": the mean diagonal is " + format_double(info.mean_diagonal) +
        ", so the matrix is zero or not a Gram/covariance matrix; check that the statistics "
        "were collected from data that reached this layer");
  }
  double ridge = opt.ridge;
  l.resize(d, d);
  prefer_huge_pages(l);
  while (true) {
    ++info.attempts;
    l.triangularView<Eigen::Lower>() = a;
    reduce_lower_triangle(l, opt.alpha);
    l.diagonal().array() += ridge * info.mean_diagonal;
    double bad_pivot = 0.0;
    const Index bad = blocked_cholesky(l, info.mean_diagonal, opt.n_threads, &bad_pivot);
    if (bad < 0) break;
    const std::string why = "pivot " + std::to_string(bad) + " of " + std::to_string(d) + " is " +
                            format_double(bad_pivot) + " (needs > " +
                            format_double(kSingularPivot) + " x mean diagonal " +
                            format_double(info.mean_diagonal) + ") with relative ridge " +
                            format_double(ridge);
    if (!opt.allow_regularization) {
      throw NotPositiveDefiniteError(
          opt.name + ": not numerically positive definite: " + why + ". Input feature " +
          std::to_string(bad) +
          " is (nearly) never active or linearly dependent on others; allow regularization or "
          "pass a ridge > 0");
    }
    const double next = ridge < 1e-10 ? 1e-10 : ridge * 10.0;
    if (next > 1.0) {
      throw NotPositiveDefiniteError(opt.name + ": still not positive definite after " +
                                     std::to_string(info.attempts) + " attempts: " + why +
                                     ". The matrix is indefinite; it is not a valid Gram matrix");
    }
    ridge = next;
    info.escalated = true;
  }
  info.ridge = ridge;
  info.ridge_absolute = ridge * info.mean_diagonal;
  const auto diag = l.diagonal();
  info.min_pivot = diag.minCoeff();
  info.max_pivot = diag.maxCoeff();
  const double ratio = info.min_pivot / info.max_pivot;
  info.rcond_estimate = ratio * ratio;
  return info;
}

namespace {

template <typename Scalar>
double inverse_norm1_estimate_impl(const Matrix<Scalar>& l) {
  using Vector = Eigen::Matrix<Scalar, Eigen::Dynamic, 1>;
  const Index d = l.rows();
  const auto lower = l.template triangularView<Eigen::Lower>();
  const auto solve = [&](Vector& v) {  // v <- A^{-1} v (A^{-1} is symmetric)
    lower.solveInPlace(v);
    lower.transpose().solveInPlace(v);
  };
  Vector x = Vector::Constant(d, Scalar(1) / static_cast<Scalar>(d));
  double estimate = 0.0;
  Index last = -1;
  for (int iteration = 0; iteration < 5; ++iteration) {
    Vector y = x;
    solve(y);
    estimate = std::max(estimate, static_cast<double>(y.template lpNorm<1>()));
    Vector z = y.unaryExpr([](Scalar v) { return v >= Scalar(0) ? Scalar(1) : Scalar(-1); });
    solve(z);
    Index j = 0;
    const Scalar zmax = z.cwiseAbs().maxCoeff(&j);
    if (zmax <= z.dot(x) || j == last) break;
    x.setZero();
    x(j) = Scalar(1);
    last = j;
  }
  return estimate;
}

}  // namespace

double inverse_norm1_estimate(const MatrixXd& l) { return inverse_norm1_estimate_impl(l); }
double inverse_norm1_estimate(const Eigen::MatrixXf& l) { return inverse_norm1_estimate_impl(l); }

namespace {

// Rows of the diagonal blocks of blocked_solve solved at a time: Eigen's triangular solve
// of a whole 256-row block ran at half the GEMM's speed, a third of a 768-input solve's
// flops (RegMean's float32 solve of a 768 -> 3072 system, bench_regmean_merge.py
// --profile on Zen 4: 0.033 -> 0.025 s).
constexpr Index kSolveInnerBlock = 16;

template <typename Scalar>
using BlockRef = Eigen::Ref<Matrix<Scalar>, 0, Eigen::OuterStride<>>;
template <typename Scalar>
using ConstBlockRef = Eigen::Ref<const Matrix<Scalar>, 0, Eigen::OuterStride<>>;

// L y = b (forward) or L^T x = b (backward) in place by blocks of `block` rows: the diagonal
// block solved (by blocks of kSolveInnerBlock where larger), then a GEMM update of the
// rows below (forward) or above (backward), so nearly all the flops run at GEMM speed.
template <typename Scalar>
void blocked_triangular(ConstBlockRef<Scalar> l, BlockRef<Scalar> b, Index block, bool forward) {
  const Index d = l.rows();
  const Index n_blocks = (d + block - 1) / block;
  for (Index n = 0; n < n_blocks; ++n) {
    const Index i0 = (forward ? n : n_blocks - 1 - n) * block;
    const Index ib = std::min(block, d - i0);
    auto bi = b.middleRows(i0, ib);
    const auto lii = l.block(i0, i0, ib, ib);
    if (ib > kSolveInnerBlock) {
      blocked_triangular<Scalar>(lii, bi, kSolveInnerBlock, forward);
    } else if (forward) {
      lii.template triangularView<Eigen::Lower>().solveInPlace(bi);
    } else {
      lii.transpose().template triangularView<Eigen::Upper>().solveInPlace(bi);
    }
    const Index rest = d - i0 - ib;
    if (forward && rest > 0) b.bottomRows(rest).noalias() -= l.block(i0 + ib, i0, rest, ib) * bi;
    if (!forward && i0 > 0) b.topRows(i0).noalias() -= l.block(i0, 0, ib, i0).transpose() * bi;
  }
}

// L L^T X = B for one block of right-hand-side columns, by blocks of kFactorBlock rows:
// forward L y = b, then L^T x = y.
template <typename Scalar>
void blocked_solve(const Matrix<Scalar>& l, Eigen::Ref<Matrix<Scalar>> b) {
  blocked_triangular<Scalar>(l, b, kFactorBlock, true);
  blocked_triangular<Scalar>(l, b, kFactorBlock, false);
}

// The same system with the right-hand sides as rows: Z L L^T = B^T for a block of rows of
// Z = X^T (A is symmetric, so X^T A = B^T). Column blocks of Z: first W L^T = B^T
// (forward), then Z L = W (backward).
void blocked_solve_transposed(const MatrixXd& l, Eigen::Ref<MatrixXd> z) {
  const Index d = l.rows();
  for (Index j0 = 0; j0 < d; j0 += kFactorBlock) {
    const Index jb = std::min(kFactorBlock, d - j0);
    auto zj = z.middleCols(j0, jb);
    l.block(j0, j0, jb, jb)
        .triangularView<Eigen::Lower>()
        .transpose()
        .solveInPlace<Eigen::OnTheRight>(zj);
    const Index rest = d - j0 - jb;
    if (rest > 0) {
      z.rightCols(rest).noalias() -= zj * l.block(j0 + jb, j0, rest, jb).transpose();
    }
  }
  const Index last = (d - 1) / kFactorBlock * kFactorBlock;
  for (Index j0 = last; j0 >= 0; j0 -= kFactorBlock) {
    const Index jb = std::min(kFactorBlock, d - j0);
    auto zj = z.middleCols(j0, jb);
    l.block(j0, j0, jb, jb).triangularView<Eigen::Lower>().solveInPlace<Eigen::OnTheRight>(zj);
    if (j0 > 0) z.leftCols(j0).noalias() -= zj * l.block(j0, 0, jb, j0);
  }
}

}  // namespace

namespace {

// Right-hand sides solved together by solve_few_columns: 16 lanes (one AVX-512 vector of
// float, two of double) per row of a row-major copy.
constexpr Index kFewLanes = 16;
// Up to this many right-hand sides go through solve_few_columns (in slices of kFewLanes):
// a GEMM over so few columns spends its time packing L, and the column blocks of
// over_rhs_blocks would leave threads idle.
constexpr Index kFewColumns = 32;
// Rows of L per diagonal block of solve_few_columns (solved on one thread), and rows per
// task of its updates.
constexpr Index kFewBlock = 64;
constexpr Index kFewRows = 8;

template <typename Scalar>
using FewRows = Eigen::Matrix<Scalar, Eigen::Dynamic, kFewLanes, Eigen::RowMajor>;

// One sweep of solve_few_columns in x's rows (called by every thread of a parallel region:
// orphaned omp constructs): L y = x forward, or L^T y = x backward. By diagonal blocks of
// kFewBlock in the sweep's order: the block's rows solved on one thread, then the rows after
// it (below forward, above backward) updated by all threads, kFewRows rows a task. T(r, j)
// is L(r, j) forward and L(j, r) backward; each row's updates come in the same order
// whatever the thread count (determinism).
template <typename Scalar, bool Forward>
void few_columns_sweep(const Matrix<Scalar>& l, FewRows<Scalar>& x) {
  using Lanes = Eigen::Matrix<Scalar, kFewLanes, 1>;
  const auto row = [&x](Index r) { return Eigen::Map<Lanes>(x.row(r).data()); };
  const auto t = [&l](Index r, Index j) { return Forward ? l(r, j) : l(j, r); };
  const Index d = l.rows();
  const Index n_blocks = (d + kFewBlock - 1) / kFewBlock;
  for (Index n = 0; n < n_blocks; ++n) {
    const Index i0 = (Forward ? n : n_blocks - 1 - n) * kFewBlock;
    const Index ib = std::min(kFewBlock, d - i0);
    LMDX_PRAGMA(omp single) {
      for (Index s = 0; s < ib; ++s) {
        const Index r = Forward ? i0 + s : i0 + ib - 1 - s;
        Lanes acc = row(r);
        for (Index j = Forward ? i0 : r + 1; j < (Forward ? r : i0 + ib); ++j) {
          acc -= t(r, j) * row(j);
        }
        row(r) = acc / l(r, r);
      }
    }  // (barrier: the block is solved)
    const Index first = Forward ? i0 + ib : 0, end = Forward ? d : i0;
    const Index n_tasks = (end - first + kFewRows - 1) / kFewRows;
    LMDX_PRAGMA(omp for schedule(static))
    for (Index task = 0; task < n_tasks; ++task) {
      const Index r0 = first + task * kFewRows, h = std::min(kFewRows, end - r0);
      Lanes acc[kFewRows];
      for (Index q = 0; q < h; ++q) acc[q] = row(r0 + q);
      for (Index j = i0; j < i0 + ib; ++j) {
        const Lanes xj = row(j);
        for (Index q = 0; q < h; ++q) acc[q] -= t(r0 + q, j) * xj;
      }
      for (Index q = 0; q < h; ++q) row(r0 + q) = acc[q];
    }  // (barrier)
  }
}

// L L^T X = B for b.cols() <= kFewColumns: the right-hand sides copied row by row into
// kFewLanes-wide rows (padded with zeros), then the forward and the backward sweep across
// the threads. L is read once per direction, by every thread in streams of its columns.
template <typename Scalar>
void solve_few_columns(const Matrix<Scalar>& l, Eigen::Ref<Matrix<Scalar>> b, int n_threads) {
  const Index d = l.rows(), k = b.cols();
  const int threads =
      static_cast<int>(std::min<Index>(resolve_threads(n_threads), (d + kFewRows - 1) / kFewRows));
  for (Index c0 = 0; c0 < k; c0 += kFewLanes) {
    const Index w = std::min(kFewLanes, k - c0);
    FewRows<Scalar> x = FewRows<Scalar>::Zero(d, kFewLanes);
    x.leftCols(w) = b.middleCols(c0, w);
    LMDX_PRAGMA(omp parallel num_threads(threads)) {
      few_columns_sweep<Scalar, true>(l, x);
      few_columns_sweep<Scalar, false>(l, x);
    }
    b.middleCols(c0, w) = x.leftCols(w);
  }
}

// solve(first, count) for each block of right-hand sides (of column_block_width(k)),
// the blocks shared by the threads.
template <typename Solve>
void over_rhs_blocks(Index k, int n_threads, const Solve& solve) {
  if (k == 0) return;
  const Index width = column_block_width(k);
  const Index n_blocks = (k + width - 1) / width;
  const int threads = static_cast<int>(std::min<Index>(resolve_threads(n_threads), n_blocks));
  LMDX_PRAGMA(omp parallel for num_threads(threads) schedule(dynamic, 1))
  for (Index cb = 0; cb < n_blocks; ++cb) solve(cb * width, std::min(width, k - cb * width));
}

}  // namespace

void cholesky_solve_transposed_in_place(const MatrixXd& l, Eigen::Ref<MatrixXd> bt,
                                        int n_threads) {
  over_rhs_blocks(bt.rows(), n_threads, [&](Index r0, Index rows) {
    blocked_solve_transposed(l, bt.middleRows(r0, rows));
  });
}

void cholesky_solve_in_place(const MatrixXd& l, Eigen::Ref<MatrixXd> b, int n_threads) {
  if (b.cols() <= kFewColumns) return solve_few_columns<double>(l, b, n_threads);
  over_rhs_blocks(b.cols(), n_threads, [&](Index c0, Index cols) {
    blocked_solve<double>(l, b.middleCols(c0, cols));
  });
}

void cholesky_solve_in_place(const Eigen::MatrixXf& l, Eigen::Ref<Eigen::MatrixXf> b,
                             int n_threads) {
  if (b.cols() <= kFewColumns) return solve_few_columns<float>(l, b, n_threads);
  over_rhs_blocks(b.cols(), n_threads, [&](Index c0, Index cols) {
    blocked_solve<float>(l, b.middleCols(c0, cols));
  });
}

SolveInfo spd_solve(const ArrayView& a, const ArrayView& b, double* x, const SolveOptions& opt) {
  resolve_threads(opt.n_threads);
  if (a.shape.size() != 2 || a.shape[0] != a.shape[1] || a.shape[0] < 1) {
    throw std::invalid_argument("a: expected a square matrix, got a " + describe(a));
  }
  const Index d = a.shape[0];
  if (b.shape.empty() || b.shape.size() > 2 || b.shape[0] != d) {
    throw std::invalid_argument("b: expected " + std::to_string(d) + " rows to match a, got a " +
                                describe(b));
  }
  const Index k = b.shape.size() == 1 ? 1 : b.shape[1];
  require_finite(a, d, "a", opt.n_threads);
  require_finite(b, k, "b", opt.n_threads);
  require_symmetric(a.f64(), d, "a", opt.n_threads);
  // a is symmetric, so its row-major buffer read as column-major is the same matrix.
  const Eigen::Map<const MatrixXd> a_map(a.f64(), d, d);
  // b row-major (d x k) is b^T column-major (k x d): solved in x's buffer as x^T a = b^T.
  std::copy(b.f64(), b.f64() + d * k, x);
  Eigen::Map<MatrixXd> xt(x, k, d);
  return spd_solve_transposed(a_map, xt, opt);
}

SolveInfo spd_solve(const Eigen::Ref<const MatrixXd>& a, Eigen::Ref<MatrixXd> b,
                    const SolveOptions& opt) {
  if (b.rows() != a.rows()) {
    throw std::invalid_argument("b: has " + std::to_string(b.rows()) + " rows but the matrix is " +
                                std::to_string(a.rows()) + " x " + std::to_string(a.cols()));
  }
  MatrixXd l;
  SolveInfo info = spd_factor(a, l, opt);
  cholesky_solve_in_place(l, b, opt.n_threads);
  return info;
}

SolveInfo spd_solve_transposed(const Eigen::Ref<const MatrixXd>& a, Eigen::Ref<MatrixXd> bt,
                               const SolveOptions& opt) {
  if (bt.cols() != a.rows()) {
    throw std::invalid_argument("b: has " + std::to_string(bt.cols()) +
                                " rows but the matrix is " + std::to_string(a.rows()) + " x " +
                                std::to_string(a.cols()));
  }
  MatrixXd l;
  SolveInfo info = spd_factor(a, l, opt);
  cholesky_solve_transposed_in_place(l, bt, opt.n_threads);
  return info;
}

LMDX_NAMESPACE_END

