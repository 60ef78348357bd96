#include "core/config.hpp"

#include <algorithm>
#include <stdexcept>
#include <string>

#ifdef LMDX_HAS_OPENMP
#include <omp.h>
#endif

LMDX_NAMESPACE_BEGIN

const char* isa() noexcept { return LMDX_ISA_NAME; }

const char* compiler() noexcept {
#if defined(__clang__)
  return "clang " __clang_version__;
#elif defined(__GNUC__)
  return "gcc " __VERSION__;
#else
  return "unknown";
#endif
}

bool has_openmp() noexcept {
#ifdef LMDX_HAS_OPENMP
  return true;
#else
  return false;
#endif
}

bool profiled() noexcept {
#ifdef LMDX_PROFILE
  return true;
#else
  return false;
#endif
}

int max_threads() noexcept {
#ifdef LMDX_HAS_OPENMP
  return std::max(1, omp_get_max_threads());
#else
  return 1;
#endif
}

int resolve_threads(int n_threads) {
  if (n_threads < 1) {
    throw std::invalid_argument("n_threads: must be >= 1, got " + std::to_string(n_threads));
  }
#ifdef LMDX_HAS_OPENMP
  return n_threads;
#else
  return 1;
#endif
}

#define LMDX_STR2(x) #x
#define LMDX_STR(x) LMDX_STR2(x)

const char* eigen_version() noexcept {
  return LMDX_STR(EIGEN_WORLD_VERSION) "." LMDX_STR(EIGEN_MAJOR_VERSION) "." LMDX_STR(
      EIGEN_MINOR_VERSION);
}

const char* eigen_simd() noexcept { return Eigen::SimdInstructionSetsInUse(); }

CpuFeatures cpu_features() noexcept {
  CpuFeatures f;
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  __builtin_cpu_init();
  f.avx2 = __builtin_cpu_supports("avx2");
  f.fma = __builtin_cpu_supports("fma");
  f.f16c = __builtin_cpu_supports("f16c");
  f.bmi2 = __builtin_cpu_supports("bmi2");
  f.avx512f = __builtin_cpu_supports("avx512f");
  f.avx512bw = __builtin_cpu_supports("avx512bw");
  f.avx512dq = __builtin_cpu_supports("avx512dq");
  f.avx512vl = __builtin_cpu_supports("avx512vl");
  f.avx512cd = __builtin_cpu_supports("avx512cd");
  f.x86_64_v3 = f.avx2 && f.fma && f.f16c && f.bmi2 && __builtin_cpu_supports("movbe");
  f.x86_64_v4 = f.x86_64_v3 && f.avx512f && f.avx512bw && f.avx512dq && f.avx512vl && f.avx512cd;
  f.avx512bf16 = __builtin_cpu_supports("avx512bf16");
#endif
  return f;
}

LMDX_NAMESPACE_END
