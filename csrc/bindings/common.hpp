// Conversions shared by the bind_*.cpp files: Python arrays to zero-copy core views, and
// new float64 arrays for results.
//
// A binding converts, views, releases the GIL and calls the core; it checks nothing the
// core can check. What it does check is what a view needs: a C-contiguous float32 or
// float64 array with the dimensions of the parameter (the Python layer, lmdx/_tensors.py,
// makes that conversion explicit, so no large array is ever copied silently here); a
// failure raises ValueError naming the argument. Every other check (shapes that must
// agree, values, thread counts) is the core's, raised as std::invalid_argument (ValueError).
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <optional>
#include <string>
#include <vector>

#include "core/arrays.hpp"

namespace lmdx_bind {

namespace py = pybind11;
using lmdx::ArrayView;
using lmdx::Index;

/// "float32 array of shape (2, 3)" (+ " (not C-contiguous)") for errors.
std::string describe(const py::array& a);

/// View a C-contiguous float32/float64 array with `ndim` dimensions.
ArrayView float_view(const py::array& a, const std::string& name, int ndim);

/// View a C-contiguous float64 array with `ndim` dimensions.
ArrayView float64_view(const py::array& a, const std::string& name, int ndim);

/// A new C-contiguous float64 array of the given shape (owned by Python).
py::array_t<double> new_float64(const std::vector<Index>& shape);

/// Per-model coefficients: None is the empty list (all 1 to the core).
std::vector<double> coefficient_list(const std::optional<std::vector<double>>& coefficients);

void bind_config(py::module_& m);
void bind_bench(py::module_& m);
void bind_moments(py::module_& m);
void bind_spd(py::module_& m);
void bind_regmean(py::module_& m);
void bind_average(py::module_& m);
void bind_fisher(py::module_& m);
void bind_gram_product(py::module_& m);

}  // namespace lmdx_bind
