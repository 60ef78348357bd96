#include <algorithm>
#include <exception>
#include <sstream>
#include <stdexcept>

#include "bindings/common.hpp"
#include "core/checks.hpp"
#include "core/spd.hpp"

namespace lmdx_bind {

using lmdx::MatrixXd;
using lmdx::SolveInfo;
using lmdx::SolveOptions;

namespace {

py::tuple spd_solve(const py::array& a, const py::array& b, double alpha, double ridge,
                    bool allow_regularization, int n_threads, const std::string& name) {
  const double* a_data = float64_data(a, "a", 2);
  const Index d = a.shape(0);
  if (a.shape(1) != d || d < 1) {
    throw std::invalid_argument("a: expected a square matrix, got a " + describe(a));
  }
  const bool vector_rhs = b.ndim() == 1;
  const double* b_data = float64_data(b, "b", vector_rhs ? 1 : 2);
  if (b.shape(0) != d) {
    throw std::invalid_argument("b: expected " + std::to_string(d) + " rows to match a, got a " +
                                describe(b));
  }
  const Index k = vector_rhs ? 1 : b.shape(1);
  SolveOptions opt;
  opt.alpha = alpha;
  opt.ridge = ridge;
  opt.allow_regularization = allow_regularization;
  opt.n_threads = n_threads;
  opt.name = name;
  py::array_t<double> x = vector_rhs ? new_float64({d}) : new_float64({d, k});
  double* x_data = x.mutable_data();
  SolveInfo info;
  {
    py::gil_scoped_release release;
    lmdx::require_finite(ArrayView{a_data, false}, d * d, d, "a", n_threads);
    lmdx::require_finite(ArrayView{b_data, false}, d * k, k, "b", n_threads);
    lmdx::require_symmetric(a_data, d, "a", n_threads);
    // a is symmetric, so its row-major buffer read as column-major is the same matrix.
    const Eigen::Map<const MatrixXd> a_map(a_data, d, d);
    // b row-major (d x k) is b^T column-major (k x d): solved in x's buffer as x^T a = b^T.
    std::copy(b_data, b_data + d * k, x_data);
    Eigen::Map<MatrixXd> xt(x_data, k, d);
    info = lmdx::spd_solve_transposed(a_map, xt, opt);
  }
  return py::make_tuple(x, info);
}

}  // namespace

void bind_spd(py::module_& m) {
  py::register_local_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const lmdx::NotPositiveDefinite& e) {
      py::object cls = py::module_::import("lmdx._errors").attr("NotPositiveDefiniteError");
      PyErr_SetString(cls.ptr(), e.what());
    }
  });

  py::class_<SolveInfo>(m, "SolveInfo", "What the regularized Cholesky solver did.")
      .def_readonly("ridge", &SolveInfo::ridge)
      .def_readonly("ridge_absolute", &SolveInfo::ridge_absolute)
      .def_readonly("mean_diagonal", &SolveInfo::mean_diagonal)
      .def_readonly("attempts", &SolveInfo::attempts)
      .def_readonly("escalated", &SolveInfo::escalated)
      .def_readonly("min_pivot", &SolveInfo::min_pivot)
      .def_readonly("max_pivot", &SolveInfo::max_pivot)
      .def_readonly("rcond_estimate", &SolveInfo::rcond_estimate)
      .def("__repr__", [](const SolveInfo& s) {
        std::ostringstream out;
        out.precision(6);
        out << "SolveInfo(ridge=" << s.ridge << ", escalated=" << (s.escalated ? "True" : "False")
            << ", attempts=" << s.attempts << ", min_pivot=" << s.min_pivot
            << ", max_pivot=" << s.max_pivot << ", rcond_estimate=" << s.rcond_estimate << ")";
        return out.str();
      });

  m.attr("SINGULAR_PIVOT") = lmdx::kSingularPivot;
  m.def("spd_solve", &spd_solve, py::arg("a"), py::arg("b"), py::arg("alpha") = 1.0,
        py::arg("ridge") = 0.0, py::arg("allow_regularization") = true, py::arg("n_threads") = 0,
        py::arg("name") = "system",
        "Solve (reduce_alpha(a) + ridge * mean(diag(a)) I) x = b by Cholesky; returns (x, info).");
}

}  // namespace lmdx_bind
