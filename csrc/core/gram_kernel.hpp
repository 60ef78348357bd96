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
//
// bfloat16 rows have two kernels (GramPath). `widen` widens them to float32 while packing
// (exact) and multiplies in float32 with FMAs. `bf16_dot` (AVX-512 builds, on CPUs with
// AVX512_BF16) packs them as they are, two rows interleaved per feature, and multiplies
// with the CPU's bf16 dot-product instruction (VDPBF16PS: 32 products per instruction,
// twice the float32 FMA's). A product of two bfloat16 values is exact in float32; each
// tile entry is a float32 sum over <= kFlushRows rows as in `widen`, and up to
// kBf16Segments = 8 such sums (<= 512 rows) are added in float32 before the float64 Gram
// (a float64 flush every 64 rows would cost twice its share of `widen`'s time at twice
// the product rate). Its error against a float64 Gram of the same values is of the same
// order as `widen`'s (tests/core/test_gram_bf16.py, bench/RESULTS.md); the instruction
// treats float32 values below 2^-126 (and bfloat16 inputs that small) as zero, so products
// of magnitude below ~1.2e-38 count as 0. Rows weighted other than 0 or 1 go through
// `widen` (a weight's square root would round in bfloat16).
#pragma once

#include <Eigen/Core>

#include "core/config.hpp"

// Builds (AVX-512 ones, with gcc or clang) that compile the bf16 dot-product kernel; it runs
// only where bf16_dot_available().
#if defined(EIGEN_VECTORIZE_AVX512) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define LMDX_HAVE_BF16_DOT 1
#endif

LMDX_NAMESPACE_BEGIN

/// Rows per float32 register accumulation before it is added into the float64 Gram.
constexpr Index kFlushRows = 64;

/// How bfloat16 rows are multiplied (see above).
enum class GramPath { widen, bf16_dot };

/// Whether this copy of the core has the `bf16_dot` kernel and this CPU runs it.
bool bf16_dot_available() noexcept;

/// Input row types: float32 and float64 are multiplied in their own precision; bfloat16
/// and float16 are widened to float32 while packing (exact) and multiplied in float32,
/// except bfloat16 with GramPath::bf16_dot (std::invalid_argument if not available).
template <typename In>
void gram_update(const In* x, Index rows, Index d, const double* weights, Index block_rows,
                 int n_threads, double* gram, Index ld, double* sum,
                 GramPath path = GramPath::widen);

/// Register tile of the kernel compiled in this variant: {MR, NR} for float and double.
struct GramTile {
  int mr_float, nr_float, mr_double, nr_double;
};
GramTile gram_tile() noexcept;

LMDX_NAMESPACE_END
