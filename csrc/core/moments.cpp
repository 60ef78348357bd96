#include "core/moments.hpp"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "core/checks.hpp"
#include "core/parallel.hpp"
#include "core/workspace.hpp"

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

// float32 Gram of the rows in `block` (d x m) added into `gram` (float32, lower).
// A float32 dot product over k rows loses up to ~k ulps when the products are alike (e.g.
// repeated padding rows), so each rank update covers at most kInnerRows rows: the chunk's
// float32 result is then a sum of m / kInnerRows partial sums of kInnerRows products each,
// which keeps even constant rows within 1e-6 of float64 (tests/test_moments*.py).
constexpr Index kInnerRows = 64;
// Column panel of the Gram updated by all of a chunk's row blocks before moving on, so the
// float32 result stays in cache instead of streaming d x d floats per 64 rows (which made
// two threads memory-bound at d = 3072).
constexpr Index kPanel = 256;

// Rows [r, r + kInnerRows) at a time into the panel of columns [j0, j0 + w) of the lower
// triangle: its diagonal block and everything below it.
template <typename T, typename Block>
void panel_update(MatrixX<T>& gram, const Block& block, Index j0) {
  const Index m = block.cols();
  const Index d = gram.rows();
  const Index w = std::min(kPanel, d - j0);
  const Index rest = d - j0 - w;
  auto diagonal = gram.block(j0, j0, w, w);
  auto below = gram.block(j0 + w, j0, rest, w);
  for (Index r = 0; r < m; r += kInnerRows) {
    const auto rows = block.middleCols(r, std::min(kInnerRows, m - r));
    diagonal.template selfadjointView<Eigen::Lower>().rankUpdate(rows.middleRows(j0, w));
    if (rest > 0) {
      below.noalias() += rows.middleRows(j0 + w, rest) * rows.middleRows(j0, w).transpose();
    }
  }
}

// Whether the Gram of dimension d is updated panel by panel (and so can be split across
// threads by panels).
template <typename T>
constexpr bool by_panels(Index d) {
  return std::is_same_v<T, float> && d > 2 * kPanel;
}

