#include "core/arrays.hpp"

#include <stdexcept>

#include "core/checks.hpp"

LMDX_NAMESPACE_BEGIN

Index ArrayView::size() const noexcept {
  Index n = 1;
  for (const Index extent : shape) n *= extent;
  return n;
}

std::string shape_of(const std::vector<Index>& shape) {
  std::string text = "(";
  for (size_t i = 0; i < shape.size(); ++i) {
    text += std::to_string(shape[i]);
    if (i + 1 < shape.size() || shape.size() == 1) text += ",";
    if (i + 1 < shape.size()) text += " ";
  }
  return text + ")";
}

std::string describe(const ArrayView& a) {
  return std::string(a.is_float32 ? "float32" : "float64") + " array of shape " + shape_of(a.shape);
}

void require_finite(const ArrayView& a, Index cols, const std::string& what, int n_threads) {
  if (a.is_float32) {
    require_finite(a.f32(), a.size(), cols, what, n_threads);
  } else {
    require_finite(a.f64(), a.size(), cols, what, n_threads);
  }
}

void require_same_shape(const ArrayView& a, const std::string& what, const ArrayView& reference,
                        const std::string& reference_name) {
  if (a.shape != reference.shape) {
    throw std::invalid_argument(what + ": is a " + describe(a) + " but expected the shape of " +
                                reference_name + ", a " + describe(reference));
  }
}

LMDX_NAMESPACE_END
