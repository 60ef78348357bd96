#include <optional>
#include <stdexcept>

#include "bindings/common.hpp"
#include "core/moments.hpp"

namespace lmdx_bind {

using lmdx::Moments;

namespace {

py::array_t<double> gram_array(const Moments& self) {
  auto out = new_float64({self.dim(), self.dim()});
  self.copy_gram(out.mutable_data());  // symmetric: row- and column-major agree
  return out;
}

py::array_t<double> sum_array(const Moments& self) {
  auto out = new_float64({self.dim()});
  std::copy(self.sum().data(), self.sum().data() + self.dim(), out.mutable_data());
  return out;
}

std::unique_ptr<Moments> from_state(double count, const py::array& sum, const py::array& gram,
                                    Index chunk_rows) {
  const double* s = float64_data(sum, "sum", 1);
  const double* g = float64_data(gram, "gram", 2);
  const Index d = sum.shape(0);
  if (gram.shape(0) != d || gram.shape(1) != d) {
    throw std::invalid_argument("gram: expected shape (" + std::to_string(d) + ", " +
                                std::to_string(d) + ") to match sum, got a " + describe(gram));
  }
  return std::make_unique<Moments>(d, count, s, g, chunk_rows);
}

}  // namespace

void bind_moments(py::module_& m) {
  py::class_<Moments>(m, "Moments",
                      "Streaming count, sum and Gram (sum of outer products) in float64.")
      .def(py::init<Index, Index>(), py::arg("dim"),
           py::arg("chunk_rows") = Moments::kDefaultChunkRows)
      .def_static("from_state", &from_state, py::arg("count"), py::arg("sum"), py::arg("gram"),
                  py::arg("chunk_rows") = Moments::kDefaultChunkRows)
      .def(
          "update",
          [](Moments& self, const py::array& x, const std::optional<py::array>& weights,
             int n_threads, bool bfloat16) {
            // 16-bit rows (float16, or bfloat16 passed as its uint16 bit patterns) go to the
            // kernel as they are: it widens them while packing, so no float32 copy is made.
            const bool half = !bfloat16 && x.dtype().kind() == 'f' && x.dtype().itemsize() == 2;
            const bool narrow = half || bfloat16;
            if (bfloat16 && !(x.dtype().kind() == 'u' && x.dtype().itemsize() == 2)) {
              throw std::invalid_argument("x: bfloat16 rows are passed as a uint16 view, got a " +
                                          describe(x));
            }
            if (narrow && (x.ndim() != 2 || (x.flags() & py::array::c_style) == 0)) {
              throw std::invalid_argument("x: expected a C-contiguous 2-d array, got a " +
                                          describe(x));
            }
            const ArrayView xv = narrow ? ArrayView{} : float_view(x, "x", 2);
            const void* data = x.data();
            if (x.shape(1) != self.dim()) {
              throw std::invalid_argument("x: expected " + std::to_string(self.dim()) +
                                          " columns (the accumulator's dim), got a " + describe(x));
            }
            const Index rows = x.shape(0);
            const double* w = nullptr;
            if (weights.has_value()) {
              w = float64_data(*weights, "weights", 1);
              if (weights->shape(0) != rows) {
                throw std::invalid_argument("weights: expected " + std::to_string(rows) +
                                            " values (one per row of x), got a " +
                                            describe(*weights));
              }
            }
            // Inputs are checked and viewed; the arrays stay alive (held by the caller's
            // frame) while the GIL is released for the arithmetic.
            py::gil_scoped_release release;
            if (bfloat16) {
              self.update(static_cast<const Eigen::bfloat16*>(data), rows, w, n_threads);
            } else if (half) {
              self.update(static_cast<const Eigen::half*>(data), rows, w, n_threads);
            } else if (xv.is_float32) {
              self.update(xv.f32(), rows, w, n_threads);
            } else {
              self.update(xv.f64(), rows, w, n_threads);
            }
          },
          py::arg("x"), py::arg("weights") = py::none(), py::arg("n_threads") = 0,
          py::arg("bfloat16") = false)
      .def(
          "merge",
          [](Moments& self, const Moments& other) {
            py::gil_scoped_release release;
            self.merge(other);
          },
          py::arg("other"))
      .def_property_readonly("dim", &Moments::dim)
      .def_property_readonly("chunk_rows", &Moments::chunk_rows)
      .def_property_readonly("count", &Moments::count)
      .def_property_readonly("sum", &sum_array)
      .def("gram", &gram_array, "The full symmetric Gram matrix (a new float64 array).");
}

}  // namespace lmdx_bind
