// Minimal OpenMP shims so the core also builds (single-threaded) without OpenMP.
#pragma once

#ifdef LMDX_HAS_OPENMP
#include <omp.h>
#define LMDX_PRAGMA(x) _Pragma(#x)
#else
#define LMDX_PRAGMA(x)
#endif

#include "core/config.hpp"

LMDX_NAMESPACE_BEGIN

inline int thread_id() noexcept {
#ifdef LMDX_HAS_OPENMP
  return omp_get_thread_num();
#else
  return 0;
#endif
}

LMDX_NAMESPACE_END
