// RegMean's alpha reduction of a Gram, in one place for every solver that applies it:
//   G~ = alpha G + (1 - alpha) diag(G)      (off-diagonal entries x alpha, diagonal kept)
// Both sides of a RegMean system use it: the system sum_i c_i G~_i (spd.cpp, regmean.cpp,
// regmean_float32.cpp) and the Gram differences of the right-hand side (regmean_kernels.cpp).
#pragma once

#include "core/config.hpp"

LMDX_NAMESPACE_BEGIN

/// Reduce, in place, the block m of a symmetric matrix whose entry (0, 0) is the matrix's
/// (row0, col0): entries off the matrix's diagonal are multiplied by alpha, the diagonal is
/// kept. Any block shape (a column of the lower triangle, tiles of rows). float64 blocks.
template <typename Derived>
void reduce_off_diagonal(const Eigen::MatrixBase<Derived>& block, Index row0, Index col0,
                         double alpha) {
  if (alpha == 1.0) return;
  auto& m = const_cast<Eigen::MatrixBase<Derived>&>(block);  // Eigen's idiom for block arguments
  for (Index c = 0; c < m.cols(); ++c) {
    const Index r = col0 + c - row0;  // where the matrix's diagonal crosses column c
    if (r >= 0 && r < m.rows()) {
      const double kept = m(r, c);
      m.col(c) *= alpha;
      m(r, c) = kept;
    } else {
      m.col(c) *= alpha;
    }
  }
}

/// The same for the lower triangle of the square m (its upper one is left as it is).
inline void reduce_lower_triangle(Eigen::Ref<MatrixXd> m, double alpha) {
  if (alpha == 1.0) return;
  for (Index j = 0; j + 1 < m.cols(); ++j) m.col(j).tail(m.rows() - j - 1) *= alpha;
}

/// The product of the reduced system A = G~ + shift I with v, from the plain product
/// out = G v: out <- alpha out + ((1 - alpha) diag(G) + shift) v.
template <typename Diagonal>
void finish_reduced_product(const Eigen::MatrixBase<Diagonal>& diagonal, const MatrixXd& v,
                            double alpha, double shift, MatrixXd& out) {
  if (alpha != 1.0) out *= alpha;
  const VectorXd scale = ((1.0 - alpha) * diagonal.array() + shift).matrix();
  out += scale.asDiagonal() * v;
}

LMDX_NAMESPACE_END
