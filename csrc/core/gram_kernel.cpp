#include "core/gram_kernel.hpp"

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <type_traits>

#include "core/parallel.hpp"
#include "core/register_tile.hpp"
#include "core/workspace.hpp"

LMDX_NAMESPACE_BEGIN

namespace {

using Eigen::internal::pstore;
using Eigen::internal::pzero;

// Rows packed by one task; each group's features are summed separately, then the groups
// are added in order, so the sums do not depend on the thread count either.
constexpr Index kPackGroup = 32;

// Bytes of packed rows per panel of Gram columns, so that a panel stays in L2 (the
// smallest seen: 512 KiB) while the strips below it pass over it.
constexpr Index kPanelBytes = 256 * 1024;

// Rows [row0, row0 + MPe*S) x columns [j0, j0 + NR) of the Gram += the product of the
// packed operands a (rows) and b (columns) over K packed rows (stride MR per row), adding
// the register tile into the float64 Gram every kFlushRows rows. Only entries inside the
// lower triangle and inside d x d are written.
template <typename T, int MPe>
void micro_tile(const T* a, const T* b, Index K, Index flush_rows, double* gram, Index ld,
                Index row0, Index j0, Index d) {
  using P = Tile<T>;
  using Packet = typename P::Packet;
  constexpr int S = P::S;
  constexpr int NR = P::NR;
  constexpr int MR = P::MR;
  alignas(64) T buffer[NR][MPe * S];
  Packet acc[MPe][NR];
  const Index n_cols = std::min<Index>(NR, d - j0);
  const Index hi = std::min<Index>(MPe * S, d - row0);
  // The float64 tile is first touched at the first flush, kFlushRows rows from now: ask
  // for its cache lines now so the flush does not wait on memory (a large Gram lives in
  // DRAM, one tile's columns are ld apart).
  for (Index n = 0; n < n_cols; ++n) {
    const double* column = gram + (j0 + n) * ld + row0;
    for (Index i = 0; i < hi; i += 64 / static_cast<Index>(sizeof(double))) {
      __builtin_prefetch(column + i, 1, 3);
    }
    __builtin_prefetch(column + hi - 1, 1, 3);
  }
  Index k = 0;
  while (k < K) {
    for (int p = 0; p < MPe; ++p) {
      for (int n = 0; n < NR; ++n) acc[p][n] = pzero(Packet());
    }
    const Index stop = std::min(K, k + flush_rows);
    tile_product<T, MPe>(a + k * MR, MR, b + k * MR, MR, stop - k, acc);
    k = stop;
    for (int n = 0; n < NR; ++n) {
      for (int p = 0; p < MPe; ++p) pstore(&buffer[n][p * S], acc[p][n]);
    }
    for (Index n = 0; n < n_cols; ++n) {
      double* column = gram + (j0 + n) * ld + row0;
      const Index lo = std::max<Index>(0, j0 + n - row0);  // lower triangle only
      for (Index i = lo; i < hi; ++i) column[i] += static_cast<double>(buffer[n][i]);
    }
  }
}

// Precision the products of an input type are computed in.
template <typename In>
using Compute = std::conditional_t<std::is_same_v<In, double>, double, float>;

}  // namespace

