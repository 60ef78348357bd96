#include "core/moments.hpp"

#include <cmath>
#include <stdexcept>
#include <string>

#include "core/checks.hpp"
#include "core/gram_kernel.hpp"

LMDX_NAMESPACE_BEGIN

namespace {

void check_chunk_rows(Index chunk_rows) {
  if (chunk_rows < 1) {
    throw std::invalid_argument("chunk_rows: must be >= 1, got " + std::to_string(chunk_rows));
  }
}

void check_weights(const double* w, Index rows) {
  if (w == nullptr) return;
  require_finite(w, rows, 0, "weights", 1);
  for (Index i = 0; i < rows; ++i) {
    if (w[i] < 0.0) {
      throw std::invalid_argument("weights: must be >= 0, got " + std::to_string(w[i]) +
                                  " at row " + std::to_string(i));
    }
  }
}

}  // namespace

Moments::Moments(Index dim, Index chunk_rows)
    : dim_(dim),
      chunk_rows_(chunk_rows),
      sum_(VectorXd::Zero(dim)),
      gram_(MatrixXd::Zero(dim, dim)) {
  if (dim < 1) throw std::invalid_argument("dim: must be >= 1, got " + std::to_string(dim));
  check_chunk_rows(chunk_rows);
}

Moments::Moments(Index dim, double count, const double* sum, const double* gram_row_major,
                 Index chunk_rows)
    : Moments(dim, chunk_rows) {
  if (!std::isfinite(count) || count < 0.0) {
    throw std::invalid_argument("count: must be finite and >= 0, got " + std::to_string(count));
  }
  require_finite(sum, dim, 0, "sum", 1);
  require_finite(gram_row_major, dim * dim, dim, "gram", 0);
  count_ = count;
  sum_ = Eigen::Map<const VectorXd>(sum, dim);
  // Row-major (i, j) with i >= j is the lower triangle; read it as column-major upper.
  Eigen::Map<const MatrixXd> g_transposed(gram_row_major, dim, dim);
  gram_.triangularView<Eigen::Lower>() = g_transposed.transpose();
}

void Moments::update(const float* x, Index rows, const double* weights, int n_threads) {
  update_impl(x, rows, weights, n_threads);
}

void Moments::update(const double* x, Index rows, const double* weights, int n_threads) {
  update_impl(x, rows, weights, n_threads);
}

void Moments::update(const Eigen::half* x, Index rows, const double* weights, int n_threads) {
  update_impl(x, rows, weights, n_threads);
}

void Moments::update(const Eigen::bfloat16* x, Index rows, const double* weights, int n_threads) {
  update_impl(x, rows, weights, n_threads);
}

template <typename T>
void Moments::update_impl(const T* x, Index rows, const double* weights, int n_threads) {
  if (rows < 0) throw std::invalid_argument("x: negative row count");
  if (rows == 0) return;
  std::lock_guard<std::mutex> lock(mutex_);
  require_finite(x, rows * dim_, dim_, "x", n_threads);
  check_weights(weights, rows);

  double count = 0.0;
  if (weights == nullptr) {
    count = static_cast<double>(rows);
  } else {
    for (Index r = 0; r < rows; ++r) count += weights[r];
  }
  gram_update(x, rows, dim_, weights, chunk_rows_, n_threads, gram_.data(), gram_.rows(),
              sum_.data());
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

void Moments::copy_gram(double* out) const {
  std::lock_guard<std::mutex> lock(mutex_);
  Eigen::Map<MatrixXd> full(out, dim_, dim_);
  full.triangularView<Eigen::Lower>() = gram_;
  full.triangularView<Eigen::StrictlyUpper>() = gram_.transpose();
}

template void Moments::update_impl<float>(const float*, Index, const double*, int);
template void Moments::update_impl<double>(const double*, Index, const double*, int);
template void Moments::update_impl<Eigen::half>(const Eigen::half*, Index, const double*, int);
template void Moments::update_impl<Eigen::bfloat16>(const Eigen::bfloat16*, Index, const double*,
                                                    int);

LMDX_NAMESPACE_END
