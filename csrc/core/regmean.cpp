#include "core/regmean.hpp"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

#include "core/checks.hpp"
#include "core/parallel.hpp"
#include "core/phases.hpp"
#include "core/reduction.hpp"
#include "core/regmean_float32.hpp"
#include "core/regmean_kernels.hpp"
#include "core/workspace.hpp"

LMDX_NAMESPACE_BEGIN

using namespace detail;  // the building blocks shared with the float32 path

namespace {

// Multiply-adds below which a layer is merged on one thread: K = 3 models of a 128 x 128
// layer (8.4e6) stay below it, of a 256 x 256 layer (6.7e7) do not. Chosen, not tuned.
constexpr double kSerialWork = 2e7;
constexpr double kFloat64Roundoff = 0x1.0p-52;  // as the spectral solve's threshold

// W_M^T (d_in x d_out, column-major) into merged_t, from models whose shapes are checked
// (opt.n_threads too).
RegMeanInfo merge_transposed(const std::vector<RegMeanModel>& models, Index d_in, Index d_out,
                             const std::vector<double>& coefficients, WeightLayout layout,
                             Precision mode, double noise_floor, const SolveOptions& opt,
                             MatrixXd& merged_t) {
  RegMeanInfo info;
  PhaseLog phases(info);
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
  phases.lap("checks");

  // W-^T = W_p^T + sum_{i != p} (c_i / C) (W_i - W_p)^T: exactly W_p^T where all agree.
  // The spread max_i max |W_i - W-| / max |W-| is taken on the way.
  PooledMatrixXd mean_t(d_in, d_out);
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
  phases.lap("average");
  if (spread == 0.0) {  // equal in every model: nothing to solve
    info.precision = "identical";
    merged_t = mean_t;
    return info;
  }

  // lhs = sum_i s_i G_i (lower triangle), s_i = c_i / n_i, one column a task.
  std::vector<double> s(k);
  for (size_t i = 0; i < k; ++i) s[i] = coef[i] / models[i].count;
  PooledMatrixXd lhs(d_in, d_in);
  std::vector<GramSource> grams(k);
  for (size_t i = 0; i < k; ++i) grams[i] = models[i].gram;
  sum_lower(grams, s, threads, lhs);
  phases.lap("system");
  SolveOptions solve_opt = opt;
  solve_opt.n_threads = threads;
  const double alpha = opt.alpha;
  // Layers large enough to be threaded try float32 under "auto", then the float32
  // right-hand side with the float64 factorization ("float32-rhs"), then float64.
  const bool large = mode == Precision::Auto && work >= kSerialWork;
  Float32Merge f32{models, coef,   s,      pivot, others,      d_in,
                   d_out,  layout, mean_t, lhs,   noise_floor, alpha};
  if ((mode == Precision::Float32 || large) &&
      f32.run(solve_opt, mode == Precision::Float32, info, merged_t)) {
    return info;
  }
  info.output_error_estimate = 0.0;
  phases.restart();

  PooledMatrixXd l(d_in, d_in);
  static_cast<SolveInfo&>(info) = spd_factor(lhs, l, solve_opt);
  // The condition estimate at every size: a few solves with one vector, O(d^2) each
  // against the factorization's O(d^3) (measured on 2 loaded Zen 4 cores: 0.034 s against
  // the factorization's 0.52 s at d_in = 3072, 0.19 s against 7.3 s at 8192).
  const double norm1 = symmetric_norm1(d_in, alpha, info.ridge_absolute, threads,
                                       [&](Index j, double*) { return &lhs(j, j); });
  info.condition_estimate = norm1 * inverse_norm1_estimate(l);
  // Below the statistics' noise floor: eigendirections of the system whose eigenvalue the
  // Grams' own rounding could have made (or unmade) are solved as unseen, keeping the
  // average. Only systems with a pivot near the floor (or that needed a ridge) can have
  // such directions worth the eigendecomposition: every eigenvalue is <= the smallest
  // squared pivot.
  const double floor = noise_floor * std::sqrt(static_cast<double>(d_in)) * info.mean_diagonal;
  PooledMatrixXd system;
  const auto form_system = [&] {
    system.resize(d_in, d_in);
    system.triangularView<Eigen::Lower>() = lhs;
    reduce_lower_triangle(system, alpha);
    system.diagonal().array() += opt.ridge * info.mean_diagonal;
  };
  if (floor > 0.0 &&
      (info.escalated || info.min_pivot * info.min_pivot <= kNoiseFloorTrigger * floor)) {
    form_system();
    if (!info.escalated) {
      // Sylvester's law of inertia: system - t I has a Cholesky factor exactly when every
      // eigenvalue exceeds t (up to rounding of the order of the threshold's own 2^-52
      // term). With t the spectral solve's threshold (floor + sqrt(d_in) x 2^-52 x the
      // largest eigenvalue, bounded by the system's 1-norm), a factorization that succeeds
      // shows that no direction is below the floor: the solve needs no eigendecomposition
      // (d_in^3 / 3 flops instead of about 9 d_in^3).
      system.diagonal().array() -=
          floor + std::sqrt(static_cast<double>(d_in)) * kFloat64Roundoff * norm1;
      if (blocked_cholesky(system, info.mean_diagonal, threads) == -1) {
        system.resize(0, 0);
      } else {
        form_system();  // (overwritten by the attempt)
      }
    }
  }
  info.precision = "float64";
  phases.lap("factor64");
  // The float32 right-hand side where float32 came near: after the a-priori predictor's
  // refusal (the layer far from float32's tolerance) it seldom certifies either, and its
  // inputs (the Gram differences) would cost what the predictor spared (measured on
  // statistics of copies 8 % apart: 27 of 40 such layers refused it).
  if (system.size() == 0 &&
      (mode == Precision::Float32Rhs || (large && !f32.predicted_far))) {
    if (f32.rhs32(l, info.ridge_absolute, threads, mode == Precision::Float32Rhs, info, merged_t)) {
      return info;
    }
    phases.restart();
  }

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
  phases.lap("products64");
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
  phases.lap("solve64");
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
  PooledMatrixXd merged_t(d_in, d_out);
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
