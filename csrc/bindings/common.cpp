#include "bindings/common.hpp"

#include <stdexcept>

namespace lmdx_bind {

namespace {

std::vector<Index> shape_vector(const py::array& a) {
  return std::vector<Index>(a.shape(), a.shape() + a.ndim());
}

}  // namespace

std::string describe(const py::array& a) {
  const bool c_contiguous = (a.flags() & py::array::c_style) != 0;
  return std::string(py::str(a.dtype())) + " array of shape " + lmdx::shape_of(shape_vector(a)) +
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
  return ArrayView{a.data(), is_f32, shape_vector(a)};
}

ArrayView float64_view(const py::array& a, const std::string& name, int ndim) {
  ArrayView v = float_view(a, name, ndim);
  if (v.is_float32) {
    throw std::invalid_argument(name + ": expected a float64 array, got a " + describe(a));
  }
  return v;
}

py::array_t<double> new_float64(const std::vector<Index>& shape) {
  return py::array_t<double>(std::vector<py::ssize_t>(shape.begin(), shape.end()));
}

std::vector<double> coefficient_list(const std::optional<std::vector<double>>& coefficients) {
  return coefficients.value_or(std::vector<double>{});
}

}  // namespace lmdx_bind
