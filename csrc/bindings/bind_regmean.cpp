#include <optional>
#include <tuple>

#include "bindings/common.hpp"
#include "core/regmean.hpp"

namespace lmdx_bind {

using lmdx::SolveInfo;

namespace {

std::tuple<py::array_t<double>, SolveInfo> regmean_merge_layer(
    const std::vector<py::array>& grams, const std::vector<py::array>& weights,
    const std::vector<double>& counts, double alpha,
    const std::optional<std::vector<double>>& coefficients, const std::string& layout, double ridge,
    bool allow_regularization, const std::string& name, int n_threads) {
  std::vector<ArrayView> g, w;
  for (size_t i = 0; i < grams.size(); ++i) {
    g.push_back(float64_view(grams[i], name + ": grams[" + std::to_string(i) + "]", 2));
  }
  for (size_t i = 0; i < weights.size(); ++i) {
    w.push_back(float_view(weights[i], name + ": weights[" + std::to_string(i) + "]", 2));
  }
  const std::vector<double> coef = coefficient_list(coefficients);
  lmdx::SolveOptions opt;
  opt.alpha = alpha;
  opt.ridge = ridge;
  opt.allow_regularization = allow_regularization;
  opt.name = name;
  opt.n_threads = n_threads;
  // The merged weight has the layout (shape) of the inputs.
  py::array_t<double> out = new_float64(w.empty() ? std::vector<Index>{0, 0} : w[0].shape);
  double* out_data = out.mutable_data();
  SolveInfo info;
  {
    py::gil_scoped_release release;  // the views stay valid: the caller holds the arrays
    info = lmdx::regmean_merge_layer(g, w, counts, coef, layout, opt, out_data);
  }
  return {out, info};
}

}  // namespace

void bind_regmean(py::module_& m) {
  m.def("regmean_merge_layer", &regmean_merge_layer, py::kw_only(), py::arg("grams"),
        py::arg("weights"), py::arg("counts"), py::arg("alpha"), py::arg("coefficients"),
        py::arg("layout"), py::arg("ridge"), py::arg("allow_regularization"), py::arg("name"),
        py::arg("n_threads"),
        "RegMean merge of one linear layer.\n"
        "Returns (merged float64 weight in the layout of the inputs, SolveInfo).");
}

}  // namespace lmdx_bind
