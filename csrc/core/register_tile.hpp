// The register tile of this variant's hand-written kernels (the Gram update and the
// Fisher products): MP packets of S lanes by NR columns of accumulators, sized so that
// MP * NR accumulators, MP operands and one broadcast fit the vector registers (32 with
// AVX-512, 16 otherwise), and the product both accumulate on it.
#pragma once

#include <Eigen/Core>
#include <type_traits>

#include "core/config.hpp"

LMDX_NAMESPACE_BEGIN

#ifdef EIGEN_VECTORIZE_AVX512
constexpr int kColumnsWide = 8;
#else
constexpr int kColumnsWide = 4;
#endif

template <typename T>
struct Tile {
  using Packet = typename Eigen::internal::packet_traits<T>::type;
  static constexpr int S = Eigen::internal::packet_traits<T>::size;  // lanes per packet
  static constexpr int MP = 3;                                       // packets per tile column
  static constexpr int MR = MP * S;                                  // tile rows
  // NR divides MR so a Gram column block never straddles two strips.
  static constexpr int NR = MR % kColumnsWide == 0 ? kColumnsWide : 2;
  static_assert(MR % NR == 0, "tile columns must divide the strip width");
};

/// acc[m][n] += Σ_k a_k[m * S, (m + 1) * S) · b_k[n] over `rows` rows, where row k of the
/// operands is a + k * a_stride (MPe packets, 64-byte aligned) and b + k * b_stride (NR
/// scalars, broadcast): the register-tile product of the hand-written kernels, whose
/// accumulators stay in registers.
template <typename T, int MPe>
EIGEN_ALWAYS_INLINE void tile_product(const T* a, Index a_stride, const T* b, Index b_stride,
                                      Index rows,
                                      typename Tile<T>::Packet (&acc)[MPe][Tile<T>::NR]) {
  using Packet = typename Tile<T>::Packet;
  constexpr int S = Tile<T>::S;
  constexpr int NR = Tile<T>::NR;
  for (Index k = 0; k < rows; ++k) {
    const T* ak = a + k * a_stride;
    const T* bk = b + k * b_stride;
    Packet av[MPe];
    for (int m = 0; m < MPe; ++m) av[m] = Eigen::internal::pload<Packet>(ak + m * S);
    for (int n = 0; n < NR; ++n) {
      const Packet bv = Eigen::internal::pset1<Packet>(bk[n]);
      for (int m = 0; m < MPe; ++m) acc[m][n] = Eigen::internal::pmadd(av[m], bv, acc[m][n]);
    }
  }
}

/// make(std::integral_constant<int, P>{}) for P = `packets` (1 or 2; 3 otherwise): picks
/// a kernel's instance for tiles of that many packets per column, e.g.
/// `for_packets(k, [](auto p) { return &kernel<T, decltype(p)::value>; })`.
template <typename Make>
auto for_packets(Index packets, const Make& make) {
  switch (packets) {
    case 1:
      return make(std::integral_constant<int, 1>{});
    case 2:
      return make(std::integral_constant<int, 2>{});
    default:
      return make(std::integral_constant<int, 3>{});
  }
}

LMDX_NAMESPACE_END
