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

/// Merge one layer of K models. `grams`: K float64 views of shape (d_in, d_in), symmetric;
/// `weights`: K float32/float64 views, [out, in] for layout "linear" (torch nn.Linear) or
/// [in, out] for "conv1d" (Hugging Face GPT-2 Conv1D); `counts`: K row counts n_i > 0;
/// `coefficients`: empty (all 1) or K values >= 0, not all 0. Messages start with opt.name.
/// `out` has room for weights[0].size() values and receives the merged weight W_M in the
/// layout of the inputs (row-major).
SolveInfo regmean_merge_layer(const std::vector<ArrayView>& grams,
                              const std::vector<ArrayView>& weights,
                              const std::vector<double>& counts,
                              const std::vector<double>& coefficients, const std::string& layout,
                              const SolveOptions& opt, double* out);

LMDX_NAMESPACE_END
