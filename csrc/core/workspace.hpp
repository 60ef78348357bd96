// Reusable scratch buffers for the threaded kernels.
//
// Statistics collection calls the same kernel thousands of times (once per module per
// batch); allocating (and page-faulting) a packing buffer of a few MB per call would cost
// more than the arithmetic for small batches. Buffers are checked out of a process-wide
// pool (safe for concurrent callers, since the GIL is released) and returned on release.
#pragma once

#include <cstddef>
#include <memory>

#include "core/config.hpp"

LMDX_NAMESPACE_BEGIN

struct PooledBuffer;  // one 64-byte aligned allocation (workspace.cpp)

/// An uninitialized, 64-byte aligned array of at least `size` elements of T, borrowed from
/// the pool; returned to it on destruction.
template <typename T>
class BufferLease {
 public:
  explicit BufferLease(size_t size);
  ~BufferLease();
  BufferLease(const BufferLease&) = delete;
  BufferLease& operator=(const BufferLease&) = delete;
  T* data() noexcept { return data_; }
  T& operator[](size_t i) noexcept { return data_[i]; }

 private:
  std::unique_ptr<PooledBuffer> block_;
  T* data_ = nullptr;
};

/// Drop every pooled buffer (frees memory after a large collection).
void release_scratch() noexcept;
/// Bytes currently held by the pool.
size_t scratch_bytes() noexcept;

LMDX_NAMESPACE_END
