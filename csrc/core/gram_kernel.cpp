#include "core/gram_kernel.hpp"

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <type_traits>

#include "core/parallel.hpp"
#include "core/register_tile.hpp"
#include "core/workspace.hpp"

LMDX_NAMESPACE_BEGIN

namespace {

using Eigen::internal::pstore;
using Eigen::internal::pzero;

// Rows packed by one task; each group's features are summed separately, then the groups
// are added in order, so the sums do not depend on the thread count either. Even, so that
// the two rows of a bf16_dot step are packed by one task.
constexpr Index kPackGroup = 32;

// Bytes of packed rows per panel of Gram columns, so that a panel stays in L2 (the
// smallest seen: 512 KiB) while the strips below it pass over them.
constexpr Index kPanelBytes = 256 * 1024;

// Where one register tile goes: rows [row0, row0 + MPe*S) x columns [j0, j0 + NR) of the
// float64 Gram, of which only entries inside the lower triangle and inside d x d are written.
struct TileOut {
  double* gram;
  Index ld, row0, j0, d;
};

// The float64 tile is first touched at the first flush, kFlushRows rows after the tile
// starts: ask for its cache lines then, so the flush does not wait on memory (a large Gram
// lives in DRAM, one tile's columns are ld apart).
template <typename T, int MPe>
EIGEN_ALWAYS_INLINE void prefetch_tile(const TileOut& out) {
  constexpr int S = Tile<T>::S;
  const Index n_cols = std::min<Index>(Tile<T>::NR, out.d - out.j0);
  const Index hi = std::min<Index>(MPe * S, out.d - out.row0);
  for (Index n = 0; n < n_cols; ++n) {
    const double* column = out.gram + (out.j0 + n) * out.ld + out.row0;
    for (Index i = 0; i < hi; i += 64 / static_cast<Index>(sizeof(double))) {
      __builtin_prefetch(column + i, 1, 3);
    }
    __builtin_prefetch(column + hi - 1, 1, 3);
  }
}

// Add the register tile acc into the float64 Gram (lower triangle, inside d x d).
template <typename T, int MPe>
EIGEN_ALWAYS_INLINE void flush_tile(const typename Tile<T>::Packet (&acc)[MPe][Tile<T>::NR],
                                    const TileOut& out) {
  constexpr int S = Tile<T>::S;
  constexpr int NR = Tile<T>::NR;
  alignas(64) T buffer[NR][MPe * S];
  for (int n = 0; n < NR; ++n) {
    for (int p = 0; p < MPe; ++p) pstore(&buffer[n][p * S], acc[p][n]);
  }
  const Index n_cols = std::min<Index>(NR, out.d - out.j0);
  const Index hi = std::min<Index>(MPe * S, out.d - out.row0);
  for (Index n = 0; n < n_cols; ++n) {
    double* column = out.gram + (out.j0 + n) * out.ld + out.row0;
    const Index lo = std::max<Index>(0, out.j0 + n - out.row0);  // lower triangle only
    for (Index i = lo; i < hi; ++i) column[i] += static_cast<double>(buffer[n][i]);
  }
}

// The tile of packed operands a (rows of the Gram) and b (columns) over `steps` packed
// steps (stride MR per step), added into the float64 Gram every `flush_steps` steps.
template <typename T, int MPe>
void micro_tile(const T* a, const T* b, Index steps, Index flush_steps, const TileOut& out) {
  using P = Tile<T>;
  typename P::Packet acc[MPe][P::NR];
  prefetch_tile<T, MPe>(out);
  for (Index k = 0; k < steps;) {
    for (int p = 0; p < MPe; ++p) {
      for (int n = 0; n < P::NR; ++n) acc[p][n] = pzero(typename P::Packet());
    }
    const Index stop = std::min(steps, k + flush_steps);
    tile_product<T, MPe>(a + k * P::MR, P::MR, b + k * P::MR, P::MR, stop - k, acc);
    k = stop;
    flush_tile<T, MPe>(acc, out);
  }
}

// A kernel of gram_blocks: the type of the packed rows, how many rows one packed step
// holds (R, interleaved feature by feature), how a row is packed, and the micro tile.
// Strip s, packed row k, feature f of the strip lives at
// packed[(s * steps_per_block + k / R) * MR * R + f * R + k % R].
template <typename In, typename T>
struct WidenKernel {
  using Packed = T;
  using Micro = void (*)(const T*, const T*, Index, Index, const TileOut&);
  static constexpr Index R = 1;
  static constexpr Index MR = Tile<T>::MR, NR = Tile<T>::NR, S = Tile<T>::S;
  static constexpr Index kFlushSteps = std::is_same_v<T, float> ? kFlushRows : 0;  // 0: none

