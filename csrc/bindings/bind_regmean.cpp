#include <pybind11/typing.h>

#include <optional>
#include <sstream>
#include <tuple>

#include "bindings/common.hpp"
#include "core/regmean.hpp"

namespace lmdx_bind {

using lmdx::RegMeanInfo;
using lmdx::SolveInfo;

namespace {

// Views of the K float64 Grams: each a full (d, d) Gram, or its packed upper triangle (1-D).
std::vector<ArrayView> gram_views(const std::vector<py::array>& grams, const std::string& name) {
  std::vector<ArrayView> g;
  for (size_t i = 0; i < grams.size(); ++i) {
    const int ndim = grams[i].ndim() == 1 ? 1 : 2;
    g.push_back(float64_view(grams[i], name + ": grams[" + std::to_string(i) + "]", ndim));
  }
  return g;
}

// The solver options both bindings take as keywords.
lmdx::SolveOptions solve_options(double alpha, double ridge, bool allow_regularization,
                                 const std::string& name, int n_threads) {
  lmdx::SolveOptions opt;
  opt.alpha = alpha;
  opt.ridge = ridge;
  opt.allow_regularization = allow_regularization;
  opt.name = name;
  opt.n_threads = n_threads;
  return opt;
}

std::tuple<py::array_t<double>, RegMeanInfo> regmean_merge_layer(
    const std::vector<py::array>& grams, const std::vector<py::array>& weights,
    const std::vector<double>& counts, double alpha,
    const std::optional<std::vector<double>>& coefficients, const std::string& layout,
    const std::string& precision, double noise_floor, double ridge, bool allow_regularization,
    const std::string& name, int n_threads) {
  const std::vector<ArrayView> g = gram_views(grams, name);
  std::vector<ArrayView> w;
  for (size_t i = 0; i < weights.size(); ++i) {
    w.push_back(float_view(weights[i], name + ": weights[" + std::to_string(i) + "]", 2));
  }
  const std::vector<double> coef = coefficient_list(coefficients);
  const lmdx::SolveOptions opt = solve_options(alpha, ridge, allow_regularization, name, n_threads);
  // The merged weight has the layout (shape) of the inputs.
  py::array_t<double> out = new_float64(w.empty() ? std::vector<Index>{0, 0} : w[0].shape);
  double* out_data = out.mutable_data();
  RegMeanInfo info;
  {
    py::gil_scoped_release release;  // the views stay valid: the caller holds the arrays
    info = lmdx::regmean_merge_layer(g, w, counts, coef, layout, precision, noise_floor, opt,
                                     out_data);
  }
  return {out, info};
}

std::tuple<py::array_t<double>, SolveInfo> regmean_low_rank_solve(
    const std::vector<py::array>& grams, const std::vector<py::array>& factors,
    const std::vector<double>& counts, double alpha,
    const std::optional<std::vector<double>>& coefficients, double ridge,
    bool allow_regularization, const std::string& name, int n_threads) {
  const std::vector<ArrayView> g = gram_views(grams, name);
  std::vector<ArrayView> a;
  for (size_t i = 0; i < factors.size(); ++i) {
    a.push_back(float64_view(factors[i], name + ": factors[" + std::to_string(i) + "]", 2));
  }
  const std::vector<double> coef = coefficient_list(coefficients);
  const lmdx::SolveOptions opt = solve_options(alpha, ridge, allow_regularization, name, n_threads);
  lmdx::MatrixXd f;
  SolveInfo info;
  {
    py::gil_scoped_release release;  // the views stay valid: the caller holds the arrays
    info = lmdx::regmean_low_rank_solve(g, a, counts, coef, opt, f);
  }
  py::array_t<double> out = new_float64({f.rows(), f.cols()});
  Eigen::Map<Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>>(
      out.mutable_data(), f.rows(), f.cols()) = f;
  return {out, info};
}

}  // namespace

void bind_regmean(py::module_& m) {
  py::class_<RegMeanInfo, SolveInfo>(m, "RegMeanInfo",
                                     "What the solver did for one RegMean layer, and in which "
                                     "precision.")
      .def_readonly("precision", &RegMeanInfo::precision,
                    "'float64', 'float32' (factorization, products and solve) or\n"
                    "'identical' (equal weights in every model, returned without a solve).")
      .def_readonly("condition_estimate", &RegMeanInfo::condition_estimate,
                    "1-norm condition estimate of the system (0: nothing solved).")
      .def_readonly("output_error_estimate", &RegMeanInfo::output_error_estimate,
                    "Certified relative output error ||W - W_float64||_S / ||W_float64||_S\n"
                    "of a float32 merge (0: float64 or identical).")
      .def_readonly("relative_spread", &RegMeanInfo::relative_spread,
                    "max_i max |W_i - mean| / max |mean|.")
      .def_readonly("unseen_directions", &RegMeanInfo::unseen_directions,
                    "Eigendirections below the statistics' noise floor, kept at the average.")
      .def_readonly("phases", &RegMeanInfo::phases,
                    "The phases of the merge in the order first entered: the path it took.")
      .def_property_readonly(
          "timings",
          [](const RegMeanInfo& s) {
            py::typing::Dict<py::str, py::float_> out;  // in the order the phases ran
            for (const auto& [phase, seconds] : s.timings) out[py::str(phase)] = seconds;
            return out;
          },
          "Wall time per phase of the merge in seconds (a benchmark's breakdown), in a\n"
          "build with LMDX_PROFILE=ON only (lmdx.config()['profiled']); empty otherwise.")
      .def("__repr__", [](const RegMeanInfo& s) {
        std::ostringstream out;
        out.precision(6);
        out << "RegMeanInfo(precision='" << s.precision << "', ridge=" << s.ridge
            << ", escalated=" << (s.escalated ? "True" : "False") << ", attempts=" << s.attempts
            << ", rcond_estimate=" << s.rcond_estimate
            << ", condition_estimate=" << s.condition_estimate
            << ", output_error_estimate=" << s.output_error_estimate
            << ", relative_spread=" << s.relative_spread
            << ", unseen_directions=" << s.unseen_directions << ")";
        return out.str();
      });
  m.def("regmean_merge_layer", &regmean_merge_layer, py::kw_only(), py::arg("grams"),
        py::arg("weights"), py::arg("counts"), py::arg("alpha"), py::arg("coefficients"),
        py::arg("layout"), py::arg("precision"), py::arg("noise_floor"), py::arg("ridge"),
        py::arg("allow_regularization"), py::arg("name"), py::arg("n_threads"),
        "RegMean merge of one linear layer; grams full (d, d) or packed upper triangles.\n"
        "Returns (merged float64 weight in the layout of the inputs, RegMeanInfo).");
  m.def("regmean_low_rank_solve", &regmean_low_rank_solve, py::kw_only(), py::arg("grams"),
        py::arg("factors"), py::arg("counts"), py::arg("alpha"), py::arg("coefficients"),
        py::arg("ridge"), py::arg("allow_regularization"), py::arg("name"), py::arg("n_threads"),
        "RegMean solve of K low-rank updates A_i (r_i, d_in) of one base: returns\n"
        "(F float64 (d_in, R), SolveInfo), the merged update being [B_1 .. B_K] F^T.");
}

}  // namespace lmdx_bind
