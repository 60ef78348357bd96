// Reusable scratch buffers for the threaded kernels.
//
// Statistics collection calls the same kernel thousands of times (once per module per
// batch); allocating (and page-faulting) a packing buffer of a few MB per call would cost
// more than the arithmetic for small batches. Buffers are checked out of a process-wide
// pool (safe for concurrent callers, since the GIL is released) and returned on release.
#pragma once

#include <cstddef>
#include <memory>

#include <Eigen/Core>

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

/// Ask for transparent huge pages on the whole 2 MB pages inside [data, data + bytes)
/// before their first touch (Linux's madvise MADV_HUGEPAGE, as NumPy does for its large
/// arrays): a large matrix then faults in 512 times fewer pages and needs fewer TLB
/// entries (about 5 % of a BERT-base merge on Zen 4, bench/RESULTS.md). Nothing below
/// 4 MB, off Linux, or where transparent huge pages are disabled; results never depend on
/// it (the merged weights and Grams were bit-identical with and without it).
void prefer_huge_pages(void* data, size_t bytes) noexcept;
template <typename Derived>
void prefer_huge_pages(Eigen::PlainObjectBase<Derived>& m) noexcept {
  prefer_huge_pages(m.data(), static_cast<size_t>(m.size()) * sizeof(typename Derived::Scalar));
}

/// Drop every pooled buffer (frees memory after a large collection).
void release_scratch() noexcept;
/// Bytes currently held by the pool.
size_t scratch_bytes() noexcept;

LMDX_NAMESPACE_END