  // Features [f0, f0 + MR) of a row (zero past d), scaled by sqrt(w) where w != 1.
  static void pack(const In* in, Index f0, Index width, double w, T* out) {
    if (w == 1.0) {
      for (Index f = 0; f < width; ++f) out[f] = static_cast<T>(in[f0 + f]);
    } else {
      const T scale = static_cast<T>(std::sqrt(w));
      for (Index f = 0; f < width; ++f) out[f] = static_cast<T>(in[f0 + f]) * scale;
    }
    for (Index f = width; f < MR; ++f) out[f] = T(0);
  }

  static Micro micro(Index packets) {
    return for_packets(packets, [](auto p) -> Micro { return &micro_tile<T, decltype(p)::value>; });
  }
};

#ifdef LMDX_HAVE_BF16_DOT
#define LMDX_TARGET_BF16 __attribute__((target("avx512bf16")))

// Segments of kFlushRows rows whose float32 sums the bf16 dot kernel adds up in float32
// before it adds them into the float64 Gram: its products run at twice the float32 rate,
// so a float64 flush every 64 rows would cost twice the share of the time it does there.
constexpr Index kBf16Segments = 8;

// The tile of packed bfloat16 operands a and b over `steps` steps of two rows (stride
// 2 * MR values per step): for features m*16.. of a and feature n of b, the float32 sum
// of each segment of flush_steps steps (VDPBF16PS: exact products, float32 sums) is added
// into a float32 total, which is added into the float64 Gram every kBf16Segments segments.
template <int MPe>
LMDX_TARGET_BF16 void micro_tile_bf16(const std::uint16_t* a, const std::uint16_t* b, Index steps,
                                      Index flush_steps, const TileOut& out) {
  using P = Tile<float>;
  static_assert(P::S == 16, "the bf16 dot kernel works on 16 float32 lanes");
  constexpr Index step = 2 * P::MR;  // bfloat16 values per packed step of a strip
  __m512 acc[MPe][P::NR];
  __m512 total[MPe][P::NR];  // held in L1 (the registers hold acc)
  for (Index k = 0; k < steps;) {
    for (int p = 0; p < MPe; ++p) {
      for (int n = 0; n < P::NR; ++n) total[p][n] = _mm512_setzero_ps();
    }
    for (Index segment = 0; segment < kBf16Segments && k < steps; ++segment) {
      for (int p = 0; p < MPe; ++p) {
        for (int n = 0; n < P::NR; ++n) acc[p][n] = _mm512_setzero_ps();
      }
      const Index stop = std::min(steps, k + flush_steps);
      // the last segment before the flush: ask for the float64 tile's cache lines now
      if (segment + 1 == kBf16Segments || stop == steps) prefetch_tile<float, MPe>(out);
      for (; k < stop; ++k) {
        const std::uint16_t* ak = a + k * step;
        const std::uint16_t* bk = b + k * step;
        __m512i av[MPe];
        for (int m = 0; m < MPe; ++m) av[m] = _mm512_load_si512(ak + m * 2 * P::S);
        for (int n = 0; n < P::NR; ++n) {
          std::int32_t pair;
          std::memcpy(&pair, bk + 2 * n, sizeof(pair));
          const __m512i bv = _mm512_set1_epi32(pair);
          for (int m = 0; m < MPe; ++m) {
            acc[m][n] = _mm512_dpbf16_ps(acc[m][n], (__m512bh)av[m], (__m512bh)bv);
          }
        }
      }
      for (int p = 0; p < MPe; ++p) {
        for (int n = 0; n < P::NR; ++n) total[p][n] = _mm512_add_ps(total[p][n], acc[p][n]);
      }
    }
    flush_tile<float, MPe>(total, out);
  }
}

struct Bf16DotKernel {
  using Packed = std::uint16_t;
  using Micro = void (*)(const std::uint16_t*, const std::uint16_t*, Index, Index, const TileOut&);
  static constexpr Index R = 2;
  static constexpr Index MR = Tile<float>::MR, NR = Tile<float>::NR, S = Tile<float>::S;
  static constexpr Index kFlushSteps = kFlushRows / R;

