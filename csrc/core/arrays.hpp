// A read-only view of a C-contiguous float32 or float64 array owned by the caller, and
// the checks on views the kernels share.
#pragma once

#include <string>
#include <vector>

#include "core/config.hpp"

LMDX_NAMESPACE_BEGIN

struct ArrayView {
  const void* data = nullptr;
  bool is_float32 = false;
  std::vector<Index> shape;  // row-major (C-contiguous) layout
  const float* f32() const { return static_cast<const float*>(data); }
  const double* f64() const { return static_cast<const double*>(data); }
  /// Number of elements (the product of the shape).
  Index size() const noexcept;
};

/// "(2, 3)"-style shape ("(4,)" for one dimension) and "float32 array of shape (2, 3)",
/// for error messages.
std::string shape_of(const std::vector<Index>& shape);
std::string describe(const ArrayView& a);

/// require_finite (checks.hpp) for either dtype, over all of `a`.
void require_finite(const ArrayView& a, Index cols, const std::string& what, int n_threads);

/// Throw std::invalid_argument("<what>: is a ... but expected the shape of <reference_name>,
/// a ...") unless `a` has the shape of `reference`.
void require_same_shape(const ArrayView& a, const std::string& what, const ArrayView& reference,
                        const std::string& reference_name);

LMDX_NAMESPACE_END
