// Regularized solves of symmetric positive-definite systems by Cholesky factorization.
//
// Given symmetric A (only the lower triangle is read) and right-hand sides B:
//   A_alpha = alpha * A + (1 - alpha) * diag(A)      (off-diagonal reduction, RegMean)
//   A_reg   = A_alpha + ridge * mean(diag(A)) * I    (ridge relative to the mean diagonal)
//   X       = A_reg^{-1} B                           (Cholesky, float64, no inverse)
// If A_reg is not numerically positive definite and regularization is allowed, the
// relative ridge is escalated (x10 from 1e-10) until the factorization succeeds.
#pragma once

#include <cmath>
#include <stdexcept>
#include <string>

#include "core/arrays.hpp"

LMDX_NAMESPACE_BEGIN

/// What the solver did; returned with every solution.
struct SolveInfo {
  double ridge = 0.0;           // relative ridge finally used (multiple of mean diagonal)
  double ridge_absolute = 0.0;  // ridge * mean(diag(A))
  double mean_diagonal = 0.0;   // mean(diag(A))
  int attempts = 0;             // factorizations tried
  bool escalated = false;       // whether the ridge was raised above the requested one
  double min_pivot = 0.0;       // smallest diagonal entry of the Cholesky factor L
  double max_pivot = 0.0;       // largest diagonal entry of L
  /// Cheap reciprocal condition estimate (min_pivot / max_pivot)^2: a rough upper bound
  /// on 1/cond_2(A_reg); small values mean the solution is sensitive to the data.
  double rcond_estimate = 0.0;
};

/// Thrown when the system cannot be factored (not positive definite and regularization
/// forbidden or exhausted). The native module raises it as its own NotPositiveDefiniteError
/// (a ValueError), which lmdx/spd.py re-raises as lmdx.NotPositiveDefiniteError.
class NotPositiveDefiniteError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct SolveOptions {
  double alpha = 1.0;  // RegMean's off-diagonal scale, in [0, 1]
  double ridge = 0.0;  // relative to the mean diagonal
  bool allow_regularization = true;
  int n_threads = 1;
  std::string name = "system";  // names the system in error messages (e.g. a layer)
};

/// Relative pivot threshold below which a factorization counts as numerically singular.
constexpr double kSingularPivot = 1e-13;
/// The same for a float32 factorization (about float32's unit roundoff): below it a pivot
/// holds no significant bits of the data.
constexpr double kSingularPivot32 = 1e-7;

/// Factor A_reg (built from `a`, which is read, lower triangle, and not modified) into L.
/// On success L holds the Cholesky factor in its lower triangle.
SolveInfo spd_factor(const Eigen::Ref<const MatrixXd>& a, MatrixXd& l, const SolveOptions& opt);

/// Width of the blocks k columns (or rows) are split into for the threads: the right-hand
/// sides of the solves, the rows of the RegMean right-hand side. From k = 512 on, a
/// multiple of 4 blocks of at most 512 (768 -> 4 x 192, 2304 -> 8 x 288, 3072 -> 8 x 384),
/// so 2 or 4 threads get equal shares (3 or 5 blocks left one of 2 threads idle for a
/// round); below, blocks of about 128. Wide blocks run the GEMMs faster (RegMean d_in =
/// 3072: 75 -> 88 GFLOP/s from 192 to 384 columns, bench/RESULTS.md). Rounded to 16 columns;
/// depends on k only, never on the thread count (determinism).
Index column_block_width(Index k);

/// Estimate of ||A^{-1}||_1 from the Cholesky factor L of A (Hager's method, as LAPACK's
/// condition estimators: a few solves with single vectors, O(d^2) each; usually within a
/// factor 3 of the true norm, never above it). ||A||_1 times this estimates cond_1(A).
double inverse_norm1_estimate(const MatrixXd& l);
double inverse_norm1_estimate(const Eigen::MatrixXf& l);

/// Solve L L^T X = B in place (B is d x k, column-major), threaded over column blocks; up to
/// 32 columns (probes, vectors) by rows across the threads instead, 16 columns at a time, so
/// that L is streamed once per direction rather than packed for a GEMM with few columns.
void cholesky_solve_in_place(const MatrixXd& l, Eigen::Ref<MatrixXd> b, int n_threads);
void cholesky_solve_in_place(const Eigen::MatrixXf& l, Eigen::Ref<Eigen::MatrixXf> b,
                             int n_threads);

/// The checked entry for row-major callers (the Python binding): `a` a float64 view of
/// shape (d, d), finite and symmetric; `b` a float64 view of shape (d,) or (d, k), finite;
/// `x` room for b.size() values, receives X in b's shape (row-major). Throws
/// std::invalid_argument naming the argument at fault.
SolveInfo spd_solve(const ArrayView& a, const ArrayView& b, double* x, const SolveOptions& opt);
/// X = A_reg^{-1} B. `b` is overwritten with X.
SolveInfo spd_solve(const Eigen::Ref<const MatrixXd>& a, Eigen::Ref<MatrixXd> b,
                    const SolveOptions& opt);
/// The same with the right-hand sides as rows: bt (k x d) holds B^T -- i.e. B (d x k)
/// stored row-major -- and is overwritten by X^T. Solved as X^T A = B^T (A is symmetric),
/// so row-major callers need no transposed copies.
SolveInfo spd_solve_transposed(const Eigen::Ref<const MatrixXd>& a, Eigen::Ref<MatrixXd> bt,
                               const SolveOptions& opt);
void cholesky_solve_transposed_in_place(const MatrixXd& l, Eigen::Ref<MatrixXd> bt, int n_threads);

/// What blocked_cholesky returns when it stopped because the pivots factored so far
/// already exceed max_pivot_ratio (largest / smallest).
constexpr Index kPivotRatioExceeded = -2;

/// Blocked, threaded in-place Cholesky of the lower triangle of m. Returns -1 on success,
/// else the index of the first pivot that is not positive (or below kSingularPivot
/// relative to `scale`; its value is stored in *bad_pivot), or kPivotRatioExceeded as soon
/// as the largest pivot of the diagonal blocks factored so far exceeds max_pivot_ratio
/// times their smallest (the ratio over all pivots can only be larger; m is then partly
/// factored). The block partition does not depend on n_threads.
Index blocked_cholesky(Eigen::Ref<MatrixXd> m, double scale, int n_threads,
                       double* bad_pivot = nullptr, double max_pivot_ratio = INFINITY);
/// The same in float32, with the threshold kSingularPivot32.
Index blocked_cholesky(Eigen::Ref<Eigen::MatrixXf> m, double scale, int n_threads,
                       double* bad_pivot = nullptr, double max_pivot_ratio = INFINITY);

LMDX_NAMESPACE_END
