#include "bindings/common.hpp"
#include "core/fisher.hpp"

#include <algorithm>
#include <optional>
#include <stdexcept>
#include <vector>

#include "core/arrays.hpp"

namespace lmdx_bind {

namespace {

py::array sum_squared_products(const py::array& a, const py::array& b,
                               const std::optional<py::array>& out, int n_threads) {
  const ArrayView av = float_view(a, "a", 3);
  const ArrayView bv = float_view(b, "b", 3);
  const std::vector<Index> shape{av.shape[2], bv.shape[2]};  // both views have 3 dimensions
  py::array result;
  if (out) {
    const ArrayView ov = float64_view(*out, "out", 2);
    lmdx::require_same_shape(ov, "out", ArrayView{nullptr, false, shape}, "the result");
    if (!out->writeable()) throw std::invalid_argument("out: is read-only; pass a writable array");
    const auto* lo = static_cast<const char*>(out->data());
    const auto* hi = lo + out->nbytes();
    for (const py::array* input : {&a, &b}) {
      const auto* begin = static_cast<const char*>(input->data());
      if (begin < hi && lo < begin + input->nbytes()) {
        throw std::invalid_argument("out: shares memory with a or b; pass a separate array");
      }
    }
    result = *out;
  } else {
    py::array_t<double> fresh = new_float64(shape);
    std::fill(fresh.mutable_data(), fresh.mutable_data() + shape[0] * shape[1], 0.0);
    result = fresh;
  }
  double* data = static_cast<double*>(result.mutable_data());
  {
    py::gil_scoped_release release;  // the views stay valid: the caller holds the arrays
    lmdx::sum_squared_products(av, bv, data, n_threads);
  }
  return result;
}

}  // namespace

void bind_fisher(py::module_& m) {
  m.def("sum_squared_products", &sum_squared_products, py::kw_only(), py::arg("a"), py::arg("b"),
        py::arg("out") = py::none(), py::arg("n_threads"),
        "sum over e of (a_e^T b_e)^2: a (n, t, p), b (n, t, q) -> (p, q), added into out if "
        "given.");
}

}  // namespace lmdx_bind
