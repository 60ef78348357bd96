// Streaming first and second moments of row vectors, accumulated in float64.
//
// For rows x_t (optionally weighted by w_t >= 0; a 0/1 weight is a mask):
//   count = sum w_t,   sum = sum w_t x_t,   gram = sum w_t x_t x_t^T.
// Only the lower triangle of the Gram is computed and stored.
//
// Rows are packed `chunk_rows` (kept) rows at a time and multiplied by a register-tiled
// kernel (core/gram_kernel.hpp) in the input precision: a float32 product entry is summed
// in float32 over at most 64 rows and then added into the float64 accumulator, which
// keeps float32 input within 1e-6 (relative, Frobenius) of a float64 accumulation, also
// for repeated rows. Threads share each block's packing and its Gram tiles (disjoint
// entries, same arithmetic per entry), so 1 and N threads give bit-identical results.
// Calls on one object from several threads are serialized by an internal mutex.
#pragma once

#include <memory>
#include <mutex>

#include "core/arrays.hpp"
#include "core/gram_kernel.hpp"

LMDX_NAMESPACE_BEGIN

class Moments {
 public:
  /// Rows packed and multiplied per block, shared by the threads. 512 measured best or
  /// tied against 256/1024/2048 at d = 1024-4096 (bench/RESULTS.md). Changes the
  /// precision only below 64 (the float32 sums then run over fewer rows).
  static constexpr Index kDefaultChunkRows = 512;

  explicit Moments(Index dim, Index chunk_rows = kDefaultChunkRows);
  /// Rebuild from a saved state: `sum` a float64 view of shape (d,), `gram` one of shape
  /// (d, d), of which only the lower triangle is read.
  static std::unique_ptr<Moments> from_state(double count, const ArrayView& sum,
                                             const ArrayView& gram,
                                             Index chunk_rows = kDefaultChunkRows);

  /// Add the rows of x, stored row-major (rows x cols, contiguous); cols must be dim().
  /// `weights` is nullptr or a float64 view of `rows` non-negative finite values.
  void update(const float* x, Index rows, Index cols, const ArrayView* weights, int n_threads);
  void update(const double* x, Index rows, Index cols, const ArrayView* weights, int n_threads);
  /// 16-bit rows: widened to float32 while packing (exact), then as float32; bfloat16
  /// rows with GramPath::bf16_dot use the CPU's bf16 dot product (core/gram_kernel.hpp).
  void update(const Eigen::half* x, Index rows, Index cols, const ArrayView* weights,
              int n_threads);
  void update(const Eigen::bfloat16* x, Index rows, Index cols, const ArrayView* weights,
              int n_threads, GramPath path = GramPath::widen);

  /// Add another accumulator's statistics (disjoint data): count, sum and Gram add.
  void merge(const Moments& other);

  Moments(const Moments&) = delete;
  Moments& operator=(const Moments&) = delete;

  Index dim() const noexcept { return dim_; }
  Index chunk_rows() const noexcept { return chunk_rows_; }
  double count() const noexcept { return count_; }
  const VectorXd& sum() const noexcept { return sum_; }
  /// Lower triangle valid; the strict upper triangle is unspecified.
  const MatrixXd& gram_lower() const noexcept { return gram_; }
  /// Write the full symmetric Gram into out (dim x dim, either storage order).
  void gram(double* out) const;

 private:
  Moments(Index dim, double count, const double* sum, const double* gram_row_major,
          Index chunk_rows);
  template <typename T>
  void update_impl(const T* x, Index rows, Index cols, const ArrayView* weights, int n_threads,
                   GramPath path = GramPath::widen);

  mutable std::mutex mutex_;  // update/merge/gram on one object are serialized
  Index dim_;
  Index chunk_rows_;
  double count_ = 0.0;
  VectorXd sum_;
  MatrixXd gram_;
};

LMDX_NAMESPACE_END
