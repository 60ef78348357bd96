#include "core/regmean.hpp"

#include <Eigen/Eigenvalues>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>

#include "core/checks.hpp"
#include "core/parallel.hpp"
#include "core/reduction.hpp"

LMDX_NAMESPACE_BEGIN

namespace {

// Output columns of the deviations (W_i - W-)^T widened to float64 at a time (bounds that
// buffer: d_in x 1024 doubles).
constexpr Index kRhsChunk = 1024;
// Multiply-adds below which a layer is merged on one thread: K = 3 models of a 128 x 128
// layer (8.4e6) stay below it, of a 256 x 256 layer (6.7e7) do not. Chosen, not tuned.
constexpr double kSerialWork = 2e7;
// Columns of W_i^T widened per task.
constexpr Index kWidenColumns = 64;
// Input dimensions up to which a layer solved in float64 gets a 1-norm condition estimate
// (beyond, its solves streaming the factor cost more than they tell).
constexpr Index kEstimateDim = 1024;
// Tiles of the mirrored (upper) triangle.
constexpr Index kTile = 64;
// Gaussian probe columns of the float32 certificate, and the factor its estimate is
// multiplied by. With P = 16 probes, ||E z||^2 summed over the probes is a sum of P
// chi-square draws weighted by the squared singular values of S^(1/2) E; the worst case is
// an error (and a merged weight) concentrated in one direction, where the ratio of the two
// sums is an F(16, 16) variable: it falls below 1/16 (the estimate times kCertificateMargin
// below the true error) with probability 6e-7. Spread errors (the usual float32 rounding)
// make it far more accurate. tests/core/test_regmean_precision.py checks the bound.
constexpr Index kProbes = 16;
constexpr double kCertificateMargin = 4.0;
// The probes' errors are solved with the float32 factor and refined once against the
// float64 system; a refinement that changes them by more than this fraction (in the
// system's norm) means the float32 factor is too inaccurate to certify anything.
constexpr double kMaxContraction = 0.5;
// A float64 system gets the eigendecomposition that finds the directions below the noise
// floor when its smallest squared pivot is within this factor of the floor (every
// eigenvalue is at most the smallest squared pivot, so above it none are below the floor).
constexpr double kNoiseFloorTrigger = 1e3;

enum class WeightLayout {
  Linear,  // torch nn.Linear: weight is [out, in]
  Conv1D,  // Hugging Face GPT-2 Conv1D: weight is [in, out]
};

template <typename T>
using RowMajor = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

// A Gram as the caller holds it: a full symmetric matrix, or its upper triangle packed row
// by row. Either way column j of the lower triangle (rows j..d-1) is contiguous.
struct GramSource {
  const double* data = nullptr;
  bool packed = false;
  Index d = 0;
  const double* lower_column(Index j) const {
    // Packed: row j of the upper triangle starts after rows 0..j-1 (d, d-1, ... values).
    // Full (row-major, symmetric): row j from column j on.
    return packed ? data + j * d - j * (j - 1) / 2 : data + j * d + j;
  }
  Index size() const { return packed ? d * (d + 1) / 2 : d * d; }
};

struct RegMeanModel {
  GramSource gram;
  double count = 0.0;  // n_i: rows (tokens) the Gram was accumulated over
  ArrayView weight;    // [out, in] (Linear) or [in, out] (Conv1D), row-major
};

// Columns [c0, c0 + w) of W^T (d_in x d_out), widened to float64 into `out`.
template <typename T>
void widen_columns(const T* data, Index d_in, Index d_out, WeightLayout layout, Index c0, Index w,
                   Eigen::Ref<MatrixXd> out) {
  if (layout == WeightLayout::Linear) {
    const Eigen::Map<const MatrixX<T>> wt(data, d_in, d_out);  // [out, in] row-major = W^T
    out = wt.middleCols(c0, w).template cast<double>();
  } else {
    const Eigen::Map<const RowMajor<T>> wt(data, d_in, d_out);  // [in, out] row-major
    out = wt.middleCols(c0, w).template cast<double>();
  }
}

void widen_columns(const ArrayView& weight, Index d_in, Index d_out, WeightLayout layout, Index c0,
                   Index w, Eigen::Ref<MatrixXd> out) {
  if (weight.is_float32) {
    widen_columns(weight.f32(), d_in, d_out, layout, c0, w, out);
  } else {
    widen_columns(weight.f64(), d_in, d_out, layout, c0, w, out);
  }
}

WeightLayout parse_layout(const std::string& layout, const std::string& name) {
  if (layout == "linear") return WeightLayout::Linear;
  if (layout == "conv1d") return WeightLayout::Conv1D;
  throw std::invalid_argument(name +
                              ": layout: expected 'linear' ([out, in], torch nn.Linear) or "
                              "'conv1d' ([in, out], Hugging Face Conv1D), got '" +
                              layout + "'");
}

enum class Precision { Auto, Float32, Float64 };

Precision parse_precision(const std::string& precision, const std::string& name) {
  if (precision == "auto") return Precision::Auto;
  if (precision == "float32") return Precision::Float32;
  if (precision == "float64") return Precision::Float64;
  throw std::invalid_argument(name + ": precision: expected 'auto', 'float32' or 'float64', got '" +
                              precision + "'");
}

// y += a x and y = a x - b z, fused element by element: the same bits wherever x and z lie
// in memory (Eigen's vectorized expressions fuse only the part of a column that is
// aligned, so their results would depend on the inputs' addresses).
void axpy(double a, const double* x, double* y, Index n) {
  for (Index r = 0; r < n; ++r) y[r] = std::fma(a, x[r], y[r]);
}
void axmbz(double a, const double* x, double b, const double* z, double* y, Index n) {
  for (Index r = 0; r < n; ++r) y[r] = std::fma(-b, z[r], a * x[r]);
}

// Copy the strict lower triangle of the square m onto its upper one, by tiles.
void mirror_lower(MatrixXd& m, int threads) {
  const Index d = m.rows();
  const Index n_tiles = (d + kTile - 1) / kTile;
  LMDX_PRAGMA(omp parallel for num_threads(threads) schedule(dynamic, 1))
  for (Index t = 0; t < n_tiles; ++t) {
    const Index j0 = t * kTile;
    const Index w = std::min(kTile, d - j0);
    for (Index c = j0; c < j0 + w; ++c) {  // the diagonal tile
      for (Index r = c + 1; r < j0 + w; ++r) m(c, r) = m(r, c);
    }
    for (Index i0 = j0 + w; i0 < d; i0 += kTile) {
      const Index h = std::min(kTile, d - i0);
      m.block(j0, i0, w, h) = m.block(i0, j0, h, w).transpose();
    }
  }
}

// D_i = c_i (G~_i - G~_p) (full, symmetric) into d, from the raw Grams as
// s_i G_i - (c_i / n_p) G_p with the off-diagonal scaled by alpha.
void form_difference(const std::vector<RegMeanModel>& models, const std::vector<double>& s,
                     const std::vector<double>& coef, size_t i, size_t pivot, double alpha,
                     int threads, MatrixXd& d) {
  const Index n = d.rows();
  const double t = coef[i] / models[pivot].count;
  LMDX_PRAGMA(omp parallel for num_threads(threads) schedule(dynamic, 16))
  for (Index j = 0; j < n; ++j) {
    auto col = d.col(j).tail(n - j);
    axmbz(s[i], models[i].gram.lower_column(j), t, models[pivot].gram.lower_column(j),
          col.data(), n - j);
    reduce_off_diagonal(col, j, j, alpha);
  }
  mirror_lower(d, threads);
}

// Columns [c0, c0 + w) of (W_i - W-)^T into delta's first w columns. Called by every thread
// of a parallel region (an orphaned omp for: the deviations are complete after it).
void widen_deviations(const ArrayView& weight, const MatrixXd& mean_t, WeightLayout layout,
                      Index c0, Index w, MatrixXd& delta) {
  const Index d_in = mean_t.rows(), d_out = mean_t.cols();
  LMDX_PRAGMA(omp for schedule(static))
  for (Index s0 = 0; s0 < w; s0 += kWidenColumns) {
    const Index sw = std::min(kWidenColumns, w - s0);
    auto part = delta.middleCols(s0, sw);
    widen_columns(weight, d_in, d_out, layout, c0 + s0, sw, part);
    part -= mean_t.middleCols(c0 + s0, sw);
  }
}

// The deviations (W_i - W-)^T of one model, kRhsChunk output columns at a time widened into
// delta (d_in x chunk), and for each chunk: prepare(w) (called by every thread of the
// chunk's parallel region: an orphaned omp for, or nothing), then block(c0, w, r0, h) for
// every fixed block of rows [r0, r0 + h) across the threads. The partition depends on the
// shapes only, so results do not depend on the thread count.
template <typename Prepare, typename Block>
void for_each_deviation_block(const ArrayView& weight, const MatrixXd& mean_t,
                              WeightLayout layout, int threads, MatrixXd& delta,
                              const Prepare& prepare, const Block& block) {
  const Index d_in = mean_t.rows(), d_out = mean_t.cols();
  const Index row_block = column_block_width(d_in);
  const Index n_row_blocks = (d_in + row_block - 1) / row_block;
  const Index chunk = delta.cols();
  for (Index c0 = 0; c0 < d_out; c0 += chunk) {
    const Index w = std::min(chunk, d_out - c0);
    LMDX_PRAGMA(omp parallel num_threads(threads)) {
      widen_deviations(weight, mean_t, layout, c0, w, delta);
      // (barrier at the end of its omp for: the deviations are complete)
      prepare(w);
      LMDX_PRAGMA(omp for schedule(dynamic, 1))
      for (Index rb = 0; rb < n_row_blocks; ++rb) {
        const Index r0 = rb * row_block;
        block(c0, w, r0, std::min(row_block, d_in - r0));
      }
    }
  }
}

// out = a v (or out += a v), a with d rows, by fixed blocks of rows across the threads.
void multiply_rows(const MatrixXd& a, const MatrixXd& v, MatrixXd& out, bool accumulate,
                   int threads) {
  const Index d = a.rows();
  const Index row_block = column_block_width(d);
  const Index n_blocks = (d + row_block - 1) / row_block;
  if (!accumulate) out.setZero(d, v.cols());
  LMDX_PRAGMA(omp parallel for num_threads(threads) schedule(dynamic, 1))
  for (Index b = 0; b < n_blocks; ++b) {
    const Index r0 = b * row_block;
    const Index h = std::min(row_block, d - r0);
    out.middleRows(r0, h).noalias() += a.middleRows(r0, h) * v;
  }
}

// Standard normal rows x cols from a fixed seed (splitmix64 and Box-Muller): the same
// probes on every run and every platform.
MatrixXd gaussian_probes(Index rows, Index cols) {
  MatrixXd z(rows, cols);
  uint64_t state = 0x6C6D6478ull;  // fixed
  const auto next = [&state] {
    uint64_t x = (state += 0x9E3779B97F4A7C15ull);
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
  };
  const auto uniform = [&next] {  // in (0, 1)
    return (static_cast<double>(next() >> 11) + 0.5) * 0x1.0p-53;
  };
  constexpr double kTwoPi = 6.283185307179586;
  double* data = z.data();
  for (Index i = 0; i < z.size(); i += 2) {
    const double r = std::sqrt(-2.0 * std::log(uniform()));
    const double angle = kTwoPi * uniform();
    data[i] = r * std::cos(angle);
    if (i + 1 < z.size()) data[i + 1] = r * std::sin(angle);
  }
  return z;
}

// ||M||_1 of the symmetric d x d matrix whose lower triangle column j (rows j..d-1) is
// column(j, buffer) (a pointer to d - j values, possibly written into `buffer`, d values of
// the calling thread), off-diagonal scaled by alpha, plus `shift` on the diagonal. Blocks of
// kTile columns sum into their own vectors, added in block order: the result does not
// depend on the thread count.
template <typename Column>
double symmetric_norm1(Index d, double alpha, double shift, int threads, const Column& column) {
  const Index n_blocks = (d + kTile - 1) / kTile;
  MatrixXd sums = MatrixXd::Zero(d, n_blocks);
  LMDX_PRAGMA(omp parallel num_threads(threads)) {
    VectorXd buffer(d);
    LMDX_PRAGMA(omp for schedule(dynamic, 1))
    for (Index block = 0; block < n_blocks; ++block) {
      double* block_sums = sums.col(block).data();
      for (Index j = block * kTile; j < std::min(d, block * kTile + kTile); ++j) {
        const double* c = column(j, buffer.data());
        const Eigen::Map<const VectorXd> below(c + 1, d - j - 1);
        block_sums[j] += std::abs(c[0] + shift) + alpha * below.cwiseAbs().sum();
        for (Index r = 1; r < d - j; ++r) block_sums[j + r] += alpha * std::abs(c[r]);
      }
    }
  }
  return sums.rowwise().sum().maxCoeff();
}

// x <- the solution of system x = x (system's lower triangle) restricted to the
// eigendirections with eigenvalue > floor + sqrt(d) x 2^-52 x the largest eigenvalue (the
// statistics' noise floor and the eigendecomposition's own rounding); the others get no
// component (they keep the average). Reports the count of those directions and the
// system's 2-norm condition over the kept ones.
void spectral_solve(const MatrixXd& system, double floor, const std::string& name, MatrixXd& x,
                    RegMeanInfo& info) {
  const Eigen::SelfAdjointEigenSolver<MatrixXd> eigen(system, Eigen::ComputeEigenvectors);
  if (eigen.info() != Eigen::Success) {
    throw std::runtime_error(name + ": the eigendecomposition of the system did not converge");
  }
  const VectorXd& values = eigen.eigenvalues();  // ascending
  const double largest = values.size() > 0 ? std::max(values(values.size() - 1), 0.0) : 0.0;
  const double threshold = floor + std::sqrt(static_cast<double>(values.size())) *
                                       std::numeric_limits<double>::epsilon() * largest;
  Index unseen = 0;
  while (unseen < values.size() && !(values(unseen) > threshold)) ++unseen;
  const Index kept = values.size() - unseen;
  const auto vectors = eigen.eigenvectors().rightCols(kept);
  MatrixXd projected = vectors.transpose() * x;
  projected = values.tail(kept).cwiseInverse().asDiagonal() * projected;
  x.noalias() = vectors * projected;
  info.unseen_directions = static_cast<int>(unseen);
  info.condition_estimate = kept > 0 ? values(values.size() - 1) / values(unseen) : 0.0;
}

// Elapsed time per phase of one layer's merge, added into info.timings (seconds; a phase
// entered twice accumulates).
class PhaseClock {
 public:
  explicit PhaseClock(RegMeanInfo& info) : info_(info), last_(Clock::now()) {}
  void lap(const char* phase) {
    const Clock::time_point now = Clock::now();
    const double seconds = std::chrono::duration<double>(now - last_).count();
    last_ = now;
    for (auto& entry : info_.timings) {
      if (entry.first == phase) {
        entry.second += seconds;
        return;
      }
    }
    info_.timings.emplace_back(phase, seconds);
  }
  void restart() { last_ = Clock::now(); }

