#include "core/gram_product.hpp"

#include <algorithm>
#include <stdexcept>

#include "core/parallel.hpp"

LMDX_NAMESPACE_BEGIN

namespace {

using RowMajorXd = Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using Panel = Eigen::Map<const RowMajorXd, 0, Eigen::OuterStride<>>;

// The order d of `gram`, checked: (d, d), or (d (d + 1) / 2,) packed.
Index gram_order(const ArrayView& gram) {
  if (gram.is_float32) throw std::invalid_argument("gram: expected float64, got float32");
  if (gram.shape.size() == 2) {
    if (gram.shape[0] != gram.shape[1]) {
      throw std::invalid_argument("gram: expected a square (d, d) Gram, got shape " +
                                  shape_of(gram.shape));
    }
    return gram.shape[0];
  }
  if (gram.shape.size() != 1) {
    throw std::invalid_argument("gram: expected (d, d) or a packed (d (d + 1) / 2,) triangle, "
                                "got shape " + shape_of(gram.shape));
  }
  const Index n = gram.shape[0];
  Index d = 0;
  while (d * (d + 1) / 2 < n) ++d;
  if (d * (d + 1) / 2 != n) {
    throw std::invalid_argument("gram: " + std::to_string(n) +
                                " values are no packed triangle (d (d + 1) / 2 for some d)");
  }
  return d;
}

}  // namespace

void gram_product(const ArrayView& gram, const ArrayView& y, int n_threads, double* out) {
  const Index d = gram_order(gram);
  if (y.is_float32 || y.shape.size() != 2 || y.shape[0] != d) {
    throw std::invalid_argument("y: expected a float64 array of shape (" + std::to_string(d) +
                                ", p) for a Gram of order " + std::to_string(d) + ", got a " +
                                describe(y));
  }
  const Index p = y.shape[1];
  Eigen::Map<RowMajorXd> o(out, d, p);
  o.setZero();
  if (d == 0 || p == 0) return;
  const bool packed = gram.shape.size() == 1;
  const double* g = gram.f64();
  const Eigen::Map<const RowMajorXd> yv(y.f64(), d, p);
  RowMajorXd panel(std::min(kPanelRows, d), d);
  const Index chunks = (p + kColumnChunk - 1) / kColumnChunk;
  const int threads = static_cast<int>(std::max<Index>(1, std::min<Index>(n_threads, chunks)));
  LMDX_PRAGMA(omp parallel num_threads(threads))
  for (Index j0 = 0; j0 < d; j0 += kPanelRows) {
    const Index h = std::min(kPanelRows, d - j0);
    const Index width = d - j0;
    LMDX_PRAGMA(omp for schedule(static))
    for (Index a = 0; a < h; ++a) {
      const Index j = j0 + a;
      // Row j of the upper triangle, from column j on: after rows 0..j-1 (d, d-1, ... values).
      const double* row = packed ? g + j * d - j * (j - 1) / 2 : g + j * d + j;
      double* dst = panel.data() + a * d;
      std::fill(dst, dst + a, 0.0);
      std::copy(row, row + (d - j), dst + a);
    }
    // (barrier at the end of the omp for: the panel is complete)
    const Panel pv(panel.data(), h, width, Eigen::OuterStride<>(d));
    LMDX_PRAGMA(omp for schedule(dynamic, 1))
    for (Index c = 0; c < chunks; ++c) {
      const Index c0 = c * kColumnChunk;
      const Index w = std::min(kColumnChunk, p - c0);
      o.block(j0, c0, h, w).noalias() += pv * yv.block(j0, c0, width, w);
    }
    // The mirror takes the strictly upper part: the diagonal is counted once, above.
    LMDX_PRAGMA(omp for schedule(static))
    for (Index a = 0; a < h; ++a) panel(a, a) = 0.0;
    LMDX_PRAGMA(omp for schedule(dynamic, 1))
    for (Index c = 0; c < chunks; ++c) {
      const Index c0 = c * kColumnChunk;
      const Index w = std::min(kColumnChunk, p - c0);
      o.block(j0, c0, width, w).noalias() += pv.transpose() * yv.block(j0, c0, h, w);
    }
    // (barrier: no thread overwrites the panel while another multiplies by it)
  }
}

LMDX_NAMESPACE_END
