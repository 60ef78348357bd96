#include "core/moments.hpp"

#include <cmath>
#include <stdexcept>
#include <string>

#include "core/checks.hpp"
#include "core/workspace.hpp"

LMDX_NAMESPACE_BEGIN

namespace {

void check_chunk_rows(Index chunk_rows) {
  if (chunk_rows < 1) {
    throw std::invalid_argument("chunk_rows: must be >= 1, got " + std::to_string(chunk_rows));
  }
}

// The element type's name in messages, chosen by the row pointer's type.
const char* dtype_name(const float*) { return "float32"; }
const char* dtype_name(const double*) { return "float64"; }
const char* dtype_name(const Eigen::half*) { return "float16"; }
const char* dtype_name(const Eigen::bfloat16*) { return "bfloat16"; }

void check_weights(const ArrayView* w, Index rows) {
  if (w == nullptr) return;
  if (w->size() != rows) {
    throw std::invalid_argument("weights: expected " + std::to_string(rows) +
                                " values (one per row of x), got a " + describe(*w));
  }
  const double* values = w->f64();
  require_finite(values, rows, 0, "weights", 1);
  for (Index i = 0; i < rows; ++i) {
    if (values[i] < 0.0) {
      throw std::invalid_argument("weights: must be >= 0, got " + std::to_string(values[i]) +
                                  " at row " + std::to_string(i));
    }
  }
}

}  // namespace

Moments::Moments(Index dim, Index chunk_rows)
    : dim_(dim),
      chunk_rows_(chunk_rows),
      sum_(VectorXd::Zero(dim)) {
  if (dim < 1) throw std::invalid_argument("dim: must be >= 1, got " + std::to_string(dim));
  check_chunk_rows(chunk_rows);
  gram_.resize(dim, dim);
  prefer_huge_pages(gram_);  // before the first touch (zeroing)
  gram_.setZero();
}

std::unique_ptr<Moments> Moments::from_state(double count, const ArrayView& sum,
                                             const ArrayView& gram, Index chunk_rows) {
  const Index d = sum.size();
  if (gram.shape != std::vector<Index>{d, d}) {
    throw std::invalid_argument("gram: expected shape " + shape_of({d, d}) +
                                " to match sum, got a " + describe(gram));
  }
  return std::unique_ptr<Moments>(new Moments(d, count, sum.f64(), gram.f64(), chunk_rows));
}

Moments::Moments(Index dim, double count, const double* sum, const double* gram_row_major,
                 Index chunk_rows)
    : Moments(dim, chunk_rows) {
  if (!std::isfinite(count) || count < 0.0) {
    throw std::invalid_argument("count: must be finite and >= 0, got " + std::to_string(count));
  }
  require_finite(sum, dim, 0, "sum", 1);
  require_finite(gram_row_major, dim * dim, dim, "gram", max_threads());
  count_ = count;
  sum_ = Eigen::Map<const VectorXd>(sum, dim);
  // Row-major (i, j) with i >= j is the lower triangle; read it as column-major upper.
  Eigen::Map<const MatrixXd> g_transposed(gram_row_major, dim, dim);
  gram_.triangularView<Eigen::Lower>() = g_transposed.transpose();
}

void Moments::update(const float* x, Index rows, Index cols, const ArrayView* weights,
                     int n_threads) {
  update_impl(x, rows, cols, weights, n_threads);
}

void Moments::update(const double* x, Index rows, Index cols, const ArrayView* weights,
                     int n_threads) {
  update_impl(x, rows, cols, weights, n_threads);
}

void Moments::update(const Eigen::half* x, Index rows, Index cols, const ArrayView* weights,
                     int n_threads) {
  update_impl(x, rows, cols, weights, n_threads);
}

void Moments::update(const Eigen::bfloat16* x, Index rows, Index cols, const ArrayView* weights,
                     int n_threads, GramPath path) {
  update_impl(x, rows, cols, weights, n_threads, path);
}

template <typename T>
void Moments::update_impl(const T* x, Index rows, Index cols, const ArrayView* weights,
                          int n_threads, GramPath path) {
  resolve_threads(n_threads);  // the thread-count rule holds for every call, empty or not

  if (rows < 0) throw std::invalid_argument("x: negative row count");
  if (cols != dim_) {
    throw std::invalid_argument("x: expected " + std::to_string(dim_) +
                                " columns (the accumulator's dim), got a " + dtype_name(x) +
                                " array of shape " + shape_of({rows, cols}));
  }
  check_weights(weights, rows);
  if (rows == 0) return;
  std::lock_guard<std::mutex> lock(mutex_);
  require_finite(x, rows * dim_, dim_, "x", n_threads);

  const double* w = weights == nullptr ? nullptr : weights->f64();
  double count = 0.0;
  if (w == nullptr) {
    count = static_cast<double>(rows);
  } else {
    for (Index r = 0; r < rows; ++r) count += w[r];
  }
  gram_update(x, rows, dim_, w, chunk_rows_, n_threads, gram_.data(), gram_.rows(), sum_.data(),
              path);
  count_ += count;
}

void Moments::merge(const Moments& other) {
  if (&other == this) {
    throw std::invalid_argument("other: cannot merge an accumulator into itself");
  }
  std::scoped_lock lock(mutex_, other.mutex_);
  if (other.dim_ != dim_) {
    throw std::invalid_argument("other: dimension " + std::to_string(other.dim_) +
                                " does not match this accumulator's " + std::to_string(dim_));
  }
  count_ += other.count_;
  sum_ += other.sum_;
  gram_.triangularView<Eigen::Lower>() += other.gram_;
}

void Moments::gram(double* out) const {
  std::lock_guard<std::mutex> lock(mutex_);
  Eigen::Map<MatrixXd> full(out, dim_, dim_);
  full.triangularView<Eigen::Lower>() = gram_;
  full.triangularView<Eigen::StrictlyUpper>() = gram_.transpose();
}

template void Moments::update_impl<float>(const float*, Index, Index, const ArrayView*, int,
                                          GramPath);
template void Moments::update_impl<double>(const double*, Index, Index, const ArrayView*, int,
                                           GramPath);
template void Moments::update_impl<Eigen::half>(const Eigen::half*, Index, Index, const ArrayView*,
                                                int, GramPath);
template void Moments::update_impl<Eigen::bfloat16>(const Eigen::bfloat16*, Index, Index,
                                                    const ArrayView*, int, GramPath);

LMDX_NAMESPACE_END