 private:
  using Clock = std::chrono::steady_clock;
  RegMeanInfo& info_;
  Clock::time_point last_;
};

// Rows [r0, r0 + h) of the symmetric d x d matrix sa A - sb B (B optional: sb = 0 or b
// null), off-diagonal reduced by alpha, into the first h rows of t (column-major, at least
// h x d), from Grams that each hold one triangle: the columns left of the rows come from
// the columns of the lower triangle (contiguous), the rest from the rows' own lower columns.
void reduced_rows(const GramSource& a, double sa, const GramSource* b, double sb, double alpha,
                  Index r0, Index h, MatrixXd& t) {
  const Index d = a.d, stride = t.rows();
  const bool two = b != nullptr && sb != 0.0;
  // n values sa a[j][offset..] - sb b[j][offset..] (column j of the lower triangles) into
  // out, step apart.
  const auto combine = [&](Index j, Index offset, double* out, Index n, Index step) {
    const double* x = a.lower_column(j) + offset;
    if (two) {
      const double* z = b->lower_column(j) + offset;
      for (Index r = 0; r < n; ++r) out[r * step] = std::fma(-sb, z[r], sa * x[r]);
    } else {
      for (Index r = 0; r < n; ++r) out[r * step] = sa * x[r];
    }
  };
  for (Index c = 0; c < r0; ++c) combine(c, r0 - c, &t(0, c), h, 1);  // G[r, c] = G[c, r]
  for (Index k = 0; k < h; ++k) {  // G[r, c], c >= r: the row's own lower column
    const Index r = r0 + k;
    combine(r, 0, &t(k, r), d - r, stride);
    for (Index c = r0; c < r; ++c) t(k, c) = t(c - r0, r);  // the diagonal block, mirrored
  }
  reduce_off_diagonal(t.topRows(h), r0, 0, alpha);
}

// Rows [r0, r0 + h) of D_i = c_i (G~_i - G~_p) = s_i G~_i - (c_i / n_p) G~_p.
void difference_rows(const std::vector<RegMeanModel>& models, const std::vector<double>& s,
                     const std::vector<double>& coef, size_t i, size_t pivot, double alpha,
                     Index r0, Index h, MatrixXd& t) {
  reduced_rows(models[i].gram, s[i], &models[pivot].gram, coef[i] / models[pivot].count, alpha,
               r0, h, t);
}

// The lower triangle of sum_i s_i G_i into lhs (d x d), one column a task.
void sum_lower(const std::vector<GramSource>& grams, const std::vector<double>& s, int threads,
               MatrixXd& lhs) {
  const Index d = lhs.rows();
  LMDX_PRAGMA(omp parallel for num_threads(threads) schedule(dynamic, 16))
  for (Index j = 0; j < d; ++j) {
    auto col = lhs.col(j).tail(d - j);
    col.setZero();
    for (size_t i = 0; i < grams.size(); ++i) {
      if (s[i] != 0.0) axpy(s[i], grams[i].lower_column(j), col.data(), d - j);
    }
  }
}

// The merge of one layer in float32 -- factorization, the K - 1 right-hand-side products
// and the solve -- and the certificate of its output error against the float64 formula:
// with X = W_M^T - W-^T from float32 and E = X - X_64 (X_64 = A^{-1} B in float64, A the
// system, B the right-hand side), A E z = A X z - B z = -r for any probe z, where the
// residual r is computed in float64 from products with the Gram differences and the system.
// With x = A_32^{-1} B z (the pre-check's solve), E z = (X z - x) + A^{-1} (A x - B z): the
// first part is exact, the second is solved with the float32 factor and refined once in
// float64. ||E z||_A^2 over Gaussian probes estimates ||E||_A^2 >= ||E||_S^2
// (S = A - ridge I), and ||W_M z||_S^2 the merged weight's ||W_M||_S^2.
// O((K + 4) d_in^2 kProbes) float64 work and three float32 solves with kProbes columns.
//
// Each Gram difference D_i and deviation (W_i - W-)^T is formed once: in float64 for the
// probes' right-hand side B z, and rounded to float32 side by side (D = [D_1 .. D_{K-1}],
// dev = [dev_1; ..; dev_{K-1}]) for the one product D dev after the factor's pre-check.
struct Float32Merge {
  const std::vector<RegMeanModel>& models;
  const std::vector<double>& coef;
  const std::vector<double>& s;
  size_t pivot;
  const std::vector<size_t>& others;
  Index d_in, d_out;
  WeightLayout layout;
  const MatrixXd& mean_t;
  MatrixXd& lhs;  // sum_i s_i G_i, lower triangle; run() mirrors it onto the upper one
  double noise_floor;  // relative, as regmean_merge_layer's
  // Set by the pre-check (factor_error_estimate): on the probes, W-^T z, A W-^T z, x (B z
  // solved with the float32 factor), A x, res = A x - B z, e (res solved with it), A e, and
  // ||e||_A^2.
  MatrixXd mean_z, a_mean_z, x_probe, a_x, res, e_probe, a_e;
  double e_norm2 = 0.0;

