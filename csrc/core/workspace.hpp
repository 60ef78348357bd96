// Reusable scratch buffers for the threaded kernels.
//
// Statistics collection calls the same kernel thousands of times (once per module per
// batch); allocating and zeroing a d x d buffer per call would cost more than the
// arithmetic for small batches. Buffers are checked out of a process-wide pool (safe for
// concurrent callers, since the GIL is released) and returned, zeroed, on release.
#pragma once

#include <memory>
#include <vector>

#include "core/config.hpp"

LMDX_NAMESPACE_BEGIN

/// Scratch for one thread of the Gram kernel: a zeroed d x d lower-triangle buffer, a row
/// gather buffer, and a zeroed length-d sum.
template <typename T>
struct GramScratch {
  Index dim = 0;
  MatrixX<T> gram;  // d x d; lower triangle is zero between uses
  MatrixX<T> rows;  // d x chunk_rows gather buffer (column = one input row)
  VectorXd sum;     // d; zero between uses
  explicit GramScratch(Index d) : dim(d), gram(MatrixX<T>::Zero(d, d)), sum(VectorXd::Zero(d)) {}
};

/// Borrow `count` scratch sets for dimension d; returns them to the pool on destruction.
template <typename T>
class ScratchLease {
 public:
  ScratchLease(Index dim, int count);
  ~ScratchLease();
  ScratchLease(const ScratchLease&) = delete;
  ScratchLease& operator=(const ScratchLease&) = delete;
  GramScratch<T>& operator[](int i) { return *items_[static_cast<size_t>(i)]; }

 private:
  std::vector<std::unique_ptr<GramScratch<T>>> items_;
};

/// Drop every pooled buffer (frees memory after a large collection).
void release_scratch() noexcept;
/// Bytes currently held by the pool.
size_t scratch_bytes() noexcept;

LMDX_NAMESPACE_END
