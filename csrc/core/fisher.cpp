#include "core/fisher.hpp"

#include <Eigen/Core>
#include <algorithm>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/parallel.hpp"
#include "core/register_tile.hpp"
#include "core/workspace.hpp"

LMDX_NAMESPACE_BEGIN

namespace {

using Eigen::internal::padd;
using Eigen::internal::pload;
using Eigen::internal::pmul;
using Eigen::internal::pstore;
using Eigen::internal::pzero;

// Columns of the result one task keeps partial sums for (with MR rows: 24 KiB).
constexpr Index kTaskCols = 128;
// Examples whose squares are summed in the input precision before they are added in
// float64: for positive float32 terms within (16 - 1)·2⁻²⁴ < 1e-6 relative (the bound
// lmdx.stats.fisher's torch path keeps with its _FLOAT32_TERMS, the same 16).
constexpr Index kSquaresPerFlush = 16;

// One example's products of a tile of R = MPe*S rows by NR columns:
// product[n][i] = Σ_s a[s][i] · b[s][n] over its t rows, from packed operands (a: t rows of
// R values, b: t rows of NR values), accumulated in registers in the input precision (as a
// float32 matrix product does); then each product is squared in registers and added into
// the tile's partial sums, also in the input precision (column n at partial + n * ld).
template <typename T, int MPe>
void micro_tile(const T* a, const T* b, Index t, T* partial, Index ld) {
  using P = Tile<T>;
  using Packet = typename P::Packet;
  constexpr int S = P::S;
  constexpr int NR = P::NR;
  constexpr int R = MPe * S;
  Packet acc[MPe][NR];
  for (int m = 0; m < MPe; ++m) {
    for (int n = 0; n < NR; ++n) acc[m][n] = pzero(Packet());
  }
  tile_product<T, MPe>(a, R, b, NR, t, acc);
  // The caller adds the partial sums into float64 every kSquaresPerFlush examples.
  for (int n = 0; n < NR; ++n) {
    T* column = partial + n * ld;
    for (int m = 0; m < MPe; ++m) {
      const Packet square = pmul(acc[m][n], acc[m][n]);
      pstore(column + m * S, padd(pload<Packet>(column + m * S), square));
    }
  }
}

// An array of T owned by one call, aligned for this variant's packets (Eigen's allocator).
template <typename T>
class AlignedBuffer {
 public:
  explicit AlignedBuffer(size_t size)
      : data_(static_cast<T*>(
            Eigen::internal::aligned_malloc(std::max<size_t>(size, 1) * sizeof(T)))) {}
  ~AlignedBuffer() { Eigen::internal::aligned_free(data_); }
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  T* data() noexcept { return data_; }