  // A v, A = alpha lhs + (1 - alpha) diag(lhs) + ridge I (lhs mirrored).
  MatrixXd system_times(const MatrixXd& v, double alpha, double ridge, int threads) const {
    MatrixXd out;
    multiply_rows(lhs, v, out, false, threads);
    finish_reduced_product(lhs.diagonal(), v, alpha, ridge, out);
    return out;
  }

  // A_32^{-1} r with the float32 factor, r scaled into float32's range first.
  static MatrixXd solve32(const Eigen::MatrixXf& l32, const MatrixXd& r, int threads) {
    const double scale = r.cwiseAbs().maxCoeff();
    if (!(scale > 0.0)) return MatrixXd::Zero(r.rows(), r.cols());
    Eigen::MatrixXf x = (r / scale).cast<float>();
    cholesky_solve_in_place(l32, x, threads);
    return x.cast<double>() * scale;
  }

  // ||u||_S^2 summed over the columns, from u and A u.
  static double s_norm2(const MatrixXd& u, const MatrixXd& au, double ridge) {
    return u.cwiseProduct(au).sum() - ridge * u.squaredNorm();
  }

  // The pre-check: the certificate's estimate for the float32 factor's error alone. The
  // probes' right-hand side B z solved with it (x), checked against the float64 system
  // (res = A x - B z, e = its solve with the float32 factor: x - X_64 z ~ e), relative to
  // ||W_M z||_S with W_M z ~ W- z + x. The products' own rounding comes on top, so a layer
  // above the tolerance here cannot be certified. Keeps x, A x, res, e, A e, W-^T z and
  // A W-^T z for the final certificate.
  double factor_error_estimate(const Eigen::MatrixXf& l32, const MatrixXd& bz, const MatrixXd& z,
                               double alpha, double ridge, int threads) {
    x_probe = solve32(l32, bz, threads);
    multiply_rows(mean_t, z, mean_z, false, threads);
    MatrixXd v(d_in, 2 * kProbes);
    v.leftCols(kProbes) = x_probe;
    v.rightCols(kProbes) = mean_z;
    const MatrixXd av = system_times(v, alpha, ridge, threads);
    a_x = av.leftCols(kProbes);
    a_mean_z = av.rightCols(kProbes);
    const double merged_norm2 = s_norm2(mean_z + x_probe, a_mean_z + a_x, ridge);
    res = a_x - bz;
    e_probe = solve32(l32, res, threads);
    a_e = system_times(e_probe, alpha, ridge, threads);
    e_norm2 = std::max(e_probe.cwiseProduct(a_e).sum(), 0.0);
    if (!(e_norm2 > 0.0)) return 0.0;
    return merged_norm2 > 0.0 ? kCertificateMargin * std::sqrt(e_norm2 / merged_norm2)
                              : std::numeric_limits<double>::max();
  }

