#include <optional>

#include "bindings/common.hpp"
#include "core/average.hpp"

namespace lmdx_bind {

namespace {

std::vector<ArrayView> views(const std::vector<py::array>& xs, const std::string& name) {
  std::vector<ArrayView> out;
  out.reserve(xs.size());
  for (size_t i = 0; i < xs.size(); ++i) {
    out.push_back(
        float_view(xs[i], name + "[" + std::to_string(i) + "]", static_cast<int>(xs[i].ndim())));
  }
  return out;
}

// The result has the shape of the first input (the core checks that there is one).
py::array_t<double> output_like(const std::vector<ArrayView>& xs) {
  return new_float64(xs.empty() ? std::vector<Index>{0} : xs[0].shape);
}

py::array weighted_average(const std::vector<py::array>& tensors,
                           const std::optional<std::vector<double>>& coefficients,
                           int n_threads, const std::string& dtype) {
  const std::vector<ArrayView> t = views(tensors, "tensors");
  const std::vector<double> coef = coefficient_list(coefficients);
  if (dtype != "float64" && dtype != "float32") {
    throw py::value_error("dtype: must be float64 or float32, got '" + dtype + "'");
  }
  const bool f32 = dtype == "float32";
  const std::vector<Index> shape = t.empty() ? std::vector<Index>{0} : t[0].shape;
  py::array out = f32 ? py::array(py::array_t<float>(std::vector<py::ssize_t>(shape.begin(),
                                                                                shape.end())))
                      : py::array(new_float64(shape));
  void* data = out.mutable_data();
  {
    py::gil_scoped_release release;  // the views stay valid: the caller holds the arrays
    lmdx::weighted_average(t, coef, data, f32, n_threads);
  }
  return out;
}

py::array_t<double> fisher_average(const std::vector<py::array>& params,
                                   const std::vector<py::array>& fishers,
                                   const std::optional<std::vector<double>>& coefficients,
                                   double eps, int n_threads) {
  const std::vector<ArrayView> p = views(params, "params");
  const std::vector<ArrayView> f = views(fishers, "fishers");
  const std::vector<double> coef = coefficient_list(coefficients);
  py::array_t<double> out = output_like(p);
  double* data = out.mutable_data();
  {
    py::gil_scoped_release release;
    lmdx::fisher_average(p, f, coef, eps, data, n_threads);
  }
  return out;
}

}  // namespace

void bind_average(py::module_& m) {
  m.def("weighted_average", &weighted_average, py::kw_only(), py::arg("tensors"),
        py::arg("coefficients"), py::arg("n_threads"), py::arg("dtype") = "float64",
        "sum_i c_i x_i / sum_i c_i, element-wise, in float64 (dtype float32: rounded once).");
  m.def("fisher_average", &fisher_average, py::kw_only(), py::arg("params"), py::arg("fishers"),
        py::arg("coefficients"), py::arg("eps"), py::arg("n_threads"),
        "sum_i c_i (F_i + eps) x_i / sum_i c_i (F_i + eps), element-wise, in float64.");
}

}  // namespace lmdx_bind