 private:
  T* data_;
};

// The same sums one entry at a time, for the rows and columns the tiles leave over, added
// into `entry` as the tiles add theirs.
template <typename T>
void scalar_add(const T* a, const T* b, Index n, Index t, Index p, Index q, Index i, Index j,
                double* entry) {
  for (Index e0 = 0; e0 < n; e0 += kSquaresPerFlush) {
    T partial = T(0);
    for (Index e = e0; e < std::min(n, e0 + kSquaresPerFlush); ++e) {
      const T* ae = a + e * t * p;
      const T* be = b + e * t * q;
      T product = T(0);
      for (Index s = 0; s < t; ++s) product += ae[s * p + i] * be[s * q + j];
      partial += product * product;
    }
    *entry += static_cast<double>(partial);
  }
}

// Whether any of the n values at x is not zero.
template <typename T>
bool any_nonzero(const T* x, Index n) {
  for (Index i = 0; i < n; ++i) {
    if (x[i] != T(0)) return true;
  }
  return false;
}

// out[j * p + i] += Σ_e (Σ_s a[e, s, i] · b[e, s, j])²: the sums in the layout the tiles
// make (a's features along the packets), so that each task adds its float32 partial sums
// into float64 a contiguous run of MR values per column.
template <typename T>
void sum_squared_products_impl(const T* a, const T* b, Index n, Index t, Index p, Index q,
                               double* out, int threads) {
  using P = Tile<T>;
  constexpr Index S = P::S, MR = P::MR, NR = P::NR;
  const Index p_tiled = p / S * S;    // rows the tiles cover (whole packets)
  const Index q_tiled = q / NR * NR;  // columns the tiles cover
  const Index row_blocks = (p_tiled + MR - 1) / MR;
  const Index col_blocks = (q_tiled + kTaskCols - 1) / kTaskCols;
  // Rows whose a or b values are all zero add exactly nothing to any product (the inputs
  // are finite; an accumulator that starts at +0 stays the same after adding ±0), so the
  // tiles skip them: padding, and positions a loss does not read (an output gradient of
  // zero), cost nothing and the sums are the same bit for bit. Example e keeps
  // kept_rows[e] rows, packed from offset[e] on; source[r] is the row s of kept row r.
  std::vector<Index> kept_rows(static_cast<size_t>(n)), offset(static_cast<size_t>(n));
  std::vector<unsigned char> keep(static_cast<size_t>(n * t));
  LMDX_PRAGMA(omp parallel for num_threads(threads) schedule(static))
  for (Index es = 0; es < n * t; ++es) {
    keep[static_cast<size_t>(es)] = any_nonzero(a + es * p, p) && any_nonzero(b + es * q, q);
  }
  std::vector<Index> source;
  source.reserve(static_cast<size_t>(n * t));
  for (Index e = 0; e < n; ++e) {
    offset[static_cast<size_t>(e)] = static_cast<Index>(source.size());
    for (Index s = 0; s < t; ++s) {
      if (keep[static_cast<size_t>(e * t + s)]) source.push_back(e * t + s);
    }
    kept_rows[static_cast<size_t>(e)] =
        static_cast<Index>(source.size()) - offset[static_cast<size_t>(e)];
  }
  const Index kept = static_cast<Index>(source.size());
  // The operands packed once, so that every tile reads contiguous panels (rows of a p- or
  // q-wide array are far apart and would meet in a few cache sets): for example e (its
  // t_e = kept_rows[e] kept rows), row block rb (MR rows, the last possibly fewer) of a as
  // t_e rows of its width, and each group of NR columns of b as t_e rows of NR values.
  // Their size follows each call's batch (up to the inputs' size), so they are allocated
  // per call rather than kept in the scratch pool, which would hold every size it met.
  AlignedBuffer<T> packed_a(static_cast<size_t>(kept * p_tiled));
  AlignedBuffer<T> packed_b(static_cast<size_t>(kept * q_tiled));
  LMDX_PRAGMA(omp parallel num_threads(threads)) {
    LMDX_PRAGMA(omp for schedule(static))
    for (Index r = 0; r < kept; ++r) {
      const Index es = source[static_cast<size_t>(r)], e = es / t;
      const Index first = offset[static_cast<size_t>(e)];
      const Index t_e = kept_rows[static_cast<size_t>(e)], k = r - first;
      const T* from_a = a + es * p;
      for (Index i0 = 0; i0 < p_tiled; i0 += MR) {
        const Index width = std::min(MR, p_tiled - i0);
        T* to = packed_a.data() + first * p_tiled + i0 * t_e + k * width;
        for (Index i = 0; i < width; ++i) to[i] = from_a[i0 + i];
      }
      const T* from_b = b + es * q;
      T* to_b = packed_b.data() + first * q_tiled + k * NR;
      for (Index j = 0; j < q_tiled; j += NR) {
        for (Index c = 0; c < NR; ++c) to_b[j * t_e + c] = from_b[j + c];
      }
    }  // implicit barrier: the tiles read every example's panels
    BufferLease<T> partial(static_cast<size_t>(MR * kTaskCols));
    // Tasks: a block of MR rows by kTaskCols columns; every example in order.
    LMDX_PRAGMA(omp for schedule(dynamic, 1) nowait)
    for (Index task = 0; task < row_blocks * col_blocks; ++task) {
      const Index i0 = (task / col_blocks) * MR;
      const Index j0 = (task % col_blocks) * kTaskCols;
      const Index height = std::min(MR, p_tiled - i0);
      const Index cols = std::min(kTaskCols, q_tiled - j0);
      const auto micro =
          for_packets(height / S, [](auto k) { return &micro_tile<T, decltype(k)::value>; });
      for (Index e0 = 0; e0 < n; e0 += kSquaresPerFlush) {
        std::fill(partial.data(), partial.data() + height * cols, T(0));
        for (Index e = e0; e < std::min(n, e0 + kSquaresPerFlush); ++e) {
          const Index first = offset[static_cast<size_t>(e)];
          const Index t_e = kept_rows[static_cast<size_t>(e)];
          if (t_e == 0) continue;  // adds nothing
          const T* panel_a = packed_a.data() + first * p_tiled + i0 * t_e;
          const T* panel_b = packed_b.data() + first * q_tiled + j0 * t_e;
          for (Index j = 0; j < cols; j += NR) {
            micro(panel_a, panel_b + j * t_e, t_e, partial.data() + j * height, height);
          }
        }
        for (Index j = 0; j < cols; ++j) {
          double* column = out + (j0 + j) * p + i0;
          const T* from = partial.data() + j * height;
          for (Index i = 0; i < height; ++i) column[i] += static_cast<double>(from[i]);
        }
      }
    }
    // What the tiles leave over: rows past p_tiled (every column), columns past q_tiled.
    LMDX_PRAGMA(omp for schedule(dynamic, 16))
    for (Index j = 0; j < q; ++j) {
      for (Index i = j < q_tiled ? p_tiled : 0; i < p; ++i) {
        scalar_add(a, b, n, t, p, q, i, j, out + j * p + i);
      }
    }
  }
}

}  // namespace

void sum_squared_products(const ArrayView& a, const ArrayView& b, double* out, int n_threads) {
  const int threads = resolve_threads(n_threads);
  if (a.shape.size() != 3 || b.shape.size() != 3) {
    throw std::invalid_argument("a, b: expected (examples, rows, features) arrays, got a " +
                                describe(a) + " and a " + describe(b));
  }
  if (a.shape[0] != b.shape[0] || a.shape[1] != b.shape[1]) {
    throw std::invalid_argument("b: expected the examples and rows of a, " + describe(a) +
                                ", got a " + describe(b));
  }
  if (a.is_float32 != b.is_float32) {
    throw std::invalid_argument("a, b: expected one dtype, got a " + describe(a) + " and a " +
                                describe(b));
  }
  const Index n = a.shape[0], t = a.shape[1], p = a.shape[2], q = b.shape[2];
  if (n == 0 || t == 0 || p == 0 || q == 0) return;
  require_finite(a, 0, "a", n_threads);
  require_finite(b, 0, "b", n_threads);
  // The tiles' packets run along the first operand's features and the result is written
  // along them, so b goes first: its features are the columns of the row-major p x q out.
  if (a.is_float32) {
    sum_squared_products_impl(b.f32(), a.f32(), n, t, q, p, out, threads);
  } else {
    sum_squared_products_impl(b.f64(), a.f64(), n, t, q, p, out, threads);
  }
}

LMDX_NAMESPACE_END
