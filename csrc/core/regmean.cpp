#include "core/regmean.hpp"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

#include "core/checks.hpp"
#include "core/parallel.hpp"

LMDX_NAMESPACE_BEGIN

namespace {

// Output columns of W_i^T widened to float64 at a time (bounds that copy: d_in x 1024
// doubles).
constexpr Index kRhsChunk = 1024;
// Multiply-adds below which a layer is merged on one thread: K = 3 models of a 128 x 128
// layer (8.4e6) stay below it, of a 256 x 256 layer (6.7e7) do not. Chosen, not tuned.
constexpr double kSerialWork = 2e7;
// Columns of W_i^T widened per task.
constexpr Index kWidenColumns = 64;

enum class WeightLayout {
  Linear,  // torch nn.Linear: weight is [out, in]
  Conv1D,  // Hugging Face GPT-2 Conv1D: weight is [in, out]
};

struct RegMeanModel {
  const double* gram = nullptr;  // d_in x d_in, symmetric, row-major (either order works)
  double count = 0.0;            // n_i: rows (tokens) the Gram was accumulated over
  ArrayView weight;              // [out, in] (Linear) or [in, out] (Conv1D), row-major
};

template <typename T>
using RowMajor = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

// Columns [c0, c0 + w) of W_i^T (d_in x d_out), widened to float64 into `out`.
template <typename T>
void load_weight_t(const T* data, Index d_in, Index d_out, WeightLayout layout, Index c0, Index w,
                   Eigen::Ref<MatrixXd> out) {
  if (layout == WeightLayout::Linear) {
    const Eigen::Map<const MatrixX<T>> wt(data, d_in, d_out);  // [out, in] row-major = W^T
    out = wt.middleCols(c0, w).template cast<double>();
  } else {
    const Eigen::Map<const RowMajor<T>> wt(data, d_in, d_out);  // [in, out] row-major
    out = wt.middleCols(c0, w).template cast<double>();
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

// W_M^T (d_in x d_out, column-major) into merged_t, from models whose shapes are checked
// (opt.n_threads too); returns what the solver did.
SolveInfo merge_transposed(const std::vector<RegMeanModel>& models, Index d_in, Index d_out,
                           const std::vector<double>& coefficients, WeightLayout layout,
                           const SolveOptions& opt, MatrixXd& merged_t) {
  const size_t k = models.size();
  if (d_in < 1 || d_out < 1)
    throw std::invalid_argument(opt.name + ": weights: empty weight matrix");
  if (!(opt.alpha >= 0.0 && opt.alpha <= 1.0)) {
    throw std::invalid_argument(opt.name + ": alpha: must be in [0, 1], got " +
                                std::to_string(opt.alpha));
  }
  const std::vector<double> coef = checked_coefficients(coefficients, k, opt.name + ": ");
  std::vector<double> scale(k);
  for (size_t i = 0; i < k; ++i) {
    const std::string tag = "[" + std::to_string(i) + "]";
    if (!std::isfinite(models[i].count) || !(models[i].count > 0.0)) {
      throw std::invalid_argument(opt.name + ": counts" + tag + " must be > 0, got " +
                                  std::to_string(models[i].count) +
                                  " (no rows reached this layer for that model)");
    }
    require_finite(models[i].gram, d_in * d_in, d_in, opt.name + ": grams" + tag, opt.n_threads);
    require_symmetric(models[i].gram, d_in, opt.name + ": grams" + tag, opt.n_threads);
    require_finite(models[i].weight, layout == WeightLayout::Linear ? d_in : d_out,
                   opt.name + ": weights" + tag, opt.n_threads);
    scale[i] = coef[i] / models[i].count;
  }

  // Tiny layers run on one thread: starting a team costs more than their arithmetic.
  // Decided by the work, never changing results (all partitions are fixed by the shapes).
  const double work = static_cast<double>(d_in) * static_cast<double>(d_in) *
                      (static_cast<double>(k) * static_cast<double>(d_out) + d_in);
  const int threads = work < kSerialWork ? 1 : opt.n_threads;
  const double alpha = opt.alpha;
  MatrixXd lhs = MatrixXd::Zero(d_in, d_in);
  merged_t.setZero(d_in, d_out);
  MatrixXd& rhs = merged_t;
  // Right-hand side by row blocks of the output (fixed by d_in, never by the thread count,
  // for determinism): each task multiplies its rows of G_i by all of W_i^T, so every Gram
  // is read and packed once per column chunk instead of once per column block. W_i^T is
  // widened to float64 once per model and chunk (at most kRhsChunk columns: bounded memory).
  const Index row_block = column_block_width(d_in);
  const Index n_row_blocks = (d_in + row_block - 1) / row_block;
  const Index chunk = std::min(kRhsChunk, d_out);
  MatrixXd wt(d_in, chunk);

  LMDX_PRAGMA(omp parallel num_threads(threads)) {
    // lhs = sum_i s_i G_i (lower triangle), one column a task.
    LMDX_PRAGMA(omp for schedule(dynamic, 16))
    for (Index j = 0; j < d_in; ++j) {
      for (size_t i = 0; i < k; ++i) {
        if (scale[i] == 0.0) continue;
        const Eigen::Map<const MatrixXd> g(models[i].gram, d_in, d_in);
        lhs.col(j).tail(d_in - j) += scale[i] * g.col(j).tail(d_in - j);
      }
    }
    // rhs = sum_i s_i (alpha G_i W_i^T + (1 - alpha) diag(G_i) W_i^T).
    for (Index c0 = 0; c0 < d_out; c0 += chunk) {
      const Index w = std::min(chunk, d_out - c0);
      for (size_t i = 0; i < k; ++i) {
        if (scale[i] == 0.0) continue;
        const ArrayView& weight = models[i].weight;
        LMDX_PRAGMA(omp for schedule(static))
        for (Index s0 = 0; s0 < w; s0 += kWidenColumns) {
          const Index sw = std::min(kWidenColumns, w - s0);
          auto part = wt.middleCols(s0, sw);
          if (weight.is_float32) {
            load_weight_t(weight.f32(), d_in, d_out, layout, c0 + s0, sw, part);
          } else {
            load_weight_t(weight.f64(), d_in, d_out, layout, c0 + s0, sw, part);
          }
        }  // barrier: W_i^T complete
        const Eigen::Map<const MatrixXd> g(models[i].gram, d_in, d_in);
        const auto wi = wt.leftCols(w);
        LMDX_PRAGMA(omp for schedule(dynamic, 1))
        for (Index rb = 0; rb < n_row_blocks; ++rb) {
          const Index r0 = rb * row_block;
          const Index h = std::min(row_block, d_in - r0);
          auto out = rhs.block(r0, c0, h, w);
          if (alpha != 0.0) out.noalias() += (scale[i] * alpha) * (g.middleRows(r0, h) * wi);
          if (alpha != 1.0) {
            out.noalias() += (scale[i] * (1.0 - alpha)) *
                             (g.diagonal().segment(r0, h).asDiagonal() * wi.middleRows(r0, h));
          }
        }  // barrier: wt is rewritten next
      }
    }
  }
  SolveOptions solve_opt = opt;
  solve_opt.n_threads = threads;
  return spd_solve(lhs, rhs, solve_opt);
}

}  // namespace

SolveInfo regmean_merge_layer(const std::vector<ArrayView>& grams,
                              const std::vector<ArrayView>& weights,
                              const std::vector<double>& counts,
                              const std::vector<double>& coefficients, const std::string& layout,
                              const SolveOptions& opt, double* out) {
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
  std::vector<RegMeanModel> models(k);
  Index d_in = 0, d_out = 0;
  for (size_t i = 0; i < k; ++i) {
    const std::string tag = "[" + std::to_string(i) + "]";
    const ArrayView& w = weights[i];
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
    if (grams[i].shape != std::vector<Index>{d_in, d_in}) {
      throw std::invalid_argument(name + ": grams" + tag + " is a " + describe(grams[i]) +
                                  " but the layer's input dimension is " + std::to_string(d_in) +
                                  " (layout '" + layout + "')");
    }
    models[i] = RegMeanModel{grams[i].f64(), counts[i], w};
  }
  SolveOptions checked = opt;
  checked.n_threads = requested;
  MatrixXd merged_t;
  const SolveInfo info =
      merge_transposed(models, d_in, d_out, coefficients, lay, checked, merged_t);
  if (lay == WeightLayout::Linear) {
    // W_M^T column-major (d_in x d_out) is W_M row-major [out, in].
    std::copy(merged_t.data(), merged_t.data() + merged_t.size(), out);
  } else {
    Eigen::Map<RowMajor<double>>(out, d_in, d_out) = merged_t;
  }
  return info;
}

LMDX_NAMESPACE_END
