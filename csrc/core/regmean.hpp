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
// for a pivot model p. Those products may run in float32 where an estimate of the error
// they cause stays below kFloat32Tolerance (precision "auto", layers large enough to be
// threaded); the factorization and the solve are always float64.
#pragma once

#include <string>
#include <vector>

#include "core/arrays.hpp"
#include "core/spd.hpp"

LMDX_NAMESPACE_BEGIN

/// Relative error (max |W - W_float64| / max |W_float64|, estimated) that float32
/// right-hand-side products may add to a merged layer under precision "auto".
constexpr double kFloat32Tolerance = 1e-6;

/// What the solver did for one layer, and how its right-hand side was computed.
struct RegMeanInfo : SolveInfo {
  /// "float64", "float32" (right-hand-side products; factorization and solve float64), or
  /// "identical" (the weights are equal in every model: returned as they are, no solve).
  std::string precision = "float64";
  /// Estimate of the 1-norm condition number of the regularized system (0: not estimated;
  /// always estimated up to 1024 inputs, beyond only where float32 products are considered).
  double condition_estimate = 0.0;
  /// Estimated relative error of float32 products (0: not needed, products in float64
  /// because the pivots alone already exceed the tolerance, or the weights are identical).
  double float32_error_estimate = 0.0;
  /// max_i max |W_i - W-| / max |W-|: how far the models are from their average.
  double relative_spread = 0.0;
};

/// Merge one layer of K models. `grams`: K float64 views, each either (d_in, d_in) and
/// symmetric or (d_in (d_in + 1) / 2,), the upper triangle packed row by row (as statistics
/// files store it); `weights`: K float32/float64 views, [out, in] for layout "linear"
/// (torch nn.Linear) or [in, out] for "conv1d" (Hugging Face GPT-2 Conv1D); `counts`: K row
/// counts n_i > 0; `coefficients`: empty (all 1) or K values >= 0, not all 0; `precision`:
/// "auto" or "float64". Messages start with opt.name. `out` has room for weights[0].size()
/// values and receives the merged weight W_M in the layout of the inputs (row-major).
RegMeanInfo regmean_merge_layer(const std::vector<ArrayView>& grams,
                                const std::vector<ArrayView>& weights,
                                const std::vector<double>& counts,
                                const std::vector<double>& coefficients, const std::string& layout,
                                const std::string& precision, const SolveOptions& opt,
                                double* out);

LMDX_NAMESPACE_END