  // Merge into merged_t and fill info (precision "float32", output_error_estimate). Returns
  // false, leaving lhs's lower triangle as it was, when the float32 factorization fails or
  // (unless forced) the certificate exceeds kOutputErrorTolerance.
  bool run(const SolveOptions& opt, bool forced, RegMeanInfo& info, MatrixXd& merged_t) {
    PhaseClock clock(info);
    const int threads = opt.n_threads;
    const double alpha = opt.alpha;
    const double mean_diagonal = lhs.diagonal().mean();
    if (!(opt.ridge >= 0.0) || !std::isfinite(opt.ridge) || !(mean_diagonal > 0.0) ||
        !std::isfinite(mean_diagonal)) {
      return false;  // the float64 path reports it
    }
    const double ridge = opt.ridge * mean_diagonal;
    Eigen::MatrixXf l32(d_in, d_in);
    LMDX_PRAGMA(omp parallel num_threads(threads)) {
      VectorXd column(d_in);
      LMDX_PRAGMA(omp for schedule(dynamic, 16))
      for (Index j = 0; j < d_in; ++j) {
        auto c = column.head(d_in - j);
        c = lhs.col(j).tail(d_in - j);
        reduce_off_diagonal(c, j, j, alpha);
        c(0) += ridge;
        l32.col(j).tail(d_in - j) = c.cast<float>();
      }
    }
    clock.lap("convert32");
    if (blocked_cholesky(l32, mean_diagonal, threads) >= 0) return false;
    clock.lap("factor32");
    // Directions near the noise floor: the float64 path decides which are unseen.
    const double smallest = l32.diagonal().minCoeff();
    const double floor = noise_floor * std::sqrt(static_cast<double>(d_in)) * mean_diagonal;
    if (floor > 0.0 && smallest * smallest <= kNoiseFloorTrigger * floor) return false;
    mirror_lower(lhs, threads);
    clock.lap("convert32");

    // The deviations, once: y_i = (W_i - W-)^T z in float64 for the probes, and rounded to
    // float32 into rows [j d_in, (j + 1) d_in) of dev32.
    const Index m = static_cast<Index>(others.size());
    const MatrixXd z = gaussian_probes(d_out, kProbes);
    MatrixXd y = MatrixXd::Zero(d_in, m * kProbes);
    Eigen::MatrixXf dev32(m * d_in, d_out);
    {
      MatrixXd delta(d_in, std::min(kRhsChunk, d_out));
      for (Index j = 0; j < m; ++j) {
        auto yj = y.middleCols(j * kProbes, kProbes);
        for_each_deviation_block(
            models[others[j]].weight, mean_t, layout, threads, delta,
            [&](Index) {},
            [&](Index c0, Index w, Index r0, Index h) {
              yj.middleRows(r0, h).noalias() += delta.block(r0, 0, h, w) * z.middleRows(c0, w);
              dev32.block(j * d_in + r0, c0, h, w) = delta.block(r0, 0, h, w).cast<float>();
            });
      }
    }
    clock.lap("deviations");
    // The Gram differences, once, by tiles of rows: B z = sum_j D_j y_j in float64 (each
    // tile owns its rows of B z, summed over j in order), D_j rounded into diff32's columns
    // [j d_in, (j + 1) d_in).
    MatrixXd bz = MatrixXd::Zero(d_in, kProbes);
    Eigen::MatrixXf diff32(d_in, m * d_in);
    {
      const Index n_tiles = (d_in + kTile - 1) / kTile;
      LMDX_PRAGMA(omp parallel num_threads(threads)) {
        MatrixXd t(kTile, d_in);
        LMDX_PRAGMA(omp for schedule(dynamic, 1))
        for (Index tile = 0; tile < n_tiles; ++tile) {
          const Index r0 = tile * kTile, h = std::min(kTile, d_in - r0);
          for (Index j = 0; j < m; ++j) {
            difference_rows(models, s, coef, others[j], pivot, alpha, r0, h, t);
            bz.middleRows(r0, h).noalias() +=
                t.topRows(h) * y.middleCols(j * kProbes, kProbes);
            diff32.block(r0, j * d_in, h, d_in) = t.topRows(h).cast<float>();
          }
        }
      }
    }
    clock.lap("differences");
    if (factor_error_estimate(l32, bz, z, alpha, ridge, threads) > kOutputErrorTolerance &&
        !forced) {
      clock.lap("precheck");
      return false;  // the factor alone already exceeds the tolerance: float64 at once
    }
    clock.lap("precheck");

    // rhs = sum_j D_j (W_j - W-)^T in float32: one product [D_1 .. D_m] [dev_1; ..; dev_m],
    // by fixed blocks of rows.
    Eigen::MatrixXf x32(d_in, d_out);
    {
      const Index row_block = column_block_width(d_in);
      const Index n_row_blocks = (d_in + row_block - 1) / row_block;
      LMDX_PRAGMA(omp parallel for num_threads(threads) schedule(dynamic, 1))
      for (Index rb = 0; rb < n_row_blocks; ++rb) {
        const Index r0 = rb * row_block;
        const Index h = std::min(row_block, d_in - r0);
        x32.middleRows(r0, h).noalias() = diff32.middleRows(r0, h) * dev32;
      }
    }
    diff32.resize(0, 0);
    dev32.resize(0, 0);
    clock.lap("products32");
    cholesky_solve_in_place(l32, x32, threads);
    clock.lap("solve32");

    // merged = W- + X; probes of X (those of W- and A W- z are the pre-check's).
    MatrixXd xz(d_in, kProbes);
    const Index row_block = column_block_width(d_in);
    const Index n_row_blocks = (d_in + row_block - 1) / row_block;
    LMDX_PRAGMA(omp parallel for num_threads(threads) schedule(static))
    for (Index c = 0; c < d_out; ++c) merged_t.col(c) = mean_t.col(c) + x32.col(c).cast<double>();
    LMDX_PRAGMA(omp parallel for num_threads(threads) schedule(dynamic, 1))
    for (Index rb = 0; rb < n_row_blocks; ++rb) {
      const Index r0 = rb * row_block;
      const Index h = std::min(row_block, d_in - r0);
      xz.middleRows(r0, h).noalias() = x32.middleRows(r0, h).cast<double>() * z;
    }
    // E z = X_32 z - X_64 z = (X_32 z - x) + (x - X_64 z): the first part exactly, the
    // second the pre-check's e, refined once against res (A (x - X_64 z) = res).
    const MatrixXd axz = system_times(xz, alpha, ridge, threads);
    const double merged_norm2 = s_norm2(mean_z + xz, a_mean_z + axz, ridge);
    const MatrixXd first = xz - x_probe + e_probe;
    const MatrixXd a_first = axz - a_x + a_e;
    const MatrixXd correction = solve32(l32, res - a_e, threads);
    const MatrixXd ac = system_times(correction, alpha, ridge, threads);
    const double ee = first.cwiseProduct(a_first).sum();
    const double ec = correction.cwiseProduct(a_first).sum();
    const double cc = std::max(correction.cwiseProduct(ac).sum(), 0.0);
    // ||E Z||_A after the refinement, plus what a refinement contracting at the observed
    // rate rho (the correction against e) would still change: rho / (1 - rho) times the
    // correction.
    const double rho = e_norm2 > 0.0 ? std::sqrt(cc / e_norm2) : 0.0;
    const double refined = std::sqrt(std::max(ee + 2.0 * ec + cc, 0.0));
    const double error_norm =
        refined + (rho < 1.0 ? rho / (1.0 - rho) : 1.0) * std::sqrt(cc);
    double estimate = 0.0;
    if (error_norm > 0.0) {
      estimate = merged_norm2 > 0.0
                     ? kCertificateMargin * error_norm / std::sqrt(merged_norm2)
                     : std::numeric_limits<double>::max();
    }

    info.ridge = opt.ridge;
    info.ridge_absolute = ridge;
    info.mean_diagonal = mean_diagonal;
    info.attempts = 1;
    info.escalated = false;
    info.min_pivot = l32.diagonal().minCoeff();
    info.max_pivot = l32.diagonal().maxCoeff();
    const double ratio = info.min_pivot / info.max_pivot;
    info.rcond_estimate = ratio * ratio;
    info.condition_estimate = 0.0;
    if (d_in <= kEstimateDim) {
      info.condition_estimate = symmetric_norm1(d_in, alpha, ridge, threads,
                                                [&](Index j, double*) { return &lhs(j, j); }) *
                                inverse_norm1_estimate(l32);
    }
    info.output_error_estimate = estimate;
    info.precision = "float32";
    clock.lap("certificate");
    return forced || (rho <= kMaxContraction && estimate <= kOutputErrorTolerance);
  }
};

// W_M^T (d_in x d_out, column-major) into merged_t, from models whose shapes are checked
// (opt.n_threads too).
RegMeanInfo merge_transposed(const std::vector<RegMeanModel>& models, Index d_in, Index d_out,
                             const std::vector<double>& coefficients, WeightLayout layout,
                             Precision mode, double noise_floor, const SolveOptions& opt,
                             MatrixXd& merged_t) {
  RegMeanInfo info;
  PhaseClock clock(info);
  const size_t k = models.size();
  if (d_in < 1 || d_out < 1)
    throw std::invalid_argument(opt.name + ": weights: empty weight matrix");
  if (!(opt.alpha >= 0.0 && opt.alpha <= 1.0)) {
    throw std::invalid_argument(opt.name + ": alpha: must be in [0, 1], got " +
                                std::to_string(opt.alpha));
  }
  const std::vector<double> coef = checked_coefficients(coefficients, k, opt.name + ": ");
  double total = 0.0;
  size_t pivot = 0;  // the model with the largest coefficient (> 0)
  for (size_t i = 0; i < k; ++i) {
    const std::string tag = "[" + std::to_string(i) + "]";
    if (!std::isfinite(models[i].count) || !(models[i].count > 0.0)) {
      throw std::invalid_argument(opt.name + ": counts" + tag + " must be > 0, got " +
                                  std::to_string(models[i].count) +
                                  " (no rows reached this layer for that model)");
    }
    const GramSource& g = models[i].gram;
    require_finite(g.data, g.size(), g.packed ? 0 : d_in, opt.name + ": grams" + tag,
                   opt.n_threads);
    if (!g.packed) require_symmetric(g.data, d_in, opt.name + ": grams" + tag, opt.n_threads);
    require_finite(models[i].weight, layout == WeightLayout::Linear ? d_in : d_out,
                   opt.name + ": weights" + tag, opt.n_threads);
    total += coef[i];
    if (coef[i] > coef[pivot]) pivot = i;
  }
  std::vector<size_t> others;  // models with c_i > 0 other than the pivot
  for (size_t i = 0; i < k; ++i) {
    if (i != pivot && coef[i] > 0.0) others.push_back(i);
  }

  // Tiny layers run on one thread: starting a team costs more than their arithmetic.
  // Decided by the work, never changing results (all partitions are fixed by the shapes).
  const double work = static_cast<double>(d_in) * static_cast<double>(d_in) *
                      (static_cast<double>(k) * static_cast<double>(d_out) + d_in);
  const int threads = work < kSerialWork ? 1 : opt.n_threads;
  clock.lap("checks");

  // W-^T = W_p^T + sum_{i != p} (c_i / C) (W_i - W_p)^T: exactly W_p^T where all agree.
  // The spread max_i max |W_i - W-| / max |W-| is taken on the way.
  MatrixXd mean_t(d_in, d_out);
  double spread = 0.0, scale = 0.0;
  {
    const Index n_blocks = (d_out + kWidenColumns - 1) / kWidenColumns;
    LMDX_PRAGMA(omp parallel num_threads(threads)) {
      // This block of columns of every model with c_i > 0, widened once: [0] the pivot's.
      std::vector<MatrixXd> wk(others.size() + 1, MatrixXd(d_in, kWidenColumns));
      LMDX_PRAGMA(omp for schedule(static) reduction(max : spread, scale))
      for (Index b = 0; b < n_blocks; ++b) {
        const Index c0 = b * kWidenColumns;
        const Index w = std::min(kWidenColumns, d_out - c0);
        auto bar = mean_t.middleCols(c0, w);
        const auto wp = wk[0].leftCols(w);
        widen_columns(models[pivot].weight, d_in, d_out, layout, c0, w, wk[0].leftCols(w));
        bar = wp;
        for (size_t j = 0; j < others.size(); ++j) {
          const size_t i = others[j];
          widen_columns(models[i].weight, d_in, d_out, layout, c0, w, wk[j + 1].leftCols(w));
          bar += (coef[i] / total) * (wk[j + 1].leftCols(w) - wp);
        }
        for (const MatrixXd& wi : wk) {
          spread = std::max(spread, (wi.leftCols(w) - bar).cwiseAbs().maxCoeff());
        }
        scale = std::max(scale, bar.cwiseAbs().maxCoeff());
      }
    }
  }
  info.relative_spread = scale > 0.0 ? spread / scale : (spread > 0.0 ? INFINITY : 0.0);
  clock.lap("average");
  if (spread == 0.0) {  // equal in every model: nothing to solve
    info.precision = "identical";
    merged_t = mean_t;
    return info;
  }

  // lhs = sum_i s_i G_i (lower triangle), s_i = c_i / n_i, one column a task.
  std::vector<double> s(k);
  for (size_t i = 0; i < k; ++i) s[i] = coef[i] / models[i].count;
  MatrixXd lhs(d_in, d_in);
  std::vector<GramSource> grams(k);
  for (size_t i = 0; i < k; ++i) grams[i] = models[i].gram;
  sum_lower(grams, s, threads, lhs);
  clock.lap("system");
  SolveOptions solve_opt = opt;
  solve_opt.n_threads = threads;
  const double alpha = opt.alpha;
  if (mode == Precision::Float32 || (mode == Precision::Auto && work >= kSerialWork)) {
    Float32Merge f32{models, coef,   s,      pivot, others,     d_in,
                     d_out,  layout, mean_t, lhs,   noise_floor, {}, {}, {}, {}, {}, {}, {}, 0.0};
    if (f32.run(solve_opt, mode == Precision::Float32, info, merged_t)) return info;
  }
  info.output_error_estimate = 0.0;
  clock.restart();

  MatrixXd l;
  static_cast<SolveInfo&>(info) = spd_factor(lhs, l, solve_opt);
  // Below the statistics' noise floor: eigendirections of the system whose eigenvalue the
  // Grams' own rounding could have made (or unmade) are solved as unseen, keeping the
  // average. Only systems with a pivot near the floor (or that needed a ridge) can have
  // such directions worth the eigendecomposition: every eigenvalue is <= the smallest
  // squared pivot.
  const double floor = noise_floor * std::sqrt(static_cast<double>(d_in)) * info.mean_diagonal;
  MatrixXd system;
  if (floor > 0.0 &&
      (info.escalated || info.min_pivot * info.min_pivot <= kNoiseFloorTrigger * floor)) {
    system.resize(d_in, d_in);
    system.triangularView<Eigen::Lower>() = lhs;
    reduce_lower_triangle(system, alpha);
    system.diagonal().array() += opt.ridge * info.mean_diagonal;
  }
  // The condition estimate up to kEstimateDim inputs (O(d^2), negligible there).
  info.condition_estimate = 0.0;
  if (d_in <= kEstimateDim) {
    info.condition_estimate = symmetric_norm1(d_in, alpha, info.ridge_absolute, threads,
                                              [&](Index j, double*) { return &lhs(j, j); }) *
                              inverse_norm1_estimate(l);
  }
  info.precision = "float64";
  clock.lap("factor64");

  // rhs = sum_{i != p} D_i (W_i - W-)^T with D_i = c_i (G~_i - G~_p), built from the raw
  // Grams as s_i G_i - (c_i / n_p) G_p with the off-diagonal scaled by alpha. D_i reuses
  // lhs's storage (the factor is in l).
  merged_t.setZero();
  MatrixXd& d_i = lhs;
  MatrixXd delta(d_in, std::min(kRhsChunk, d_out));
  for (size_t i : others) {
    form_difference(models, s, coef, i, pivot, alpha, threads, d_i);
    for_each_deviation_block(models[i].weight, mean_t, layout, threads, delta,
                             [](Index) {},
                             [&](Index c0, Index w, Index r0, Index h) {
                               merged_t.block(r0, c0, h, w).noalias() +=
                                   d_i.middleRows(r0, h) * delta.leftCols(w);
                             });
  }
  clock.lap("products64");
  if (system.size() == 0) {
    cholesky_solve_in_place(l, merged_t, threads);
  } else {
    // No ridge beyond the one asked for: the directions it would have propped up are unseen.
    info.ridge = opt.ridge;
    info.ridge_absolute = opt.ridge * info.mean_diagonal;
    info.escalated = false;
    spectral_solve(system, floor, opt.name, merged_t, info);
  }
  merged_t += mean_t;
  clock.lap("solve64");
  return info;
}

}  // namespace

