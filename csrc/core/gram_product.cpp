#include "core/gram_product.hpp"

#include <algorithm>
#include <stdexcept>
#include <vector>

#include "core/parallel.hpp"

LMDX_NAMESPACE_BEGIN

namespace {

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

// Row j of the upper triangle from column j on (d - j values): after rows 0..j-1 (d, d-1,
// ... values) when packed, at (j, j) of the row-major matrix when full.
inline const double* upper_row(const double* g, bool packed, Index d, Index j) {
  return packed ? g + j * d - j * (j - 1) / 2 : g + j * d + j;
}

// One chunk of kColumnChunk columns: y and out hold its columns, kColumnChunk per row
// (row-major, d rows). Rows of the triangle are taken kRowGroup at a time: for every column
// c past the group's small triangle, y[c] is loaded once for the group's kRowGroup dot
// products (the upper part, out[j + r] += sum_c G[j + r, c] y[c]) and out[c] once for its
// kRowGroup mirrored terms (out[c] += G[j + r, c] y[j + r]).
void chunk_product(const double* g, bool packed, Index d, const double* y, double* out) {
  constexpr Index W = kColumnChunk;
  constexpr Index R = kRowGroup;
  for (Index j = 0; j < d; j += R) {
    const Index h = std::min(R, d - j);
    const double* rows[R];
    for (Index r = 0; r < h; ++r) rows[r] = upper_row(g, packed, d, j + r);
    double acc[R][W] = {};
    // The group's own square [j, j + h): entry (j + a, j + b), b >= a, is rows[a][b - a].
    for (Index a = 0; a < h; ++a) {
      for (Index b = a; b < h; ++b) {
        const double v = rows[a][b - a];
        for (Index t = 0; t < W; ++t) acc[a][t] += v * y[(j + b) * W + t];
        if (b > a) {
          for (Index t = 0; t < W; ++t) out[(j + b) * W + t] += v * y[(j + a) * W + t];
        }
      }
    }
    if (h == R) {
      double yr[R][W];
      for (Index r = 0; r < R; ++r) {
        for (Index t = 0; t < W; ++t) yr[r][t] = y[(j + r) * W + t];
      }
      for (Index c = j + R; c < d; ++c) {
        const double* yc = y + c * W;
        double* oc = out + c * W;
        double v[R];
        for (Index r = 0; r < R; ++r) v[r] = rows[r][c - j - r];
        double mirrored[W];
        for (Index t = 0; t < W; ++t) {
          double s = oc[t];
          for (Index r = 0; r < R; ++r) {
            acc[r][t] += v[r] * yc[t];
            s += v[r] * yr[r][t];
          }
          mirrored[t] = s;
        }
        for (Index t = 0; t < W; ++t) oc[t] = mirrored[t];
      }
    }
    for (Index r = 0; r < h; ++r) {
      for (Index t = 0; t < W; ++t) out[(j + r) * W + t] += acc[r][t];
    }
  }
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
  std::fill(out, out + d * p, 0.0);
  if (d == 0 || p == 0) return;
  const bool packed = gram.shape.size() == 1;
  const double* g = gram.f64();
  const double* yv = y.f64();
  const Index chunks = (p + kColumnChunk - 1) / kColumnChunk;
  const int threads = static_cast<int>(std::max<Index>(1, std::min<Index>(n_threads, chunks)));
  LMDX_PRAGMA(omp parallel num_threads(threads)) {
    // A chunk's columns, gathered (zeros past p) and its product, then scattered.
    std::vector<double> ys(static_cast<size_t>(d * kColumnChunk));
    std::vector<double> os(static_cast<size_t>(d * kColumnChunk));
    LMDX_PRAGMA(omp for schedule(dynamic, 1))
    for (Index c = 0; c < chunks; ++c) {
      const Index c0 = c * kColumnChunk;
      const Index w = std::min(kColumnChunk, p - c0);
      for (Index i = 0; i < d; ++i) {
        for (Index t = 0; t < kColumnChunk; ++t) {
          ys[i * kColumnChunk + t] = t < w ? yv[i * p + c0 + t] : 0.0;
        }
      }
      std::fill(os.begin(), os.end(), 0.0);
      chunk_product(g, packed, d, ys.data(), os.data());
      for (Index i = 0; i < d; ++i) {
        for (Index t = 0; t < w; ++t) out[i * p + c0 + t] = os[i * kColumnChunk + t];
      }
    }
  }
}

LMDX_NAMESPACE_END
