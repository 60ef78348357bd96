// Argument checks shared by the kernels. They run before any parallel region and throw
// std::invalid_argument (ValueError in Python) naming the argument.
#pragma once

#include <string>
#include <vector>

#include "core/config.hpp"

LMDX_NAMESPACE_BEGIN

/// Index of the first non-finite value in x[0..n), or -1. Threaded.
template <typename T>
Index first_nonfinite(const T* x, Index n, int n_threads);

/// Throw std::invalid_argument("<what>: ...") if x[0..n) holds NaN or Inf; `cols` > 0
/// reports the position as (row, column) of a row-major matrix with that many columns.
template <typename T>
void require_finite(const T* x, Index n, Index cols, const std::string& what, int n_threads);

/// Throw std::invalid_argument("<what>: not symmetric ...") unless the d x d matrix at g
/// equals its transpose to 1e-12 relative to its largest entry.
void require_symmetric(const double* g, Index d, const std::string& what, int n_threads = 1);

/// Shared validation for per-model coefficients; returns them (all 1 when empty). Error
/// messages start with `prefix`.
std::vector<double> checked_coefficients(const std::vector<double>& coefficients, size_t k,
                                         const std::string& prefix = "");

LMDX_NAMESPACE_END
