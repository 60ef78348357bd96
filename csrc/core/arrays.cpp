#include "core/arrays.hpp"

#include "core/checks.hpp"

LMDX_NAMESPACE_BEGIN

void require_finite(const ArrayView& a, Index n, Index cols, const std::string& what,
                    int n_threads) {
  if (a.is_float32) {
    require_finite(a.f32(), n, cols, what, n_threads);
  } else {
    require_finite(a.f64(), n, cols, what, n_threads);
  }
}

LMDX_NAMESPACE_END
