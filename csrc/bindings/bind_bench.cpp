// What the benchmarks measure the core against, outside the core (csrc/bench/): the
// machine's peak FMA and bf16 dot-product throughput for the instruction set of this
// module (bench/peak.hpp).
#include "bench/peak.hpp"
#include "bindings/common.hpp"

namespace lmdx_bind {

void bind_bench(py::module_& m) {
  m.def(
      "measure_peak_gflops",
      [](bool double_precision, int n_threads, double seconds) {
        py::gil_scoped_release release;
        return lmdx::measure_peak_gflops(double_precision, n_threads, seconds);
      },
      py::kw_only(), py::arg("double_precision"), py::arg("n_threads"), py::arg("seconds"),
      "GFLOP/s of a register-resident FMA loop on this machine.");
  m.def(
      "measure_bf16_peak_gflops",
      [](int n_threads, double seconds) {
        py::gil_scoped_release release;
        return lmdx::measure_bf16_peak_gflops(n_threads, seconds);
      },
      py::kw_only(), py::arg("n_threads"), py::arg("seconds"),
      "GFLOP/s of a register-resident bf16 dot-product loop (0 without the bf16 kernel).");
}

}  // namespace lmdx_bind
