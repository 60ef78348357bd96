#include <sstream>
#include <tuple>

#include "bindings/common.hpp"
#include "core/spd.hpp"

namespace lmdx_bind {

using lmdx::SolveInfo;
using lmdx::SolveOptions;

namespace {

std::tuple<py::array_t<double>, SolveInfo> spd_solve(const py::array& a, const py::array& b,
                                                     double alpha, double ridge,
                                                     bool allow_regularization,
                                                     const std::string& name, int n_threads) {
  const ArrayView av = float64_view(a, "a", 2);
  const ArrayView bv = float64_view(b, "b", b.ndim() == 1 ? 1 : 2);
  SolveOptions opt;
  opt.alpha = alpha;
  opt.ridge = ridge;
  opt.allow_regularization = allow_regularization;
  opt.name = name;
  opt.n_threads = n_threads;
  py::array_t<double> x = new_float64(bv.shape);
  double* x_data = x.mutable_data();
  SolveInfo info;
  {
    py::gil_scoped_release release;  // the views stay valid: the caller holds the arrays
    info = lmdx::spd_solve(av, bv, x_data, opt);
  }
  return {x, info};
}

}  // namespace

void bind_spd(py::module_& m) {
  // The module's own exception type: a native module imports no Python package module, so
  // lmdx/spd.py re-raises it as lmdx.NotPositiveDefiniteError (same message).
  py::register_local_exception<lmdx::NotPositiveDefiniteError>(m, "NotPositiveDefiniteError",
                                                               PyExc_ValueError);

  py::class_<SolveInfo>(m, "SolveInfo", "What the regularized Cholesky solver did.")
      .def_readonly("ridge", &SolveInfo::ridge, "Relative ridge finally used.")
      .def_readonly("ridge_absolute", &SolveInfo::ridge_absolute, "ridge * mean(diag(a)).")
      .def_readonly("mean_diagonal", &SolveInfo::mean_diagonal, "mean(diag(a)).")
      .def_readonly("attempts", &SolveInfo::attempts, "Factorizations tried.")
      .def_readonly("escalated", &SolveInfo::escalated,
                    "Whether the ridge was raised above the requested one.")
      .def_readonly("min_pivot", &SolveInfo::min_pivot, "Smallest diagonal entry of L.")
      .def_readonly("max_pivot", &SolveInfo::max_pivot, "Largest diagonal entry of L.")
      .def_readonly("rcond_estimate", &SolveInfo::rcond_estimate,
                    "(min_pivot / max_pivot)^2, a rough bound on 1 / cond(a).")
      .def("__repr__", [](const SolveInfo& s) {
        std::ostringstream out;
        out.precision(6);
        out << "SolveInfo(ridge=" << s.ridge << ", escalated=" << (s.escalated ? "True" : "False")
            << ", attempts=" << s.attempts << ", min_pivot=" << s.min_pivot
            << ", max_pivot=" << s.max_pivot << ", rcond_estimate=" << s.rcond_estimate << ")";
        return out.str();
      });

  m.attr("SINGULAR_PIVOT") = lmdx::kSingularPivot;
  m.def("spd_solve", &spd_solve, py::kw_only(), py::arg("a"), py::arg("b"), py::arg("alpha"),
        py::arg("ridge"), py::arg("allow_regularization"), py::arg("name"), py::arg("n_threads"),
        "Solve (alpha-reduced a + ridge * mean(diag(a)) I) x = b by Cholesky.\n"
        "Returns (x of b's shape, SolveInfo).");
}

}  // namespace lmdx_bind
