#include <optional>
#include <stdexcept>

#include "bindings/common.hpp"
#include "core/regmean.hpp"

namespace lmdx_bind {

using lmdx::RegMeanModel;
using lmdx::WeightLayout;

namespace {

py::tuple regmean_merge(const std::vector<py::array>& grams, const std::vector<double>& counts,
                        const std::vector<py::array>& weights,
                        const std::optional<std::vector<double>>& coefficients, double alpha,
                        const std::string& layout, double ridge, bool allow_regularization,
                        int n_threads, const std::string& name) {
  const size_t k = grams.size();
  if (k == 0) throw std::invalid_argument(name + ": grams: need at least one model");
  if (counts.size() != k || weights.size() != k) {
    throw std::invalid_argument(name + ": grams, counts, weights: need one entry per model, got " +
                                std::to_string(k) + ", " + std::to_string(counts.size()) + ", " +
                                std::to_string(weights.size()));
  }
  WeightLayout lay;
  if (layout == "linear") {
    lay = WeightLayout::Linear;
  } else if (layout == "conv1d") {
    lay = WeightLayout::Conv1D;
  } else {
    throw std::invalid_argument(name +
                                ": layout: expected 'linear' ([out, in], torch nn.Linear) or "
                                "'conv1d' ([in, out], Hugging Face Conv1D), got '" +
                                layout + "'");
  }
  std::vector<RegMeanModel> models(k);
  Index d_in = 0, d_out = 0;
  for (size_t i = 0; i < k; ++i) {
    const std::string tag = "[" + std::to_string(i) + "]";
    const ArrayView w = float_view(weights[i], name + ": weights" + tag, 2);
    const Index in = lay == WeightLayout::Linear ? weights[i].shape(1) : weights[i].shape(0);
    const Index out = lay == WeightLayout::Linear ? weights[i].shape(0) : weights[i].shape(1);
    if (i == 0) {
      d_in = in;
      d_out = out;
    } else if (in != d_in || out != d_out) {
      throw std::invalid_argument(name + ": weights" + tag + " is a " + describe(weights[i]) +
                                  " but weights[0] has shape " + shape_of(weights[0]) +
                                  "; all models must have the same architecture");
    }
    const double* g = float64_data(grams[i], name + ": grams" + tag, 2);
    if (grams[i].shape(0) != d_in || grams[i].shape(1) != d_in) {
      throw std::invalid_argument(name + ": grams" + tag + " is a " + describe(grams[i]) +
                                  " but the layer's input dimension is " + std::to_string(d_in) +
                                  " (layout '" + layout + "')");
    }
    models[i] = RegMeanModel{g, counts[i], w};
  }
  lmdx::SolveOptions opt;
  opt.alpha = alpha;
  opt.ridge = ridge;
  opt.allow_regularization = allow_regularization;
  opt.n_threads = n_threads;
  opt.name = name;
  const std::vector<double> coef = coefficients.value_or(std::vector<double>{});
  py::array_t<double> out =
      lay == WeightLayout::Linear ? new_float64({d_out, d_in}) : new_float64({d_in, d_out});
  double* out_data = out.mutable_data();
  lmdx::SolveInfo info;
  {
    py::gil_scoped_release release;
    lmdx::RegMeanResult r = lmdx::regmean_merge(models, d_in, d_out, coef, lay, opt);
    if (lay == WeightLayout::Linear) {
      // W_M^T column-major (d_in x d_out) is W_M row-major [out, in].
      std::copy(r.merged_t.data(), r.merged_t.data() + r.merged_t.size(), out_data);
    } else {
      Eigen::Map<Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>>(
          out_data, d_in, d_out) = r.merged_t;
    }
    info = r.info;
  }
  return py::make_tuple(out, info);
}

}  // namespace

void bind_regmean(py::module_& m) {
  m.def("regmean_merge", &regmean_merge, py::arg("grams"), py::arg("counts"), py::arg("weights"),
        py::arg("coefficients") = py::none(), py::arg("alpha") = 1.0, py::arg("layout") = "linear",
        py::arg("ridge") = 0.0, py::arg("allow_regularization") = true, py::arg("n_threads") = 0,
        py::arg("name") = "layer",
        "RegMean merge of one linear layer; returns (merged float64 weight, SolveInfo).");
}

}  // namespace lmdx_bind
