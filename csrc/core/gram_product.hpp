// The product G Y of a float64 Gram G (d x d, symmetric) with a few columns Y (d x p): the
// products that the estimate of what each task pays needs (python/lmdx/merge/cost.py),
// taken from the Gram as statistics files store it, its upper triangle packed row by row,
// or from a full matrix, without unpacking it.
//
// The columns of Y are taken kColumnChunk at a time (zeros past p), each chunk independent
// of the others (the threads share the chunks); within a chunk the triangle is read once,
// kRowGroup of its rows at a time, with each row of Y and of the result loaded once per
// group (chunk_product in the .cpp). Every result entry is summed in one fixed order, so
// the result does not depend on the thread count or on where the arrays lie in memory.
#pragma once

#include "core/arrays.hpp"

LMDX_NAMESPACE_BEGIN

/// Columns of Y per independent chunk of work.
constexpr Index kColumnChunk = 16;
/// Rows of the triangle taken together within a chunk.
constexpr Index kRowGroup = 4;

/// out (d x p, row-major) = G Y for `gram`, a full (d, d) symmetric float64 matrix or its
/// packed upper triangle (d (d + 1) / 2,), and `y` (d, p) float64, row-major.
/// std::invalid_argument naming the argument if the shapes disagree.
void gram_product(const ArrayView& gram, const ArrayView& y, int n_threads, double* out);

LMDX_NAMESPACE_END
