// The kernels of the RegMean merge shared by its float64 path (regmean.cpp) and its float32
// path (regmean_float32.cpp): the Gram sources and their reduced rows, the weights widened
// to float64 and their deviations from the average, the Gram differences, the fixed-seed
// probes, norms and the spectral solve below the noise floor. Internal to the core.
#pragma once

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "core/parallel.hpp"
#include "core/regmean.hpp"
#include "core/spd.hpp"

LMDX_NAMESPACE_BEGIN

namespace detail {

// Output columns of the deviations (W_i - W-)^T widened to float64 at a time (bounds that
// buffer: d_in x 1024 doubles).
constexpr Index kRhsChunk = 1024;
// Columns of W_i^T widened per task.
constexpr Index kWidenColumns = 64;
// Tiles of the mirrored (upper) triangle.
constexpr Index kTile = 64;
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

inline void widen_columns(const ArrayView& weight, Index d_in, Index d_out, WeightLayout layout,
                          Index c0, Index w, Eigen::Ref<MatrixXd> out) {
  if (weight.is_float32) {
    widen_columns(weight.f32(), d_in, d_out, layout, c0, w, out);
  } else {
    widen_columns(weight.f64(), d_in, d_out, layout, c0, w, out);
  }
}

enum class Precision { Auto, Float32, Float32Rhs, Float64 };

// The layout and precision arguments, checked (messages start with name).
WeightLayout parse_layout(const std::string& layout, const std::string& name);
Precision parse_precision(const std::string& precision, const std::string& name);

// y += a x and y = a x - b z, fused element by element: the same bits wherever x and z lie
// in memory (Eigen's vectorized expressions fuse only the part of a column that is
// aligned, so their results would depend on the inputs' addresses).
inline void axpy(double a, const double* x, double* y, Index n) {
  for (Index r = 0; r < n; ++r) y[r] = std::fma(a, x[r], y[r]);
}
inline void axmbz(double a, const double* x, double b, const double* z, double* y, Index n) {
  for (Index r = 0; r < n; ++r) y[r] = std::fma(-b, z[r], a * x[r]);
}

// Copy the strict lower triangle of the square m onto its upper one, by tiles.
void mirror_lower(MatrixXd& m, int threads);

// D_i = c_i (G~_i - G~_p) (full, symmetric) into d, from the raw Grams as
// s_i G_i - (c_i / n_p) G_p with the off-diagonal scaled by alpha.
void form_difference(const std::vector<RegMeanModel>& models, const std::vector<double>& s,
                     const std::vector<double>& coef, size_t i, size_t pivot, double alpha,
                     int threads, MatrixXd& d);

// Columns [c0, c0 + w) of (W_i - W-)^T into delta's first w columns. Called by every thread
// of a parallel region (an orphaned omp for: the deviations are complete after it).
void widen_deviations(const ArrayView& weight, const MatrixXd& mean_t, WeightLayout layout,
                      Index c0, Index w, MatrixXd& delta);

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
                   int threads);

// out = S v, S the symmetric matrix whose lower triangle a holds (its upper one is not
// read), by fixed blocks of rows across the threads: a block's rows from its diagonal
// block, the rows of the lower triangle left of it and the columns below it.
void multiply_symmetric_lower(const MatrixXd& a, const MatrixXd& v, MatrixXd& out, int threads);

// Standard normal rows x cols from a fixed seed (splitmix64 and Box-Muller): the same
// probes on every run and every platform.
MatrixXd gaussian_probes(Index rows, Index cols);

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
                    RegMeanInfo& info);

// Rows [r0, r0 + h) of the symmetric d x d matrix sa A - sb B (B optional: sb = 0 or b
// null), off-diagonal reduced by alpha, into the first h rows of t (column-major, at least
// h x d), from Grams that each hold one triangle: the columns left of the rows come from
// the columns of the lower triangle (contiguous), the rest from the rows' own lower columns.
void reduced_rows(const GramSource& a, double sa, const GramSource* b, double sb, double alpha,
                  Index r0, Index h, MatrixXd& t);

// Rows [r0, r0 + h) of D_i = c_i (G~_i - G~_p) = s_i G~_i - (c_i / n_p) G~_p.
void difference_rows(const std::vector<RegMeanModel>& models, const std::vector<double>& s,
                     const std::vector<double>& coef, size_t i, size_t pivot, double alpha,
                     Index r0, Index h, MatrixXd& t);

// The lower triangle of sum_i s_i G_i into lhs (d x d), one column a task.
void sum_lower(const std::vector<GramSource>& grams, const std::vector<double>& s, int threads,
               MatrixXd& lhs);

}  // namespace detail

LMDX_NAMESPACE_END
