// The product G Y of a float64 Gram G (d x d, symmetric) with a few columns Y (d x p): the
// products that the estimate of what each task pays needs (python/lmdx/merge/cost.py),
// taken from the Gram as statistics files store it, its upper triangle packed row by row,
// or from a full matrix, without unpacking it.
//
// The triangle is read in panels of kPanelRows rows (row j from column j on), each copied
// once into a dense trapezoid P (zeros left of the diagonal) shared by the threads; then
// every fixed chunk of kColumnChunk columns of Y takes P's two products, the upper part
// out[j0..j1) += P Y[j0..d) and then, P's diagonal set to zero, its mirror
// out[j0..d) += P^T Y[j0..j1). A chunk's work is the same whichever thread runs it (Eigen's
// products of a few entries vectorize by the operands' addresses, so results agree to
// rounding, not to the bit, from one call to the next).
#pragma once

#include "core/arrays.hpp"

LMDX_NAMESPACE_BEGIN

/// Rows of the triangle copied per panel.
constexpr Index kPanelRows = 48;
/// Columns of Y per independent chunk of work.
constexpr Index kColumnChunk = 16;

/// out (d x p, row-major) = G Y for `gram`, a full (d, d) symmetric float64 matrix or its
/// packed upper triangle (d (d + 1) / 2,), and `y` (d, p) float64, row-major.
/// std::invalid_argument naming the argument if the shapes disagree.
void gram_product(const ArrayView& gram, const ArrayView& y, int n_threads, double* out);

LMDX_NAMESPACE_END
