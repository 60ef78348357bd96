#include <optional>
#include <stdexcept>

#include "bindings/common.hpp"
#include "core/average.hpp"

namespace lmdx_bind {

namespace {

std::vector<ArrayView> same_shape_views(const std::vector<py::array>& xs, const std::string& name,
                                        const py::array* reference) {
  if (xs.empty()) throw std::invalid_argument(name + ": need at least one tensor");
  const py::array& ref = reference != nullptr ? *reference : xs[0];
  std::vector<ArrayView> views;
  for (size_t i = 0; i < xs.size(); ++i) {
    const std::string tag = name + "[" + std::to_string(i) + "]";
    views.push_back(float_view(xs[i], tag, static_cast<int>(xs[i].ndim())));
    bool same = xs[i].ndim() == ref.ndim();
    for (py::ssize_t j = 0; same && j < ref.ndim(); ++j) same = xs[i].shape(j) == ref.shape(j);
    if (!same) {
      throw std::invalid_argument(
          tag + ": is a " + describe(xs[i]) + " but expected the shape of " +
          (reference != nullptr ? "params[0]" : name + "[0]") + ", a " + describe(ref));
    }
  }
  return views;
}

py::array_t<double> output_like(const py::array& ref) {
  std::vector<py::ssize_t> shape(ref.shape(), ref.shape() + ref.ndim());
  return py::array_t<double>(shape);
}

py::array_t<double> weighted_average(const std::vector<py::array>& tensors,
                                     const std::optional<std::vector<double>>& coefficients,
                                     int n_threads) {
  const std::vector<ArrayView> views = same_shape_views(tensors, "tensors", nullptr);
  auto out = output_like(tensors[0]);
  const Index n = static_cast<Index>(tensors[0].size());
  double* data = out.mutable_data();
  const std::vector<double> coef = coefficients.value_or(std::vector<double>{});
  {
    py::gil_scoped_release release;
    lmdx::weighted_average(views, n, coef, data, n_threads);
  }
  return out;
}

py::array_t<double> fisher_average(const std::vector<py::array>& params,
                                   const std::vector<py::array>& fishers,
                                   const std::optional<std::vector<double>>& coefficients,
                                   double eps, int n_threads) {
  const std::vector<ArrayView> p = same_shape_views(params, "params", nullptr);
  if (fishers.size() != params.size()) {
    throw std::invalid_argument("fishers: expected " + std::to_string(params.size()) +
                                " tensors (one per model), got " + std::to_string(fishers.size()));
  }
  const std::vector<ArrayView> f = same_shape_views(fishers, "fishers", &params[0]);
  auto out = output_like(params[0]);
  const Index n = static_cast<Index>(params[0].size());
  double* data = out.mutable_data();
  const std::vector<double> coef = coefficients.value_or(std::vector<double>{});
  {
    py::gil_scoped_release release;
    lmdx::fisher_average(p, f, n, coef, eps, data, n_threads);
  }
  return out;
}

}  // namespace

void bind_average(py::module_& m) {
  m.def("weighted_average", &weighted_average, py::arg("tensors"),
        py::arg("coefficients") = py::none(), py::arg("n_threads") = 0,
        "sum_i c_i x_i / sum_i c_i, element-wise, in float64.");
  m.def("fisher_average", &fisher_average, py::arg("params"), py::arg("fishers"),
        py::arg("coefficients") = py::none(), py::arg("eps") = 0.0, py::arg("n_threads") = 0,
        "sum_i c_i (F_i + eps) x_i / sum_i c_i (F_i + eps), element-wise, in float64.");
}

}  // namespace lmdx_bind
