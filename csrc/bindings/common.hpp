// Argument checking and array conversion shared by the bind_*.cpp files.
//
// Inputs are viewed in place (zero-copy) and must already be C-contiguous float32 or
// float64: the Python layer (lmdx/_tensors.py) makes that conversion explicit, so no large
// array is ever copied silently here. Violations raise ValueError naming the argument.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>
#include <vector>

#include "core/arrays.hpp"

namespace lmdx_bind {

namespace py = pybind11;
using lmdx::ArrayView;
using lmdx::Index;

/// "(2, 3)"-style shape, and "float32 array of shape (2, 3)" (+ contiguity) for errors.
std::string shape_of(const py::array& a);
std::string describe(const py::array& a);

/// Require a C-contiguous float32/float64 array with `ndim` dimensions.
ArrayView float_view(const py::array& a, const std::string& name, int ndim);

/// Require a C-contiguous float64 array with `ndim` dimensions.
const double* float64_data(const py::array& a, const std::string& name, int ndim);

/// A new C-contiguous float64 array of the given shape (owned by Python).
py::array_t<double> new_float64(const std::vector<py::ssize_t>& shape);

void bind_config(py::module_& m);
void bind_moments(py::module_& m);
void bind_spd(py::module_& m);
void bind_regmean(py::module_& m);
void bind_average(py::module_& m);

}  // namespace lmdx_bind
