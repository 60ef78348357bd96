// The diagonal Fisher of a linear weight without per-example gradients in memory.
//
// Example e's gradient of a linear weight is a sum of outer products over its rows,
// G_e = A_eᵀ B_e (A_e: its t rows of output gradients, B_e: its t rows of inputs; for a
// [in, out] Conv1D weight the two swap). The diagonal Fisher needs Σ_e G_e ∘ G_e. Per
// register tile of the p x q result (as in the Gram kernel) the products are formed for one
// example at a time and squared in registers, so no per-example gradient is ever stored.
// Rows whose a or b values are all zero (padding, and positions the loss does not read,
// whose output gradient is zero: in a sequence classifier's last layer every position but
// the one it pools) are skipped, which leaves every sum the same bit for bit.
#pragma once

#include "core/arrays.hpp"

LMDX_NAMESPACE_BEGIN

/// out[i, j] += Σ_e (Σ_s a[e, s, i] · b[e, s, j])² for `a` (n, t, p) and `b` (n, t, q),
/// both float32 or both float64. The products are formed in that precision (as a float32
/// matrix product would), their squares summed in it over up to 16 examples and those
/// partial sums added into `out` in float64, in order; `out` holds p · q values
/// (row-major). Examples are taken in order within each tile, so the result does not
/// depend on the thread count.
void sum_squared_products(const ArrayView& a, const ArrayView& b, double* out, int n_threads);

LMDX_NAMESPACE_END
