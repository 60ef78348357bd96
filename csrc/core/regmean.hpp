// RegMean merge of one linear layer (Jin et al., ICLR 2023, arXiv 2212.09849).
//
// For K models with input Gram G_i, row count n_i, weight W_i and coefficient c_i:
//   G^_i = G_i / n_i,   G~_i = alpha G^_i + (1 - alpha) diag(G^_i)
//   W_M^T = (sum_i c_i G~_i)^{-1} sum_i c_i G~_i W_i^T
// The reduced Grams are never formed: with s_i = c_i / n_i,
//   lhs = offdiag-reduce_alpha(sum_i s_i G_i)
//   rhs = sum_i s_i (alpha G_i W_i^T + (1 - alpha) diag(G_i) W_i^T)
// and the system is solved by the regularized Cholesky solver (spd.hpp).
#pragma once

#include <string>
#include <vector>

#include "core/arrays.hpp"
#include "core/spd.hpp"

LMDX_NAMESPACE_BEGIN

enum class WeightLayout {
  Linear,  // torch nn.Linear: weight is [out, in]
  Conv1D,  // Hugging Face GPT-2 Conv1D: weight is [in, out]
};

struct RegMeanModel {
  const double* gram = nullptr;  // d_in x d_in, symmetric, row-major (either order works)
  double count = 0.0;            // n_i: rows (tokens) the Gram was accumulated over
  ArrayView weight;              // [out, in] (Linear) or [in, out] (Conv1D), row-major
};

struct RegMeanResult {
  MatrixXd merged_t;  // d_in x d_out (column-major), i.e. W_M^T
  SolveInfo info;
};

/// Merge one layer. `coefficients` is empty (all 1) or K non-negative values, not all 0.
RegMeanResult regmean_merge(const std::vector<RegMeanModel>& models, Index d_in, Index d_out,
                            const std::vector<double>& coefficients, WeightLayout layout,
                            const SolveOptions& opt);

LMDX_NAMESPACE_END
