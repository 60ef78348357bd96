// How this copy of the core was built and what it finds on this machine (core/config.hpp),
// with the run-time facts of the kernels that lmdx.config() and the benchmarks report: the
// Gram kernel's register tile (core/gram_kernel.hpp) and the scratch pool
// (core/workspace.hpp).
#include <pybind11/typing.h>

#include "bindings/common.hpp"
#include "core/config.hpp"
#include "core/gram_kernel.hpp"
#include "core/workspace.hpp"

namespace lmdx_bind {

void bind_config(py::module_& m) {
  m.attr("__version__") = LMDX_VERSION;
  m.def("isa", &lmdx::isa, "Instruction-set level this module was compiled for.");
  m.def("compiler", &lmdx::compiler, "The compiler that built this module.");
  m.def("has_openmp", &lmdx::has_openmp, "Whether the core was built with OpenMP.");
  m.def("profiled", &lmdx::profiled,
        "Whether the core was built with LMDX_PROFILE (RegMeanInfo.timings filled).");
  m.def("max_threads", &lmdx::max_threads,
        "Threads available to OpenMP (1 without it); every n_threads must be >= 1.");
  m.def("eigen_version", &lmdx::eigen_version, "Version of the Eigen headers compiled in.");
  m.def("eigen_simd", &lmdx::eigen_simd, "SIMD instruction sets Eigen was compiled with.");
  m.def(
      "cpu_features",
      []() {
        const lmdx::CpuFeatures f = lmdx::cpu_features();
        py::typing::Dict<py::str, bool> d;  // in this order in lmdx.config()
        d["avx2"] = f.avx2;
        d["fma"] = f.fma;
        d["f16c"] = f.f16c;
        d["bmi2"] = f.bmi2;
        d["avx512f"] = f.avx512f;
        d["avx512bw"] = f.avx512bw;
        d["avx512dq"] = f.avx512dq;
        d["avx512vl"] = f.avx512vl;
        d["avx512cd"] = f.avx512cd;
        d["x86-64-v3"] = f.x86_64_v3;
        d["x86-64-v4"] = f.x86_64_v4;
        d["avx512bf16"] = f.avx512bf16;
        return d;
      },
      "CPU features detected at run time (x86-64; all False elsewhere).");
  m.def(
      "gram_tile",
      []() {
        const lmdx::GramTile t = lmdx::gram_tile();
        py::typing::Dict<py::str, py::typing::Tuple<int, int>> d;
        d["float32"] = py::make_tuple(t.mr_float, t.nr_float);
        d["float64"] = py::make_tuple(t.mr_double, t.nr_double);
        return d;
      },
      "Register tile (rows, columns) of this variant's Gram kernel per precision.");
  m.def("bf16_dot_available", &lmdx::bf16_dot_available,
        "Whether this module has the bf16 dot-product Gram kernel and this CPU runs it.");
  m.def("scratch_bytes", &lmdx::scratch_bytes, "Bytes held by the kernels' scratch pool.");
  m.def("release_scratch", &lmdx::release_scratch, "Free the kernels' pooled scratch buffers.");
}

}  // namespace lmdx_bind