RegMeanInfo regmean_merge_layer(const std::vector<ArrayView>& grams,
                                const std::vector<ArrayView>& weights,
                                const std::vector<double>& counts,
                                const std::vector<double>& coefficients, const std::string& layout,
                                const std::string& precision, double noise_floor,
                                const SolveOptions& opt, double* out) {
  const std::string& name = opt.name;
  if (!(noise_floor >= 0.0 && noise_floor < 1.0)) {
    throw std::invalid_argument(name + ": noise_floor: must be in [0, 1), got " +
                                std::to_string(noise_floor));
  }
  const int requested = resolve_threads(opt.n_threads);
  const size_t k = grams.size();
  if (k == 0) throw std::invalid_argument(name + ": grams: need at least one model");
  if (counts.size() != k || weights.size() != k) {
    throw std::invalid_argument(name + ": grams, counts, weights: need one entry per model, got " +
                                std::to_string(k) + ", " + std::to_string(counts.size()) + ", " +
                                std::to_string(weights.size()));
  }
  const WeightLayout lay = parse_layout(layout, name);
  const Precision mode = parse_precision(precision, name);
  std::vector<RegMeanModel> models(k);
  Index d_in = 0, d_out = 0;
  for (size_t i = 0; i < k; ++i) {
    const std::string tag = "[" + std::to_string(i) + "]";
    const ArrayView& w = weights[i];
    if (w.shape.size() != 2) {
      throw std::invalid_argument(name + ": weights" + tag + ": expected a matrix, got a " +
                                  describe(w));
    }
    const Index in = lay == WeightLayout::Linear ? w.shape[1] : w.shape[0];
    const Index out_dim = lay == WeightLayout::Linear ? w.shape[0] : w.shape[1];
    if (i == 0) {
      d_in = in;
      d_out = out_dim;
    } else if (in != d_in || out_dim != d_out) {
      throw std::invalid_argument(name + ": weights" + tag + " is a " + describe(w) +
                                  " but weights[0] has shape " + shape_of(weights[0].shape) +
                                  "; all models must have the same architecture");
    }
    const bool packed = grams[i].shape.size() == 1;
    const std::vector<Index> expected =
        packed ? std::vector<Index>{d_in * (d_in + 1) / 2} : std::vector<Index>{d_in, d_in};
    if (grams[i].shape != expected) {
      throw std::invalid_argument(
          name + ": grams" + tag + " is a " + describe(grams[i]) +
          " but the layer's input dimension is " + std::to_string(d_in) + " (layout '" + layout +
          "'): expected shape " + shape_of(expected) +
          (packed ? " (the packed upper triangle)" : ""));
    }
    models[i] = RegMeanModel{GramSource{grams[i].f64(), packed, d_in}, counts[i], w};
  }
  SolveOptions checked = opt;
  checked.n_threads = requested;
  // Solved in a buffer of our own: Eigen's vectorized kernels fuse multiply-adds only where
  // data is aligned, so working in the caller's buffer would make the last bits depend on
  // its address.
  MatrixXd merged_t(d_in, d_out);
  const RegMeanInfo info =
      merge_transposed(models, d_in, d_out, coefficients, lay, mode, noise_floor, checked,
                       merged_t);
  if (lay == WeightLayout::Linear) {
    // W_M^T column-major (d_in x d_out) is W_M row-major [out, in].
    std::copy(merged_t.data(), merged_t.data() + merged_t.size(), out);
  } else {
    Eigen::Map<RowMajor<double>>(out, d_in, d_out) = merged_t;
  }
  return info;
}

