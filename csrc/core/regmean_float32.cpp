#include "core/regmean_float32.hpp"

#include <algorithm>
#include <cmath>
#include <limits>

#include "core/parallel.hpp"
#include "core/phases.hpp"
#include "core/reduction.hpp"
#include "core/workspace.hpp"

LMDX_NAMESPACE_BEGIN

namespace detail {

namespace {

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
// The a-priori predictor of "auto": a layer whose
//   kPredictorFactor x 2^-24 x relative spread x (largest / smallest float32 pivot)
//     x min(1, delta / kPredictorDelta),
// delta = max_{j, r} |D_j[r, r]| / A[r, r] (the Gram differences' diagonal relative to the
// system's), exceeds kOutputErrorTolerance goes to float64 before the deviations, the
// Gram differences and the pre-check (most of what an uncertifiable layer costs), and
// before the rest of the float32 factorization: everything but the pivot ratio is known
// beforehand, and the factorization stops as soon as the pivots of its diagonal blocks so
// far exceed the ratio the tolerance allows (the ratio over all pivots can only be larger,
// so it refuses exactly the layers the whole factor would). Any rejection is safe (the
// float64 path is exact); acceptance still needs the certificate. The certificate's
// estimate scales with the deviations' spread and vanishes with the Gram differences (the
// right-hand side does). On
// BERT-base-sized layers (48 systems, alpha 0.9, deviations 1 % and 10 %, delta 0.15-0.93)
// it was 25-130 times u32 x spread x pivot ratio (the same at both deviations): the factor
// 24 stays below all of them, so there the predictor rejected nothing the certificate
// accepted (and 24 of the 40 layers it refused at 10 %).
constexpr double kPredictorFactor = 24.0;
constexpr double kPredictorDelta = 0.1;
constexpr double kFloat32Roundoff = 0x1.0p-24;
// Up to this many Gram differences (K <= 3 models) are held in float32 side by side for the
// one product [D_1 .. D_m] [dev_1; ..; dev_m] (4 m d_in^2 bytes). More are not held: their
// rows are formed a second time, block by block, after the pre-check (the memory no longer
// grows with K; the second formation costs m d_in^2 reads of the Grams).
constexpr Index kHeldDifferences = 2;
// The float32 right-hand side's predictor: its products' rounding modelled as independent
// errors of size 2^-24 |D_j| |W_j - W-| per entry, signs random, on the probes: with
// w = s o (sum_j |D_j| |W_j - W-|^T |z|) (s random signs), 2^-24 sqrt(w . A^{-1} w) /
// ||W_M z||_S (the bound itself in float32: Float32Merge::rounding_bound, formed only when
// the tier is tried). Measured against the float32-rhs certificate on 28 BERT-base-sized systems
// (statistics of copies 1.6 % and 8 % apart, and the 1.6 % ones with deviations re-derived
// at 5 %), the certificate was 0.022-0.062 times this; kRhsPredictorFactor stays below all
// of them, so there no certifiable layer was refused. A layer predicted above the tolerance
// goes to the float64 products before the float32 ones.
constexpr double kRhsPredictorFactor = 0.02;

// x32 z in float64 (d_in x kProbes), by fixed blocks of rows: the probes of a float32
// right-hand side or solution.
MatrixXd probes_of(const Eigen::MatrixXf& x32, const MatrixXd& z, int threads) {
  const Index d_in = x32.rows();
  const Index row_block = column_block_width(d_in);
  const Index n_row_blocks = (d_in + row_block - 1) / row_block;
  MatrixXd xz(d_in, z.cols());
  LMDX_PRAGMA(omp parallel for num_threads(threads) schedule(dynamic, 1))
  for (Index rb = 0; rb < n_row_blocks; ++rb) {
    const Index r0 = rb * row_block;
    const Index h = std::min(row_block, d_in - r0);
    xz.middleRows(r0, h).noalias() = x32.middleRows(r0, h).cast<double>() * z;
  }
  return xz;
}

// The certified estimate of a relative output error: the margin times ||E Z||_A over
// ||W_M Z||_S (from its square); 0 where there is no error.
double certified_estimate(double error_norm, double merged_norm2) {
  if (!(error_norm > 0.0)) return 0.0;
  return merged_norm2 > 0.0 ? kCertificateMargin * error_norm / std::sqrt(merged_norm2)
                            : std::numeric_limits<double>::max();
}

}  // namespace

MatrixXd Float32Merge::system_times(const MatrixXd& v, double ridge, int threads) const {
  MatrixXd out;
  multiply_symmetric_lower(lhs, v, out, threads);
  finish_reduced_product(lhs.diagonal(), v, alpha, ridge, out);
  return out;
}

MatrixXd Float32Merge::solve32(const Eigen::MatrixXf& l32, const MatrixXd& r, int threads) {
  const double scale = r.cwiseAbs().maxCoeff();
  if (!(scale > 0.0)) return MatrixXd::Zero(r.rows(), r.cols());
  Eigen::MatrixXf x = (r / scale).cast<float>();
  cholesky_solve_in_place(l32, x, threads);
  return x.cast<double>() * scale;
}

double Float32Merge::s_norm2(const MatrixXd& u, const MatrixXd& au, double ridge) {
  return u.cwiseProduct(au).sum() - ridge * u.squaredNorm();
}

double Float32Merge::factor_error_estimate(const Eigen::MatrixXf& l32, double ridge,
                                           int threads) {
  x_probe = solve32(l32, bz, threads);
  probe_ridge = ridge;
  multiply_rows(mean_t, z, mean_z, false, threads);
  MatrixXd v(d_in, 2 * kProbes);
  v.leftCols(kProbes) = x_probe;
  v.rightCols(kProbes) = mean_z;
  const MatrixXd av = system_times(v, ridge, threads);
  a_x = av.leftCols(kProbes);
  a_mean_z = av.rightCols(kProbes);
  const double merged_norm2 = s_norm2(mean_z + x_probe, a_mean_z + a_x, ridge);
  res = a_x - bz;
  e_probe = solve32(l32, res, threads);
  a_e = system_times(e_probe, ridge, threads);
  e_norm2 = std::max(e_probe.cwiseProduct(a_e).sum(), 0.0);
  return certified_estimate(std::sqrt(e_norm2), merged_norm2);
}

double Float32Merge::predictor_scale(double spread) const {
  double delta = 0.0;
  const double t = 1.0 / models[pivot].count;
  for (Index r = 0; r < d_in; ++r) {
    if (!(lhs(r, r) > 0.0)) continue;  // an input no model saw: no difference either
    const double p = models[pivot].gram.lower_column(r)[0];
    for (size_t i : others) {
      const double diff = s[i] * models[i].gram.lower_column(r)[0] - coef[i] * t * p;
      delta = std::max(delta, std::abs(diff) / lhs(r, r));
    }
  }
  return kPredictorFactor * kFloat32Roundoff * spread * std::min(1.0, delta / kPredictorDelta);
}

void Float32Merge::form_rhs_inputs(int threads, PhaseLog& phases) {
  if (rhs_formed) return;
  // The deviations, once: y_j = (W_j - W-)^T z in float64 for the probes, and rounded to
  // float32 into rows [j d_in, (j + 1) d_in) of dev32.
  const Index m = static_cast<Index>(others.size());
  z = gaussian_probes(d_out, kProbes);
  y = MatrixXd::Zero(d_in, m * kProbes);
  dev32.resize(m * d_in, d_out);
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
  phases.lap("deviations");
  // The Gram differences by tiles of rows: B z = sum_j D_j y_j in float64 (each tile owns
  // its rows of B z, summed over j in order); with m <= kHeldDifferences, D_j also rounded
  // into diff32's columns [j d_in, (j + 1) d_in).
  const bool held = m <= kHeldDifferences;
  bz = MatrixXd::Zero(d_in, kProbes);
  diff32.resize(held ? d_in : 0, held ? m * d_in : 0);
  {
    const Index n_tiles = (d_in + kTile - 1) / kTile;
    LMDX_PRAGMA(omp parallel num_threads(threads)) {
      MatrixXd t(kTile, d_in);
      LMDX_PRAGMA(omp for schedule(dynamic, 1))
      for (Index tile = 0; tile < n_tiles; ++tile) {
        const Index r0 = tile * kTile, h = std::min(kTile, d_in - r0);
        for (Index j = 0; j < m; ++j) {
          difference_rows(models, s, coef, others[j], pivot, alpha, r0, h, t);
          bz.middleRows(r0, h).noalias() += t.topRows(h) * y.middleCols(j * kProbes, kProbes);
          if (held) diff32.block(r0, j * d_in, h, d_in) = t.topRows(h).cast<float>();
        }
      }
    }
  }
  rhs_formed = true;
  phases.lap("differences");
}

MatrixXd Float32Merge::rounding_bound(int threads) const {
  // u = [|W_j - W-|^T |z|] stacked (m d_in x kProbes), then sum_j |D_j| u_j by tiles of rows;
  // in float32 (a bound's size is all the predictor needs), from dev32 and diff32 where
  // held, otherwise from the differences formed again (float64 tiles).
  const Index m = static_cast<Index>(others.size());
  const Eigen::MatrixXf z_abs = z.cwiseAbs().cast<float>();
  Eigen::MatrixXf u(m * d_in, kProbes);
  const Index n_dev_tiles = (m * d_in + kTile - 1) / kTile;
  LMDX_PRAGMA(omp parallel for num_threads(threads) schedule(dynamic, 1))
  for (Index tile = 0; tile < n_dev_tiles; ++tile) {
    const Index r0 = tile * kTile, h = std::min(kTile, m * d_in - r0);
    u.middleRows(r0, h).noalias() = dev32.middleRows(r0, h).cwiseAbs() * z_abs;
  }
  const MatrixXd u64 = diff32.size() > 0 ? MatrixXd() : MatrixXd(u.cast<double>());
  MatrixXd bound(d_in, kProbes);
  const Index n_tiles = (d_in + kTile - 1) / kTile;
  LMDX_PRAGMA(omp parallel num_threads(threads)) {
    MatrixXd t(diff32.size() > 0 ? 0 : kTile, d_in);
    LMDX_PRAGMA(omp for schedule(dynamic, 1))
    for (Index tile = 0; tile < n_tiles; ++tile) {
      const Index r0 = tile * kTile, h = std::min(kTile, d_in - r0);
      if (diff32.size() > 0) {
        bound.middleRows(r0, h) = (diff32.middleRows(r0, h).cwiseAbs() * u).cast<double>();
        continue;
      }
      bound.middleRows(r0, h).setZero();
      for (Index j = 0; j < m; ++j) {
        difference_rows(models, s, coef, others[j], pivot, alpha, r0, h, t);
        bound.middleRows(r0, h).noalias() +=
            t.topRows(h).cwiseAbs() * u64.middleRows(j * d_in, d_in);
      }
    }
  }
  return bound;
}

void Float32Merge::products32(int threads, Eigen::MatrixXf& x32) {
  // rhs = sum_j D_j (W_j - W-)^T in float32, by fixed blocks of rows: held, one product
  // [D_1 .. D_m] [dev_1; ..; dev_m]; otherwise for each j the block's rows of D_j formed
  // again (float64 tiles of kTile rows, rounded into a float32 block of rows) and
  // multiplied by dev_j, summed over j in order.
  const Index m = static_cast<Index>(others.size());
  const Index row_block = column_block_width(d_in);
  const Index n_row_blocks = (d_in + row_block - 1) / row_block;
  if (diff32.size() > 0) {
    LMDX_PRAGMA(omp parallel for num_threads(threads) schedule(dynamic, 1))
    for (Index rb = 0; rb < n_row_blocks; ++rb) {
      const Index r0 = rb * row_block;
      const Index h = std::min(row_block, d_in - r0);
      x32.middleRows(r0, h).noalias() = diff32.middleRows(r0, h) * dev32;
    }
  } else {
    const int block_threads = static_cast<int>(std::min<Index>(threads, n_row_blocks));
    LMDX_PRAGMA(omp parallel num_threads(block_threads)) {
      MatrixXd t(kTile, d_in);
      Eigen::MatrixXf rows32(row_block, d_in);
      LMDX_PRAGMA(omp for schedule(dynamic, 1))
      for (Index rb = 0; rb < n_row_blocks; ++rb) {
        const Index r0 = rb * row_block;
        const Index h = std::min(row_block, d_in - r0);
        auto out = x32.middleRows(r0, h);
        for (Index j = 0; j < m; ++j) {
          for (Index k0 = 0; k0 < h; k0 += kTile) {
            const Index th = std::min(kTile, h - k0);
            difference_rows(models, s, coef, others[j], pivot, alpha, r0 + k0, th, t);
            rows32.middleRows(k0, th) = t.topRows(th).cast<float>();
          }
          const auto dev_j = dev32.middleRows(j * d_in, d_in);
          if (j == 0) {
            out.noalias() = rows32.topRows(h) * dev_j;
          } else {
            out.noalias() += rows32.topRows(h) * dev_j;
          }
        }
      }
    }
  }
  diff32.resize(0, 0);
  dev32.resize(0, 0);
  rhs_formed = false;  // (a later products32 forms them again)
}

bool Float32Merge::rhs32(const MatrixXd& l, double ridge, int threads, bool forced,
                         RegMeanInfo& info, MatrixXd& merged_t) {
  PhaseLog phases(info);
  // B_32 kept in merged_t by the float32 attempt (its final certificate refused it): the
  // products are paid for, so neither the predictor nor the products run again.
  const bool kept = rhs_in_merged;
  rhs_in_merged = false;
  if (!kept) form_rhs_inputs(threads, phases);
  // The merged weight on the probes: W_M z = W- z + A^{-1} B z, A W_M z = A W- z + B z.
  MatrixXd solved(d_in, 3 * kProbes);
  solved.middleCols(kProbes, kProbes) = bz;
  if (!kept) {
    // The predictor's w: random signs on |B| z's bound (fixed, as the probes).
    const MatrixXd signs = gaussian_probes(d_in, kProbes);
    solved.rightCols(kProbes) = rounding_bound(threads).cwiseProduct(
        signs.unaryExpr([](double v) { return v < 0.0 ? -1.0 : 1.0; }));
  }
  const MatrixXd w_sign = solved.rightCols(kProbes);
  if (kept) {
    cholesky_solve_in_place(l, solved.middleCols(kProbes, kProbes), threads);
  } else {
    cholesky_solve_in_place(l, solved.rightCols(2 * kProbes), threads);
  }
  if (mean_z.size() == 0) multiply_rows(mean_t, z, mean_z, false, threads);
  if (a_mean_z.size() == 0 || !(probe_ridge == ridge)) {
    a_mean_z = system_times(mean_z, ridge, threads);  // (the float64 ridge escalated)
  }
  const double merged_norm2 =
      s_norm2(mean_z + solved.middleCols(kProbes, kProbes), a_mean_z + bz, ridge);
  if (!forced && !kept) {
    const double w_norm2 = std::max(w_sign.cwiseProduct(solved.rightCols(kProbes)).sum(), 0.0);
    const double scale = kRhsPredictorFactor * kFloat32Roundoff;
    const double predicted = merged_norm2 > 0.0 ? scale * std::sqrt(w_norm2 / merged_norm2)
                                                : std::numeric_limits<double>::max();
    if (predicted > kOutputErrorTolerance) {
      phases.lap("rhs_predictor");
      return false;  // the float32 products would not certify: float64 ones at once
    }
  }
  PooledMatrixXf x32(d_in, d_out);
  if (kept) {
    x32 = merged_t.cast<float>();  // (exactly: merged_t holds B_32's values)
  } else {
    products32(threads, x32);
  }
  const MatrixXd b32z = probes_of(x32, z, threads);  // B_32 z, exactly
  phases.lap("products32");
  // The certificate, before the solve it spares where it fails. E = A^{-1} (B_32 - B) (the
  // float64 solve's own rounding aside), so on the probes E z = A^{-1} r with
  // r = B_32 z - B z, and ||E z||_A^2 = r . A^{-1} r.
  solved.leftCols(kProbes) = b32z - bz;
  cholesky_solve_in_place(l, solved.leftCols(kProbes), threads);
  const double e_norm2 = std::max((b32z - bz).cwiseProduct(solved.leftCols(kProbes)).sum(), 0.0);
  const double estimate = certified_estimate(std::sqrt(e_norm2), merged_norm2);
  phases.lap("certificate");
  if (!forced && !(estimate <= kOutputErrorTolerance)) return false;
  LMDX_PRAGMA(omp parallel for num_threads(threads) schedule(static))
  for (Index c = 0; c < d_out; ++c) merged_t.col(c) = x32.col(c).cast<double>();
  x32.resize(0, 0);
  cholesky_solve_in_place(l, merged_t, threads);
  phases.lap("solve64");
  merged_t += mean_t;
  info.precision = "float32-rhs";
  info.output_error_estimate = estimate;
  return true;
}

bool Float32Merge::run(const SolveOptions& opt, bool forced, RegMeanInfo& info,
                       MatrixXd& merged_t) {
  PhaseLog phases(info);
  const int threads = opt.n_threads;
  const double mean_diagonal = lhs.diagonal().mean();
  if (!(opt.ridge >= 0.0) || !std::isfinite(opt.ridge) || !(mean_diagonal > 0.0) ||
      !std::isfinite(mean_diagonal)) {
    return false;  // the float64 path reports it
  }
  const double ridge = opt.ridge * mean_diagonal;
  PooledMatrixXf l32(d_in, d_in);
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
  // The predictor's bound on the pivot ratio, known before the factorization: the
  // factorization stops as soon as the pivots so far exceed it.
  const double scale = forced ? 0.0 : predictor_scale(info.relative_spread);
  const double max_ratio = scale > 0.0 ? kOutputErrorTolerance / scale : INFINITY;
  phases.lap("convert32");
  const Index factored = blocked_cholesky(l32, mean_diagonal, threads, nullptr, max_ratio);
  if (factored >= 0) return false;
  phases.lap("factor32");
  if (factored == kPivotRatioExceeded) {
    phases.lap("predictor");
    predicted_far = true;
    return false;  // predicted above the tolerance: float64 before the expensive phases
  }
  // Directions near the noise floor: the float64 path decides which are unseen.
  const double smallest = l32.diagonal().minCoeff();
  const double floor = noise_floor * std::sqrt(static_cast<double>(d_in)) * mean_diagonal;
  if (floor > 0.0 && smallest * smallest <= kNoiseFloorTrigger * floor) return false;

  form_rhs_inputs(threads, phases);
  if (factor_error_estimate(l32, ridge, threads) > kOutputErrorTolerance &&
      !forced) {
    phases.lap("precheck");
    return false;  // the factor alone already exceeds the tolerance: float64 at once
  }
  phases.lap("precheck");

  PooledMatrixXf x32(d_in, d_out);
  products32(threads, x32);
  // Kept for the float32-rhs tier should the final certificate refuse this attempt (moved
  // into merged_t then).
  PooledMatrixXf b32;
  if (!forced && !others.empty()) {
    b32.resize(d_in, d_out);
    b32 = x32;
  }
  phases.lap("products32");
  cholesky_solve_in_place(l32, x32, threads);
  phases.lap("solve32");

  // merged = W- + X; probes of X (those of W- and A W- z are the pre-check's).
  LMDX_PRAGMA(omp parallel for num_threads(threads) schedule(static))
  for (Index c = 0; c < d_out; ++c) merged_t.col(c) = mean_t.col(c) + x32.col(c).cast<double>();
  // E z = X_32 z - X_64 z = (X_32 z - x) + (x - X_64 z): the first part exactly, the
  // second the pre-check's e, refined once against res (A (x - X_64 z) = res). The system
  // multiplies X_32 z and the refinement's correction together.
  MatrixXd v(d_in, 2 * kProbes);
  v.leftCols(kProbes) = probes_of(x32, z, threads);
  v.rightCols(kProbes) = solve32(l32, res - a_e, threads);
  const MatrixXd av = system_times(v, ridge, threads);
  const auto xz = v.leftCols(kProbes), correction = v.rightCols(kProbes);
  const auto axz = av.leftCols(kProbes), ac = av.rightCols(kProbes);
  const double merged_norm2 = s_norm2(mean_z + xz, a_mean_z + axz, ridge);
  const MatrixXd first = xz - x_probe + e_probe;
  const MatrixXd a_first = axz - a_x + a_e;
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
  const double estimate = certified_estimate(error_norm, merged_norm2);

  info.ridge = opt.ridge;
  info.ridge_absolute = ridge;
  info.mean_diagonal = mean_diagonal;
  info.attempts = 1;
  info.escalated = false;
  info.min_pivot = l32.diagonal().minCoeff();
  info.max_pivot = l32.diagonal().maxCoeff();
  const double ratio = info.min_pivot / info.max_pivot;
  info.rcond_estimate = ratio * ratio;
  info.condition_estimate =
      symmetric_norm1(d_in, alpha, ridge, threads, [&](Index j, double*) { return &lhs(j, j); }) *
      inverse_norm1_estimate(l32);
  info.output_error_estimate = estimate;
  info.precision = "float32";
  phases.lap("certificate");
  const bool accepted = forced || (rho <= kMaxContraction && estimate <= kOutputErrorTolerance);
  if (!accepted && b32.size() > 0) {
    LMDX_PRAGMA(omp parallel for num_threads(threads) schedule(static))
    for (Index c = 0; c < d_out; ++c) merged_t.col(c) = b32.col(c).cast<double>();
    rhs_in_merged = true;
  }
  return accepted;
}

}  // namespace detail

LMDX_NAMESPACE_END