  // Rows reach this kernel with weight 1 only.
  static void pack(const Eigen::bfloat16* in, Index f0, Index width, double, Packed* out) {
    for (Index f = 0; f < width; ++f) std::memcpy(out + f * R, in + f0 + f, sizeof(Packed));
    for (Index f = width; f < MR; ++f) out[f * R] = 0;
  }

  static Micro micro(Index packets) {
    return for_packets(packets,
                       [](auto p) -> Micro { return &micro_tile_bf16<decltype(p)::value>; });
  }
};

// Whether every weight is 0 or 1 (or there are none): rows the bf16 dot kernel can take.
bool zero_one_weights(const double* weights, Index rows) {
  if (weights == nullptr) return true;
  for (Index i = 0; i < rows; ++i) {
    if (weights[i] != 0.0 && weights[i] != 1.0) return false;
  }
  return true;
}
#endif

// The driver shared by the kernels: blocks of up to `block_rows` kept rows, each packed
// by all threads, then its lower-triangle tiles shared by them.
template <typename In, typename Kernel>
void gram_blocks(const In* x, Index rows, Index d, const double* weights, Index block_rows,
                 int n_threads, double* gram, Index ld, double* sum) {
  using Packed = typename Kernel::Packed;
  constexpr Index MR = Kernel::MR;
  constexpr Index NR = Kernel::NR;
  constexpr Index S = Kernel::S;
  constexpr Index R = Kernel::R;
  constexpr Index kMaxPackets = MR / S;
  if (rows <= 0) return;
  const Index n_strips = (d + MR - 1) / MR;
  const Index kc = std::max<Index>(1, std::min(block_rows, rows));
  const Index kc_steps = (kc + R - 1) / R;
  const Index flush_steps = Kernel::kFlushSteps > 0 ? Kernel::kFlushSteps : kc_steps;
  BufferLease<Packed> packed(static_cast<size_t>(n_strips * kc_steps * MR * R));
  BufferLease<Index> kept_rows(static_cast<size_t>(kc));
  BufferLease<double> kept_weight(static_cast<size_t>(kc));
  BufferLease<double> partial(static_cast<size_t>((kc + kPackGroup - 1) / kPackGroup * d));
  const int threads = static_cast<int>(std::min<Index>(resolve_threads(n_threads), n_strips));
  const Index panel_cols =
      std::max<Index>(1, kPanelBytes / (kc_steps * R * static_cast<Index>(sizeof(Packed))) / NR) *
      NR;

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
      const Index steps = (m + R - 1) / R;
      // Pack the block: groups of kPackGroup rows a task, each row read in order and
      // spread over the strips; its features summed into the group's partial sums. A
      // step that the block's last row leaves half full gets a zero row.
      const Index n_groups = (m + kPackGroup - 1) / kPackGroup;
      LMDX_PRAGMA(omp for schedule(static))
      for (Index g = 0; g < n_groups; ++g) {
        double* part = partial.data() + g * d;
        std::fill(part, part + d, 0.0);
        const Index end = std::min(m, (g + 1) * kPackGroup);
        for (Index k = g * kPackGroup; k < end + (end == m ? steps * R - m : 0); ++k) {
          const bool padding = k >= m;
          const In* in = x + kept_rows[padding ? 0 : k] * d;
          const double w = padding ? 0.0 : kept_weight[k];
          for (Index s = 0; s < n_strips; ++s) {
            Packed* out = packed.data() + (s * kc_steps + k / R) * MR * R + k % R;
            if (padding) {
              for (Index f = 0; f < MR; ++f) out[f * R] = Packed(0);
            } else {
              Kernel::pack(in, s * MR, std::min(MR, d - s * MR), w, out);
            }
          }
          if (padding) continue;
          using T = std::conditional_t<std::is_same_v<In, double>, double, float>;
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
          const Packed* a = packed.data() + si * kc_steps * MR * R;
          for (Index j0 = c0; j0 < std::min(i0 + MR, c1); j0 += NR) {
            const Packed* b = packed.data() + (j0 / MR) * kc_steps * MR * R + (j0 % MR) * R;
            // Column blocks meeting the diagonal skip the packets above it; the last strip
            // skips the packets past d.
            const Index skip = j0 > i0 ? (j0 - i0) / S : 0;
            const Index row0 = i0 + skip * S;
            const Index packets = std::min<Index>(kMaxPackets - skip, (d - row0 + S - 1) / S);
            Kernel::micro(packets)(a + skip * S * R, b, steps, flush_steps,
                                   TileOut{gram, ld, row0, j0, d});
          }
        }
      }
      LMDX_PRAGMA(omp barrier)
    }
  }
}

}  // namespace

