// RegMean merge of one linear layer (Jin et al., ICLR 2023, arXiv 2212.09849).
//
// For K models with input Gram G_i, row count n_i, weight W_i and coefficient c_i:
//   G^_i = G_i / n_i,   G~_i = alpha G^_i + (1 - alpha) diag(G^_i)
//   W_M^T = (sum_i c_i G~_i)^{-1} sum_i c_i G~_i W_i^T
// It is solved for the deviation from the coefficient-weighted average W- = sum c_i W_i / C:
//   W_M^T = W-^T + (sum_i c_i G~_i + ridge I)^{-1} sum_i c_i G~_i (W_i - W-)^T
// -- the same where the sum is positive definite, but a model merged with itself and layers
// equal in every model come back bit-exact, and directions no statistics reached keep the
// average instead of being pulled to zero by a ridge. Since sum_i c_i (W_i - W-) = 0, the
// right-hand side needs K - 1 products: sum_{i != p} c_i (G~_i - G~_p) (W_i - W-)^T
// for a pivot model p.
//
// Precision "float64" factors, multiplies and solves in float64 (the weight error against
// the formula stays far below 1e-6). "auto" (layers large enough to be threaded) and
// "float32" do all three in float32, then estimate the relative OUTPUT error
// ||E||_S / ||W_M||_S (S = sum_i c_i G~_i, ||A||_S^2 = tr(A S A^T), E the difference to the
// float64 formula) from float64 residuals on a few random probe columns; "auto" keeps the
// float32 result only where that certificate is <= kOutputErrorTolerance and redoes the
// layer in float64 otherwise (and wherever the float32 factorization fails). Between the
// two, "auto" (and "float32-rhs", forced) keeps the float32 right-hand side with the float64
// factorization and solve where float32 came near (not after the a-priori predictor's
// refusal): its error A^{-1} (B_32 - B) is known exactly on the probes (the float32
// factor's error, which the float32 path must also bound and which dominates it, is
// absent), certified the same way; float64 products where that fails too.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "core/arrays.hpp"
#include "core/spd.hpp"

LMDX_NAMESPACE_BEGIN

/// Relative output error ||W - W_float64||_S / ||W_float64||_S up to which precision "auto"
/// keeps a layer merged in float32.
constexpr double kOutputErrorTolerance = 1e-6;

/// What the solver did for one layer, and in which precision.
struct RegMeanInfo : SolveInfo {
  /// "float64", "float32" (factorization, right-hand side and solve), "float32-rhs" (the
  /// right-hand side's products in float32, factorization and solve in float64), or
  /// "identical" (the weights are equal in every model: returned as they are, no solve).
  std::string precision = "float64";
  /// Estimate of the 1-norm condition number of the regularized system (0: not estimated,
  /// "identical": nothing was solved).
  double condition_estimate = 0.0;
  /// Certified estimate (safety margin included) of the relative output error
  /// ||W - W_float64||_S / ||W_float64||_S of a float32 or float32-rhs merge; 0 for
  /// "float64" (exact to float64 rounding) and "identical".
  double output_error_estimate = 0.0;
  /// max_i max |W_i - W-| / max |W-|: how far the models are from their average.
  double relative_spread = 0.0;
  /// Eigendirections of the system below the statistics' noise floor, solved as unseen
  /// (they keep the average); 0 where none were looked for or found.
  int unseen_directions = 0;
  /// The phases of the merge in the order first entered: the path it took.
  std::vector<std::string> phases;
  /// Wall time per phase in seconds, in the order first entered (a phase entered again
  /// accumulates), in a build with LMDX_PROFILE only (benchmarks); empty otherwise.
  std::vector<std::pair<std::string, double>> timings;
};

/// Merge one layer of K models. `grams`: K float64 views, each either (d_in, d_in) and
/// symmetric or (d_in (d_in + 1) / 2,), the upper triangle packed row by row (as statistics
/// files store it); `weights`: K float32/float64 views, [out, in] for layout "linear"
/// (torch nn.Linear) or [in, out] for "conv1d" (Hugging Face GPT-2 Conv1D); `counts`: K row
/// counts n_i > 0; `coefficients`: empty (all 1) or K values >= 0, not all 0; `precision`:
/// "auto", "float32", "float32-rhs" or "float64"; `noise_floor`: the relative rounding of the
/// Grams' entries (their accumulation precision: 2^-24 for float32 products summed in float64,
/// 2^-53 for float64; 0: exact Grams), in [0, 1): eigendirections of the system with an
/// eigenvalue <= sqrt(d_in) x (noise_floor x its mean diagonal + 2^-52 x its largest
/// eigenvalue) keep the average (an eigendecomposition, only for systems whose
/// factorization shows a pivot near that floor or needs a ridge). Messages start with
/// opt.name. `out` has room for
/// weights[0].size() values and receives the merged weight W_M in the layout of the inputs
/// (row-major).
RegMeanInfo regmean_merge_layer(const std::vector<ArrayView>& grams,
                                const std::vector<ArrayView>& weights,
                                const std::vector<double>& counts,
                                const std::vector<double>& coefficients, const std::string& layout,
                                const std::string& precision, double noise_floor,
                                const SolveOptions& opt, double* out);

/// The RegMean solve of K low-rank updates A_i of one base (merge/lora.py): with
/// S = sum_i c_i G~_i + ridge I (the ridge as spd_solve chooses it), F (d_in x R, R the sum
/// of the ranks r_i of the models with c_i > 0, in model order) =
///   S^{-1} [c_1 G~_1 A_1^T .. c_K G~_K A_K^T] + ridge S^{-1} [c_1 A_1^T / C .. c_K A_K^T / C],
/// C = sum_i c_i, G~_i reduced by alpha as for regmean_merge_layer (the same helper).
/// `factors`: K float64 views (r_i, d_in); `grams`, `counts`, `coefficients` as for
/// regmean_merge_layer. Returns the factorization's SolveInfo.
SolveInfo regmean_low_rank_solve(const std::vector<ArrayView>& grams,
                                 const std::vector<ArrayView>& factors,
                                 const std::vector<double>& counts,
                                 const std::vector<double>& coefficients, const SolveOptions& opt,
                                 MatrixXd& f);

LMDX_NAMESPACE_END
