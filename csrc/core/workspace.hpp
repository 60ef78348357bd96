// Reusable scratch buffers for the threaded kernels, and pooled matrices for the merge.
//
// Statistics collection calls the same kernel thousands of times (once per module per
// batch); allocating (and page-faulting) a packing buffer of a few MB per call would cost
// more than the arithmetic for small batches. Buffers are checked out of a process-wide
// pool (safe for concurrent callers, since the GIL is released) and returned on release.
// A merge's large matrices (PooledMatrix) are kept in the same pool between layers.
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

/// A dense matrix whose storage comes from, and goes back to, a process-wide pool of
/// matrices (the one release_scratch() empties). A merge solves layer after layer of the
/// same few shapes; a freed matrix of tens of MB would go back to the system, and the next
/// layer's would fault and zero every page again (a BERT-base merge on Zen 4, 2 cores:
/// 10.3 s pooled against 11.7 s, bench/RESULTS.md). resize() takes a pooled matrix with the
/// same number of elements where one is free (its values are left as they were: like
/// Eigen's resize, uninitialized), otherwise allocates and asks for huge pages
/// (prefer_huge_pages); the destructor gives the storage back. Matrices under 4 MB are not
/// pooled (the allocator reuses them), and the pool keeps at most kMatrixPoolBytes, the
/// oldest matrices leaving first. Anything else behaves as the Eigen matrix: an
/// assignment of another size reallocates through Eigen, outside the pool.
template <typename Scalar>
class PooledMatrix : public Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic> {
 public:
  using Base = Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic>;
  PooledMatrix() = default;
  PooledMatrix(Index rows, Index cols) { resize(rows, cols); }
  ~PooledMatrix() { give_back(); }
  PooledMatrix(const PooledMatrix&) = delete;
  PooledMatrix& operator=(const PooledMatrix& other) {
    Base::operator=(other);
    return *this;
  }
  template <typename Other>
  PooledMatrix& operator=(const Eigen::DenseBase<Other>& other) {
    Base::operator=(other);
    return *this;
  }
  void resize(Index rows, Index cols);

 private:
  void give_back() noexcept;
};
using PooledMatrixXd = PooledMatrix<double>;
using PooledMatrixXf = PooledMatrix<float>;

/// Most bytes of matrices the pool keeps between uses (1 GiB).
inline constexpr size_t kMatrixPoolBytes = size_t{1} << 30;

/// Drop every pooled buffer and matrix (frees memory after a large collection or a merge).
void release_scratch() noexcept;
/// Bytes currently held by the pool (buffers and matrices).
size_t scratch_bytes() noexcept;

LMDX_NAMESPACE_END