bool bf16_dot_available() noexcept {
#ifdef LMDX_HAVE_BF16_DOT
  static const bool available = [] {
    const CpuFeatures f = cpu_features();
    return f.x86_64_v4 && f.avx512bf16;
  }();
  return available;
#else
  return false;
#endif
}

template <typename In>
void gram_update(const In* x, Index rows, Index d, const double* weights, Index block_rows,
                 int n_threads, double* gram, Index ld, double* sum, GramPath path) {
  using T = std::conditional_t<std::is_same_v<In, double>, double, float>;
  if (path == GramPath::bf16_dot) {
    if (!std::is_same_v<In, Eigen::bfloat16>) {
      throw std::invalid_argument("bf16_dot: the bf16 dot-product kernel takes bfloat16 rows only");
    }
    if (!bf16_dot_available()) {
      throw std::invalid_argument(
          "bf16_dot: this core has no bf16 dot-product kernel for this CPU (it needs the "
          "AVX-512 build of the core on a CPU with AVX512_BF16)");
    }
#ifdef LMDX_HAVE_BF16_DOT
    if constexpr (std::is_same_v<In, Eigen::bfloat16>) {
      if (zero_one_weights(weights, rows)) {
        gram_blocks<In, Bf16DotKernel>(x, rows, d, weights, block_rows, n_threads, gram, ld, sum);
        return;
      }
    }
#endif
  }
  gram_blocks<In, WidenKernel<In, T>>(x, rows, d, weights, block_rows, n_threads, gram, ld, sum);
}

template void gram_update<float>(const float*, Index, Index, const double*, Index, int, double*,
                                 Index, double*, GramPath);
template void gram_update<double>(const double*, Index, Index, const double*, Index, int, double*,
                                  Index, double*, GramPath);
template void gram_update<Eigen::half>(const Eigen::half*, Index, Index, const double*, Index, int,
                                       double*, Index, double*, GramPath);
template void gram_update<Eigen::bfloat16>(const Eigen::bfloat16*, Index, Index, const double*,
                                           Index, int, double*, Index, double*, GramPath);

GramTile gram_tile() noexcept {
  return {Tile<float>::MR, Tile<float>::NR, Tile<double>::MR, Tile<double>::NR};
}

LMDX_NAMESPACE_END
