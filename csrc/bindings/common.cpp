#include "bindings/common.hpp"

#include <stdexcept>

namespace lmdx_bind {

std::string shape_of(const py::array& a) {
  std::string shape = "(";
  for (py::ssize_t i = 0; i < a.ndim(); ++i) {
    shape += std::to_string(a.shape(i));
    if (i + 1 < a.ndim() || a.ndim() == 1) shape += ",";
    if (i + 1 < a.ndim()) shape += " ";
  }
  return shape + ")";
}

std::string describe(const py::array& a) {
  const bool c_contiguous = (a.flags() & py::array::c_style) != 0;
  return std::string(py::str(a.dtype())) + " array of shape " + shape_of(a) +
         (c_contiguous ? "" : " (not C-contiguous)");
}

ArrayView float_view(const py::array& a, const std::string& name, int ndim) {
  const bool is_f32 = a.dtype().is(py::dtype::of<float>());
  const bool is_f64 = a.dtype().is(py::dtype::of<double>());
  if ((!is_f32 && !is_f64) || a.ndim() != ndim || (a.flags() & py::array::c_style) == 0) {
    throw std::invalid_argument(name + ": expected a C-contiguous float32 or float64 array with " +
                                std::to_string(ndim) + " dimension(s), got a " + describe(a) +
                                "; convert with numpy.ascontiguousarray");
  }
  return ArrayView{a.data(), is_f32};
}

const double* float64_data(const py::array& a, const std::string& name, int ndim) {
  const ArrayView v = float_view(a, name, ndim);
  if (v.is_float32) {
    throw std::invalid_argument(name + ": expected a float64 array, got a " + describe(a));
  }
  return v.f64();
}

py::array_t<double> new_float64(const std::vector<py::ssize_t>& shape) {
  return py::array_t<double>(shape);
}

}  // namespace lmdx_bind
