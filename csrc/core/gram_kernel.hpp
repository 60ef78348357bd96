// Packed, register-tiled symmetric rank-k update of a float64 Gram matrix.
//
// gram (lower triangle, column-major, leading dimension ld) += sum over kept rows r of
// w_r x_r x_r^T, and sum += sum_r w_r x_r, for rows x_r of a row-major (rows x d) array.
//
// Rows are taken `block_rows` kept rows at a time. Each block is packed once (rows with
// weight 0 skipped, rows with weight w != 1 scaled by sqrt(w) in the input precision)
// into strips of MR features, a layout that serves both sides of the product; the threads
// share the packing and then the tiles of the lower triangle (disjoint rows of the Gram,
// so no write conflicts). A register tile of MR x NR products is accumulated in the input
// precision over at most kFlushRows rows and then added into the float64 Gram, so a
// float32 result entry is a float64 sum of float32 dot products of <= 64 terms. The
// arithmetic of every Gram entry is independent of the thread count.
#pragma once

#include <Eigen/Core>

#include "core/config.hpp"

LMDX_NAMESPACE_BEGIN

/// Rows per float32 register accumulation before it is added into the float64 Gram.
constexpr Index kFlushRows = 64;

/// Input row types: float32 and float64 are multiplied in their own precision; bfloat16
/// and float16 are widened to float32 while packing (exact) and multiplied in float32.
template <typename In>
void gram_update(const In* x, Index rows, Index d, const double* weights, Index block_rows,
                 int n_threads, double* gram, Index ld, double* sum);

/// Register tile of the kernel compiled in this variant: {MR, NR} for float and double.
struct GramTile {
  int mr_float, nr_float, mr_double, nr_double;
};
GramTile gram_tile() noexcept;

LMDX_NAMESPACE_END
