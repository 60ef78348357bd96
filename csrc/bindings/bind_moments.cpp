#include <optional>
#include <stdexcept>

#include "bindings/common.hpp"
#include "core/moments.hpp"

namespace lmdx_bind {

using lmdx::Moments;

namespace {

py::array_t<double> gram_array(const Moments& self) {
  auto out = new_float64({self.dim(), self.dim()});
  self.gram(out.mutable_data());  // symmetric: row- and column-major agree
  return out;
}

py::array_t<double> sum_array(const Moments& self) {
  auto out = new_float64({self.dim()});
  std::copy(self.sum().data(), self.sum().data() + self.dim(), out.mutable_data());
  return out;
}

std::unique_ptr<Moments> from_state(double count, const py::array& sum, const py::array& gram,
                                    Index chunk_rows) {
  return Moments::from_state(count, float64_view(sum, "sum", 1), float64_view(gram, "gram", 2),
                             chunk_rows);
}

void update(Moments& self, const py::array& x, const std::optional<py::array>& weights,
            int n_threads, bool bfloat16, bool bf16_dot) {
  // 16-bit rows (float16, or bfloat16 passed as its uint16 bit patterns) go to the kernel
  // as they are: it widens them while packing, so no float32 copy is made.
  const bool half = !bfloat16 && x.dtype().kind() == 'f' && x.dtype().itemsize() == 2;
  const bool narrow = half || bfloat16;
  if (bf16_dot && !bfloat16) {
    throw std::invalid_argument("bf16_dot: the bf16 dot-product kernel takes bfloat16 rows only");
  }
  if (bfloat16 && !(x.dtype().kind() == 'u' && x.dtype().itemsize() == 2)) {
    throw std::invalid_argument("x: bfloat16 rows are passed as a uint16 view, got a " +
                                describe(x));
  }
  if (narrow && (x.ndim() != 2 || (x.flags() & py::array::c_style) == 0)) {
    throw std::invalid_argument("x: expected a C-contiguous 2-d array, got a " + describe(x));
  }
  const ArrayView xv = narrow ? ArrayView{} : float_view(x, "x", 2);
  std::optional<ArrayView> w;
  if (weights.has_value()) w = float64_view(*weights, "weights", 1);
  const ArrayView* wp = w.has_value() ? &*w : nullptr;
  const void* data = x.data();
  const Index rows = x.shape(0);
  const Index cols = x.shape(1);
  // The arrays stay alive (held by the caller's frame) while the GIL is released.
  py::gil_scoped_release release;
  if (bfloat16) {
    self.update(static_cast<const Eigen::bfloat16*>(data), rows, cols, wp, n_threads,
                bf16_dot ? lmdx::GramPath::bf16_dot : lmdx::GramPath::widen);
  } else if (half) {
    self.update(static_cast<const Eigen::half*>(data), rows, cols, wp, n_threads);
  } else if (xv.is_float32) {
    self.update(xv.f32(), rows, cols, wp, n_threads);
  } else {
    self.update(xv.f64(), rows, cols, wp, n_threads);
  }
}

}  // namespace

void bind_moments(py::module_& m) {
  py::class_<Moments>(m, "Moments",
                      "Streaming count, sum and Gram (sum of outer products) in float64.")
      .def(py::init<Index, Index>(), py::kw_only(), py::arg("dim"), py::arg("chunk_rows"),
           "An empty accumulator of rows of length dim; chunk_rows rows are packed per block.")
      .def_static("from_state", &from_state, py::kw_only(), py::arg("count"), py::arg("sum"),
                  py::arg("gram"), py::arg("chunk_rows"),
                  "Rebuild from a saved count, sum (d,) and Gram (d, d), all float64.")
      .def("update", &update, py::kw_only(), py::arg("x"), py::arg("weights"), py::arg("n_threads"),
           py::arg("bfloat16"), py::arg("bf16_dot") = false,
           "Add the rows of x (rows, dim) with optional float64 weights (rows,).\n"
           "bfloat16: x holds bfloat16 values as their uint16 bit patterns.\n"
           "bf16_dot: multiply them with the CPU's bf16 dot product (bf16_dot_available()).")
      .def(
          "merge",
          [](Moments& self, const Moments& other) {
            py::gil_scoped_release release;
            self.merge(other);
          },
          py::kw_only(), py::arg("other"),
          "Add another accumulator's statistics (disjoint data): count, sum and Gram add.")
      .def_property_readonly("dim", &Moments::dim)
      .def_property_readonly("chunk_rows", &Moments::chunk_rows)
      .def_property_readonly("count", &Moments::count)
      .def_property_readonly("sum", &sum_array)
      .def("gram", &gram_array, "The full symmetric Gram matrix (a new float64 array).");
}

}  // namespace lmdx_bind