SolveInfo regmean_low_rank_solve(const std::vector<ArrayView>& grams,
                                 const std::vector<ArrayView>& factors,
                                 const std::vector<double>& counts,
                                 const std::vector<double>& coefficients, const SolveOptions& opt,
                                 MatrixXd& f) {
  const std::string& name = opt.name;
  const int threads = resolve_threads(opt.n_threads);
  const size_t k = grams.size();
  if (k == 0) throw std::invalid_argument(name + ": grams: need at least one model");
  if (counts.size() != k || factors.size() != k) {
    throw std::invalid_argument(name + ": grams, counts, factors: need one entry per model, got " +
                                std::to_string(k) + ", " + std::to_string(counts.size()) + ", " +
                                std::to_string(factors.size()));
  }
  if (!(opt.alpha >= 0.0 && opt.alpha <= 1.0)) {
    throw std::invalid_argument(name + ": alpha: must be in [0, 1], got " +
                                std::to_string(opt.alpha));
  }
  const std::vector<double> coef = checked_coefficients(coefficients, k, name + ": ");
  const Index d = factors[0].shape.size() == 2 ? factors[0].shape[1] : 0;
  std::vector<GramSource> sources(k);
  std::vector<double> s(k);
  double total = 0.0;
  Index rank = 0;
  for (size_t i = 0; i < k; ++i) {
    const std::string tag = "[" + std::to_string(i) + "]";
    const ArrayView& a = factors[i];
    if (a.shape.size() != 2 || a.is_float32 || a.shape[1] != d || d < 1) {
      throw std::invalid_argument(name + ": factors" + tag + " is a " + describe(a) +
                                  ": expected a float64 (r, " + std::to_string(d) +
                                  ") matrix A_i, as factors[0]");
    }
    const bool packed = grams[i].shape.size() == 1;
    const std::vector<Index> expected =
        packed ? std::vector<Index>{d * (d + 1) / 2} : std::vector<Index>{d, d};
    if (grams[i].shape != expected) {
      throw std::invalid_argument(name + ": grams" + tag + " is a " + describe(grams[i]) +
                                  " but the factors have " + std::to_string(d) +
                                  " inputs: expected shape " + shape_of(expected) +
                                  (packed ? " (the packed upper triangle)" : ""));
    }
    if (coef[i] > 0.0 && (!std::isfinite(counts[i]) || !(counts[i] > 0.0))) {
      throw std::invalid_argument(name + ": counts" + tag + " must be > 0, got " +
                                  std::to_string(counts[i]));
    }
    sources[i] = GramSource{grams[i].f64(), packed, d};
    require_finite(sources[i].data, sources[i].size(), packed ? 0 : d, name + ": grams" + tag,
                   threads);
    if (!packed) require_symmetric(sources[i].data, d, name + ": grams" + tag, threads);
    require_finite(a, d, name + ": factors" + tag, threads);
    s[i] = coef[i] > 0.0 ? coef[i] / counts[i] : 0.0;
    total += coef[i];
    if (coef[i] > 0.0) rank += a.shape[0];
  }
  MatrixXd lhs(d, d);
  sum_lower(sources, s, threads, lhs);
  // [U_1 .. U_K | c_1 A_1^T / C .. c_K A_K^T / C], U_i = s_i G~_i A_i^T by tiles of rows;
  // models with c_i > 0, in order.
  MatrixXd rhs(d, 2 * rank);
  const Index n_tiles = (d + kTile - 1) / kTile;
  Index col = 0;
  for (size_t i = 0; i < k; ++i) {
    const Index r = factors[i].shape[0];
    if (!(coef[i] > 0.0) || r == 0) continue;
    const Eigen::Map<const MatrixXd> a_t(factors[i].f64(), d, r);  // (r, d) row-major = A_i^T
    LMDX_PRAGMA(omp parallel num_threads(threads)) {
      MatrixXd t(kTile, d);
      LMDX_PRAGMA(omp for schedule(dynamic, 1))
      for (Index tile = 0; tile < n_tiles; ++tile) {
        const Index r0 = tile * kTile, h = std::min(kTile, d - r0);
        reduced_rows(sources[i], s[i], nullptr, 0.0, opt.alpha, r0, h, t);
        rhs.block(r0, col, h, r).noalias() = t.topRows(h) * a_t;
      }
    }
    rhs.middleCols(rank + col, r) = (coef[i] / total) * a_t;
    col += r;
  }
  SolveOptions checked = opt;
  checked.n_threads = threads;
  MatrixXd l;
  const SolveInfo info = spd_factor(lhs, l, checked);
  cholesky_solve_in_place(l, rhs, threads);
  f = rhs.leftCols(rank) + info.ridge_absolute * rhs.rightCols(rank);
  return info;
}

LMDX_NAMESPACE_END
