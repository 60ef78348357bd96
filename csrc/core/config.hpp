// Build-wide definitions shared by every core file.
//
// The core is compiled once per instruction-set level (see CMakeLists.txt). Each copy
// lives in its own inline namespace, so the copies never share a symbol or a C++ type
// (pybind11 registers types by typeid) even when loaded into one process.
#pragma once

#include <Eigen/Core>
#include <cstdint>

#ifndef LMDX_ISA
#define LMDX_ISA baseline
#endif
#ifndef LMDX_ISA_NAME
#define LMDX_ISA_NAME "baseline"
#endif
#ifndef LMDX_VERSION
#define LMDX_VERSION "0.0.0"
#endif

#define LMDX_NAMESPACE_BEGIN \
  namespace lmdx {           \
  inline namespace LMDX_ISA {
#define LMDX_NAMESPACE_END \
  }                        \
  }

LMDX_NAMESPACE_BEGIN

using Index = Eigen::Index;
using MatrixXd = Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::ColMajor>;
using VectorXd = Eigen::Matrix<double, Eigen::Dynamic, 1>;
template <typename T>
using MatrixX = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::ColMajor>;

/// Which instruction-set level this copy of the core was compiled for.
const char* isa() noexcept;
/// The compiler that built it ("gcc 12.2.0", "clang ...").
const char* compiler() noexcept;
/// Whether the core was built with OpenMP.
bool has_openmp() noexcept;
/// Whether the core was built with LMDX_PROFILE (RegMean's per-phase wall times).
bool profiled() noexcept;
/// Threads available to OpenMP (1 without OpenMP); reported, never used as a default.
int max_threads() noexcept;
/// Eigen version "major.minor.patch" and the SIMD instruction sets Eigen compiled in.
const char* eigen_version() noexcept;
const char* eigen_simd() noexcept;
/// CPU features of the machine running the code (x86 only; empty elsewhere).
struct CpuFeatures {
  bool avx2 = false, fma = false, f16c = false, bmi2 = false;
  bool avx512f = false, avx512bw = false, avx512dq = false, avx512vl = false, avx512cd = false;
  bool x86_64_v3 = false, x86_64_v4 = false;
  bool avx512bf16 = false;  // the bf16 dot product (VDPBF16PS); not part of a level
};
CpuFeatures cpu_features() noexcept;

/// The thread-count rule of every kernel: `n_threads` must be >= 1 (the Python layer turns
/// its default, None, into a count first); anything else throws std::invalid_argument
/// naming n_threads. Returns the threads to run: n_threads, or 1 without OpenMP. Called
/// once at the start of every kernel, never inside a parallel region.
int resolve_threads(int n_threads);

LMDX_NAMESPACE_END