template <typename T, typename Block>
void rank_update(MatrixX<T>& gram, const Block& block) {
  const Index m = block.cols();
  const Index d = gram.rows();
  if constexpr (!std::is_same_v<T, float>) {
    gram.template selfadjointView<Eigen::Lower>().rankUpdate(block);
  } else if (!by_panels<T>(d)) {
    for (Index r = 0; r < m; r += kInnerRows) {
      gram.template selfadjointView<Eigen::Lower>().rankUpdate(
          block.middleCols(r, std::min(kInnerRows, m - r)));
    }
  } else {
    for (Index j0 = 0; j0 < d; j0 += kPanel) panel_update(gram, block, j0);
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

template <typename T>
void Moments::update_impl(const T* x, Index rows, const double* weights, int n_threads) {
  if (rows < 0) throw std::invalid_argument("x: negative row count");
  if (rows == 0) return;
  std::lock_guard<std::mutex> lock(mutex_);
  require_finite(x, rows * dim_, dim_, "x", n_threads);
  check_weights(weights, rows);

  const Index d = dim_;
  const Index chunk = chunk_rows_;
  const Index n_chunks = (rows + chunk - 1) / chunk;
  const int wanted = resolve_threads(n_threads);
  // Fewer chunks than threads (one batch of <= chunk_rows rows is the common case when
  // collecting statistics): the threads share each chunk's Gram by column panels instead.
  const bool share_chunks = wanted > n_chunks && by_panels<T>(d);
  const int threads =
      share_chunks ? wanted : static_cast<int>(std::min<Index>(wanted, n_chunks));
  ScratchLease<T> scratch(d, share_chunks ? 1 : threads);
  if (weights != nullptr) {
    for (int t = 0; t < (share_chunks ? 1 : threads); ++t) {
      if (scratch[t].rows.cols() < chunk) scratch[t].rows.resize(d, chunk);
    }
  }
  // Column r of xt is input row r.
  const Eigen::Map<const MatrixX<T>> xt(x, d, rows);

  double count = 0.0;
  if (weights == nullptr) {
    count = static_cast<double>(rows);
  } else {
    for (Index c = 0; c < n_chunks; ++c) {  // chunk order, as for sum and gram
      double chunk_count = 0.0;
      for (Index r = c * chunk; r < std::min(rows, (c + 1) * chunk); ++r) chunk_count += weights[r];
      count += chunk_count;
    }
  }

  // The rows of chunk c that enter the Gram (column r = one row): a view of the input
  // when every weight is 1, else the kept rows (weight > 0) scaled by sqrt(weight),
  // gathered into s.rows. Adds the chunk's weighted row sum into s.sum.
  auto gather_chunk = [&](Index c, GramScratch<T>& s) -> Eigen::Ref<const MatrixX<T>> {
    const Index r0 = c * chunk;
    const Index m = std::min(chunk, rows - r0);
    bool unit = true;
    if (weights != nullptr) {
      for (Index r = r0; r < r0 + m && unit; ++r) unit = weights[r] == 1.0;
    }
    if (unit) {
      const auto block = xt.middleCols(r0, m);
      for (Index r = 0; r < m; ++r) s.sum += block.col(r).template cast<double>();
      return block;
    }
    Index kept = 0;
    for (Index r = r0; r < r0 + m; ++r) {
      const double w = weights[r];
      if (w == 0.0) continue;
      if (w == 1.0) {
        s.rows.col(kept) = xt.col(r);
      } else {
        s.rows.col(kept) = xt.col(r) * static_cast<T>(std::sqrt(w));
      }
      s.sum += w * xt.col(r).template cast<double>();
      ++kept;
    }
    return s.rows.leftCols(kept);
  };
  auto process_chunk = [&](Index c, GramScratch<T>& s) {
    const Eigen::Ref<const MatrixX<T>> block = gather_chunk(c, s);
    if (block.cols() > 0) rank_update(s.gram, block);
  };

  // Column j of the float32 Grams of scratch sets 0..active-1 added into the float64
  // Gram (in set order), and zeroed for the next chunk.
  auto fold_column = [&](Index j, int active) {
    auto target = gram_.col(j).tail(d - j);
    for (int a = 0; a < active; ++a) {
      auto part = scratch[a].gram.col(j).tail(d - j);
      target += part.template cast<double>();
      part.setZero();
    }
  };

  if (share_chunks) {
    // One chunk at a time; its panels (same arithmetic as rank_update, so the result is
    // bit-identical to the one-thread-per-chunk path) are spread over the threads,
    // largest first; then the float32 Gram is added into the float64 one, by columns.
    GramScratch<T>& s = scratch[0];
    const Index n_panels = (d + kPanel - 1) / kPanel;
    for (Index c = 0; c < n_chunks; ++c) {
      const Eigen::Ref<const MatrixX<T>> block = gather_chunk(c, s);
      LMDX_PRAGMA(omp parallel num_threads(threads)) {
        if (block.cols() > 0) {
          LMDX_PRAGMA(omp for schedule(dynamic, 1))
          for (Index p = 0; p < n_panels; ++p) panel_update(s.gram, block, p * kPanel);
        }
        LMDX_PRAGMA(omp for schedule(dynamic, 16))
        for (Index j = 0; j < d; ++j) fold_column(j, 1);
      }
      sum_ += s.sum;
      s.sum.setZero();
    }
    count_ += count;
    return;
  }

  LMDX_PRAGMA(omp parallel num_threads(threads)) {
    const int t = thread_id();
    for (Index round = 0; round < n_chunks; round += threads) {
      if (round + t < n_chunks) process_chunk(round + t, scratch[t]);
      const int active = static_cast<int>(std::min<Index>(threads, n_chunks - round));
      LMDX_PRAGMA(omp barrier)
      LMDX_PRAGMA(omp for schedule(dynamic, 16))
      for (Index j = 0; j < d; ++j) fold_column(j, active);
      LMDX_PRAGMA(omp single) {
        for (int a = 0; a < active; ++a) {
          sum_ += scratch[a].sum;
          scratch[a].sum.setZero();
        }
      }
    }
  }
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

LMDX_NAMESPACE_END
