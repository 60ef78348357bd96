#include "bindings/common.hpp"
#include "core/fisher.hpp"

namespace lmdx_bind {

namespace {

py::array_t<double> sum_squared_products(const py::array& a, const py::array& b, int n_threads) {
  const ArrayView av = float_view(a, "a", 3);
  const ArrayView bv = float_view(b, "b", 3);
  py::array_t<double> out = new_float64({av.shape[2], bv.shape[2]});
  double* data = out.mutable_data();
  {
    py::gil_scoped_release release;  // the views stay valid: the caller holds the arrays
    lmdx::sum_squared_products(av, bv, data, n_threads);
  }
  return out;
}

}  // namespace

void bind_fisher(py::module_& m) {
  m.def("sum_squared_products", &sum_squared_products, py::kw_only(), py::arg("a"), py::arg("b"),
        py::arg("n_threads"),
        "sum over e of (a_e^T b_e)^2, element-wise: a (n, t, p), b (n, t, q) -> (p, q).");
}

}  // namespace lmdx_bind