template <typename In>
void gram_update(const In* x, Index rows, Index d, const double* weights, Index block_rows,
                 int n_threads, double* gram, Index ld, double* sum) {
  using T = Compute<In>;
  using P = Tile<T>;
  constexpr Index MR = P::MR;
  constexpr Index NR = P::NR;
  constexpr Index S = P::S;
  if (rows <= 0) return;
  const Index n_strips = (d + MR - 1) / MR;
  const Index kc = std::max<Index>(1, std::min(block_rows, rows));
  const Index flush_rows = std::is_same_v<T, float> ? kFlushRows : kc;
  // Strip s, packed row k, feature f of the strip: packed[(s * kc + k) * MR + f].
  BufferLease<T> packed(static_cast<size_t>(n_strips * kc * MR));
  BufferLease<Index> kept_rows(static_cast<size_t>(kc));
  BufferLease<double> kept_weight(static_cast<size_t>(kc));
  BufferLease<double> partial(static_cast<size_t>((kc + kPackGroup - 1) / kPackGroup * d));
  const int threads = static_cast<int>(std::min<Index>(resolve_threads(n_threads), n_strips));
  const Index panel_cols =
      std::max<Index>(1, kPanelBytes / (kc * static_cast<Index>(sizeof(T))) / NR) * NR;

  Index next = 0;  // next input row to consider
  Index m = 0;     // kept rows in the current block
  LMDX_PRAGMA(omp parallel num_threads(threads)) {
    while (true) {
      LMDX_PRAGMA(omp single) {
        // The next block: up to kc rows with weight > 0, in input order.
        m = 0;
        while (next < rows && m < kc) {
          const double w = weights == nullptr ? 1.0 : weights[next];
          if (w != 0.0) {
            kept_rows[m] = next;
            kept_weight[m] = w;
            ++m;
          }
          ++next;
        }
      }  // implicit barrier: every thread sees the same block
      if (m == 0) break;
      // Pack the block: groups of kPackGroup rows a task, each row read in order and
      // spread over the strips; its features summed into the group's partial sums.
      const Index n_groups = (m + kPackGroup - 1) / kPackGroup;
      LMDX_PRAGMA(omp for schedule(static))
      for (Index g = 0; g < n_groups; ++g) {
        double* part = partial.data() + g * d;
        std::fill(part, part + d, 0.0);
        for (Index k = g * kPackGroup; k < std::min(m, (g + 1) * kPackGroup); ++k) {
          const In* in = x + kept_rows[k] * d;
          const double w = kept_weight[k];
          const T scale = static_cast<T>(std::sqrt(w));  // used only when w != 1
          for (Index s = 0; s < n_strips; ++s) {
            const Index f0 = s * MR;
            const Index width = std::min(MR, d - f0);
            T* out = packed.data() + (s * kc + k) * MR;
            if (w == 1.0) {
              for (Index f = 0; f < width; ++f) out[f] = static_cast<T>(in[f0 + f]);
            } else {
              for (Index f = 0; f < width; ++f) out[f] = static_cast<T>(in[f0 + f]) * scale;
            }
            for (Index f = width; f < MR; ++f) out[f] = T(0);
          }
          if (w == 1.0) {
            for (Index f = 0; f < d; ++f) part[f] += static_cast<double>(static_cast<T>(in[f]));
          } else {
            for (Index f = 0; f < d; ++f) {
              part[f] += w * static_cast<double>(static_cast<T>(in[f]));
            }
          }
        }
      }
      // Partial sums added in group order (the tiles below do not touch sum; the next
      // block's packing comes after their barrier).
      LMDX_PRAGMA(omp for schedule(static) nowait)
      for (Index f = 0; f < d; ++f) {
        for (Index g = 0; g < n_groups; ++g) sum[f] += partial[static_cast<size_t>(g * d + f)];
      }
      // Tiles, one panel of columns at a time so that the panel's packed rows stay in
      // L2 while every strip below it passes over them: strip si covers Gram rows
      // [si*MR, si*MR + MR) of the panel's columns up to its diagonal; strips are
      // disjoint rows, largest (last) first. Panels are disjoint columns, so a thread
      // done with one panel's tiles goes on to the next without waiting for the others
      // (nowait; one barrier after the last panel, before the next block is chosen and
      // packed). The order of the tiles does not change the arithmetic of any entry.
      for (Index c0 = 0; c0 < d; c0 += panel_cols) {
        const Index c1 = std::min(d, c0 + panel_cols);
        LMDX_PRAGMA(omp for schedule(dynamic, 1) nowait)
        for (Index t = 0; t < n_strips - c0 / MR; ++t) {
          const Index si = n_strips - 1 - t;
          const Index i0 = si * MR;
          const T* a = packed.data() + si * kc * MR;
          for (Index j0 = c0; j0 < std::min(i0 + MR, c1); j0 += NR) {
            const T* b = packed.data() + (j0 / MR) * kc * MR + j0 % MR;
            // Column blocks meeting the diagonal skip the packets above it; the last strip
            // skips the packets past d.
            const Index skip = j0 > i0 ? (j0 - i0) / S : 0;
            const Index row0 = i0 + skip * S;
            const Index packets = std::min<Index>(P::MP - skip, (d - row0 + S - 1) / S);
            const auto micro =
                for_packets(packets, [](auto k) { return &micro_tile<T, decltype(k)::value>; });
            micro(a + skip * S, b, m, flush_rows, gram, ld, row0, j0, d);
          }
        }
      }
      LMDX_PRAGMA(omp barrier)
    }
  }
}

template void gram_update<float>(const float*, Index, Index, const double*, Index, int, double*,
                                 Index, double*);
template void gram_update<double>(const double*, Index, Index, const double*, Index, int, double*,
                                  Index, double*);
template void gram_update<Eigen::half>(const Eigen::half*, Index, Index, const double*, Index, int,
                                       double*, Index, double*);
template void gram_update<Eigen::bfloat16>(const Eigen::bfloat16*, Index, Index, const double*,
                                           Index, int, double*, Index, double*);

GramTile gram_tile() noexcept {
  return {Tile<float>::MR, Tile<float>::NR, Tile<double>::MR, Tile<double>::NR};
}

LMDX_NAMESPACE_END
