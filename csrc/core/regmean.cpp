#include "core/regmean.hpp"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

#include "core/checks.hpp"
#include "core/parallel.hpp"

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
// Input dimensions up to which every layer gets a 1-norm condition estimate (beyond, only
// where float32 products are considered: the estimate's solves stream the factor).
constexpr Index kEstimateDim = 1024;
// Tiles of the mirrored (upper) triangle.
constexpr Index kTile = 64;
// float32 unit roundoff, 2^-24.
constexpr double kFloat32Roundoff = 5.9604644775390625e-8;
// The error of float32 products is estimated as cond_1 x roundoff x sqrt(d_in) x spread x
// (sum_i ||D_i||_1 / ||A||_1, the size of the matrices that multiply the deviations against
// the system's) x this factor; tests/core/test_regmean.py checks on Grams of condition
// 1-1e6, alike, proportional and unlike, that the errors stay below 15 % of the estimate.
constexpr double kFloat32Margin = 4.0;

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

bool parse_precision(const std::string& precision, const std::string& name) {
  if (precision == "auto") return true;
  if (precision == "float64") return false;
  throw std::invalid_argument(name + ": precision: expected 'auto' or 'float64', got '" +
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

// W_M^T (d_in x d_out, column-major) into merged_t, from models whose shapes are checked
// (opt.n_threads too).
RegMeanInfo merge_transposed(const std::vector<RegMeanModel>& models, Index d_in, Index d_out,
                             const std::vector<double>& coefficients, WeightLayout layout,
                             bool auto_precision, const SolveOptions& opt,
                             MatrixXd& merged_t) {
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
  RegMeanInfo info;

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
  if (spread == 0.0) {  // equal in every model: nothing to solve
    info.precision = "identical";
    merged_t = mean_t;
    return info;
  }

  // lhs = sum_i s_i G_i (lower triangle), s_i = c_i / n_i, one column a task.
  std::vector<double> s(k);
  for (size_t i = 0; i < k; ++i) s[i] = coef[i] / models[i].count;
  MatrixXd lhs(d_in, d_in);
  LMDX_PRAGMA(omp parallel for num_threads(threads) schedule(dynamic, 16))
  for (Index j = 0; j < d_in; ++j) {
    auto col = lhs.col(j).tail(d_in - j);
    col.setZero();
    for (size_t i = 0; i < k; ++i) {
      if (s[i] != 0.0) axpy(s[i], models[i].gram.lower_column(j), col.data(), d_in - j);
    }
  }
  SolveOptions solve_opt = opt;
  solve_opt.n_threads = threads;
  MatrixXd l;
  static_cast<SolveInfo&>(info) = spd_factor(lhs, l, solve_opt);
  const double alpha = opt.alpha;

  // The condition estimate: always up to kEstimateDim inputs (O(d^2), negligible there),
  // and where float32 products are considered. Precision of those products: layers merged
  // on one thread always use float64 (their time is not in the products); the pivots give
  // a lower bound on cond_2, so a layer they already rule out needs no estimate.
  double lhs_norm1 = 0.0;  // ||sum_i c_i G~_i + ridge I||_1, when first needed
  const auto system_norm1 = [&] {
    if (lhs_norm1 == 0.0) {
      lhs_norm1 = symmetric_norm1(d_in, alpha, info.ridge_absolute, threads,
                                  [&](Index j, double*) { return &lhs(j, j); });
    }
    return lhs_norm1;
  };
  const auto estimate = [&] {
    if (info.condition_estimate == 0.0) {
      info.condition_estimate = system_norm1() * inverse_norm1_estimate(l);
    }
    return info.condition_estimate;
  };
  if (d_in <= kEstimateDim) estimate();
  bool float32 = false;
  if (auto_precision && work >= kSerialWork) {
    // The rounding of the products scales with the matrices that multiply the deviations,
    // D_i = c_i (G~_i - G~_p), so the system's condition is taken times
    // sum_i ||D_i||_1 / ||sum_i c_i G~_i + ridge I||_1 (small where the models' Grams are
    // alike). O(K d_in^2), threaded.
    double differences = 0.0;
    for (size_t i : others) {
      const double t = coef[i] / models[pivot].count;
      differences += symmetric_norm1(d_in, alpha, 0.0, threads, [&](Index j, double* column) {
        axmbz(s[i], models[i].gram.lower_column(j), t, models[pivot].gram.lower_column(j),
              column, d_in - j);
        return column;
      });
    }
    const double per_cond = kFloat32Roundoff * std::sqrt(static_cast<double>(d_in)) *
                            kFloat32Margin * info.relative_spread * differences / system_norm1();
    const double pivot_bound = 1.0 / info.rcond_estimate;
    if (pivot_bound * per_cond <= kFloat32Tolerance) {
      info.float32_error_estimate = estimate() * per_cond;
      float32 = info.float32_error_estimate <= kFloat32Tolerance;
    }
  }
  info.precision = float32 ? "float32" : "float64";

  // rhs = sum_{i != p} D_i (W_i - W-)^T with D_i = c_i (G~_i - G~_p), built from the raw
  // Grams as s_i G_i - (c_i / n_p) G_p with the off-diagonal scaled by alpha. D_i reuses
  // lhs's storage (the factor is in l).
  merged_t.setZero();
  MatrixXd& d_i = lhs;
  Eigen::MatrixXf d_i32;
  const Index row_block = column_block_width(d_in);
  const Index n_row_blocks = (d_in + row_block - 1) / row_block;
  const Index chunk = std::min(kRhsChunk, d_out);
  MatrixXd delta(d_in, chunk);
  Eigen::MatrixXf delta32;
  for (size_t i : others) {
    const double t = coef[i] / models[pivot].count;
    LMDX_PRAGMA(omp parallel for num_threads(threads) schedule(dynamic, 16))
    for (Index j = 0; j < d_in; ++j) {
      auto col = d_i.col(j).tail(d_in - j);
      axmbz(s[i], models[i].gram.lower_column(j), t, models[pivot].gram.lower_column(j),
            col.data(), d_in - j);
      col.tail(d_in - j - 1) *= alpha;
    }
    mirror_lower(d_i, threads);
    if (float32) d_i32 = d_i.cast<float>();
    for (Index c0 = 0; c0 < d_out; c0 += chunk) {
      const Index w = std::min(chunk, d_out - c0);
      LMDX_PRAGMA(omp parallel num_threads(threads)) {
        LMDX_PRAGMA(omp for schedule(static))
        for (Index s0 = 0; s0 < w; s0 += kWidenColumns) {
          const Index sw = std::min(kWidenColumns, w - s0);
          auto part = delta.middleCols(s0, sw);
          widen_columns(models[i].weight, d_in, d_out, layout, c0 + s0, sw, part);
          part -= mean_t.middleCols(c0 + s0, sw);
        }  // barrier: the deviations are complete
        LMDX_PRAGMA(omp single)
        if (float32) delta32 = delta.leftCols(w).cast<float>();
        // (implicit barrier after single)
        LMDX_PRAGMA(omp for schedule(dynamic, 1))
        for (Index rb = 0; rb < n_row_blocks; ++rb) {
          const Index r0 = rb * row_block;
          const Index h = std::min(row_block, d_in - r0);
          auto out = merged_t.block(r0, c0, h, w);
          if (float32) {
            const Eigen::MatrixXf part = d_i32.middleRows(r0, h) * delta32;
            out += part.cast<double>();
          } else {
            out.noalias() += d_i.middleRows(r0, h) * delta.leftCols(w);
          }
        }
      }
    }
  }
  cholesky_solve_in_place(l, merged_t, threads);
  merged_t += mean_t;
  return info;
}

}  // namespace

RegMeanInfo regmean_merge_layer(const std::vector<ArrayView>& grams,
                                const std::vector<ArrayView>& weights,
                                const std::vector<double>& counts,
                                const std::vector<double>& coefficients, const std::string& layout,
                                const std::string& precision, const SolveOptions& opt,
                                double* out) {
  const std::string& name = opt.name;
  const int requested = resolve_threads(opt.n_threads);
  const size_t k = grams.size();
  if (k == 0) throw std::invalid_argument(name + ": grams: need at least one model");
  if (counts.size() != k || weights.size() != k) {
    throw std::invalid_argument(name + ": grams, counts, weights: need one entry per model, got " +
                                std::to_string(k) + ", " + std::to_string(counts.size()) + ", " +
                                std::to_string(weights.size()));
  }
  const WeightLayout lay = parse_layout(layout, name);
  const bool auto_precision = parse_precision(precision, name);
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
      merge_transposed(models, d_in, d_out, coefficients, lay, auto_precision, checked, merged_t);
  if (lay == WeightLayout::Linear) {
    // W_M^T column-major (d_in x d_out) is W_M row-major [out, in].
    std::copy(merged_t.data(), merged_t.data() + merged_t.size(), out);
  } else {
    Eigen::Map<RowMajor<double>>(out, d_in, d_out) = merged_t;
  }
  return info;
}

LMDX_NAMESPACE_END
