// The register tile of this variant's hand-written kernels (the Gram update and the
// Fisher products): MP packets of S lanes by NR columns of accumulators, sized so that
// MP * NR accumulators, MP operands and one broadcast fit the vector registers (32 with
// AVX-512, 16 otherwise).
#pragma once

#include <Eigen/Core>

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

LMDX_NAMESPACE_END
