// Element-wise averages of K same-shaped tensors, accumulated in float64.
//   weighted_average: out = sum_i c_i x_i / sum_i c_i
//   fisher_average:   out = sum_i c_i (F_i + eps) x_i / sum_i c_i (F_i + eps)
// (Fisher-weighted averaging, Matena & Raffel 2022; the RegMean paper's baseline.)
#pragma once

#include <vector>

#include "core/arrays.hpp"

LMDX_NAMESPACE_BEGIN

/// `tensors`: K >= 1 views of one shape, finite; `coefficients` is empty (all 1) or K
/// values >= 0, not all 0; `out` has room for tensors[0].size() values (its shape,
/// row-major), float32 where `out_float32` (the float64 average rounded once to nearest),
/// else float64. One pass: the inputs with c_i > 0 are checked finite through the result
/// (a convex combination of finite values is finite, and a NaN or Inf among them makes it
/// NaN or Inf), named only when it is not; those with c_i = 0 are checked directly.
void weighted_average(const std::vector<ArrayView>& tensors,
                      const std::vector<double>& coefficients, void* out, bool out_float32,
                      int n_threads);

/// `params` and `fishers`: K views each, all of params[0]'s shape; Fisher values must be
/// >= 0; eps >= 0. Raises if a denominator is 0. `out` as for weighted_average.
void fisher_average(const std::vector<ArrayView>& params, const std::vector<ArrayView>& fishers,
                    const std::vector<double>& coefficients, double eps, double* out,
                    int n_threads);

LMDX_NAMESPACE_END
