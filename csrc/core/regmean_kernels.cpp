#include "core/regmean_kernels.hpp"

#include <Eigen/Eigenvalues>
#include <cstdint>
#include <limits>
#include <stdexcept>

#include "core/reduction.hpp"

LMDX_NAMESPACE_BEGIN

namespace detail {

WeightLayout parse_layout(const std::string& layout, const std::string& name) {
  if (layout == "linear") return WeightLayout::Linear;
  if (layout == "conv1d") return WeightLayout::Conv1D;
  throw std::invalid_argument(name +
                              ": layout: expected 'linear' ([out, in], torch nn.Linear) or "
                              "'conv1d' ([in, out], Hugging Face Conv1D), got '" +
                              layout + "'");
}

Precision parse_precision(const std::string& precision, const std::string& name) {
  if (precision == "auto") return Precision::Auto;
  if (precision == "float32") return Precision::Float32;
  if (precision == "float32-rhs") return Precision::Float32Rhs;
  if (precision == "float64") return Precision::Float64;
  throw std::invalid_argument(name +
                              ": precision: expected 'auto', 'float32', 'float32-rhs' or "
                              "'float64', got '" +
                              precision + "'");
}

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

void multiply_symmetric_lower(const MatrixXd& a, const MatrixXd& v, MatrixXd& out,
                              int threads) {
  const Index d = a.rows();
  const Index row_block = column_block_width(d);
  const Index n_blocks = (d + row_block - 1) / row_block;
  out.resize(d, v.cols());
  LMDX_PRAGMA(omp parallel for num_threads(threads) schedule(dynamic, 1))
  for (Index b = 0; b < n_blocks; ++b) {
    const Index r0 = b * row_block;
    const Index h = std::min(row_block, d - r0);
    const Index below = d - r0 - h;
    auto o = out.middleRows(r0, h);
    o.noalias() = a.block(r0, r0, h, h).selfadjointView<Eigen::Lower>() * v.middleRows(r0, h);
    if (r0 > 0) o.noalias() += a.block(r0, 0, h, r0) * v.topRows(r0);
    if (below > 0) {
      o.noalias() += a.block(r0 + h, r0, below, h).transpose() * v.bottomRows(below);
    }
  }
}

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

void difference_rows(const std::vector<RegMeanModel>& models, const std::vector<double>& s,
                     const std::vector<double>& coef, size_t i, size_t pivot, double alpha,
                     Index r0, Index h, MatrixXd& t) {
  reduced_rows(models[i].gram, s[i], &models[pivot].gram, coef[i] / models[pivot].count, alpha,
               r0, h, t);
}

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

}  // namespace detail

LMDX_NAMESPACE_END
