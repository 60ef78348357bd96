#include "bindings/common.hpp"
#include "core/gram_product.hpp"

namespace lmdx_bind {

namespace {

py::array_t<double> gram_product(const py::array& gram, const py::array& y, int n_threads) {
  const ArrayView g = float64_view(gram, "gram", gram.ndim() == 1 ? 1 : 2);
  const ArrayView yv = float64_view(y, "y", 2);
  py::array_t<double> out = new_float64({yv.shape[0], yv.shape[1]});
  double* data = out.mutable_data();
  py::gil_scoped_release release;  // the views stay valid: the caller holds the arrays
  lmdx::gram_product(g, yv, n_threads, data);
  return out;
}

}  // namespace

void bind_gram_product(py::module_& m) {
  m.def("gram_product", &gram_product, py::kw_only(), py::arg("gram"), py::arg("y"),
        py::arg("n_threads"),
        "G Y (d, p): G a float64 Gram, full or packed upper (d (d + 1) / 2,).");
}

}  // namespace lmdx_bind
