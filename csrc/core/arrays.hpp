// A read-only view of a float32 or float64 array owned by the caller.
#pragma once

#include <string>

#include "core/config.hpp"

LMDX_NAMESPACE_BEGIN

struct ArrayView {
  const void* data = nullptr;
  bool is_float32 = false;
  const float* f32() const { return static_cast<const float*>(data); }
  const double* f64() const { return static_cast<const double*>(data); }
};

/// require_finite for either dtype.
void require_finite(const ArrayView& a, Index n, Index cols, const std::string& what,
                    int n_threads);

LMDX_NAMESPACE_END
