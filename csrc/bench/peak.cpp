#include "bench/peak.hpp"

#include <Eigen/Core>
#include <chrono>
#include <type_traits>

#include "core/gram_kernel.hpp"
#include "core/parallel.hpp"

LMDX_NAMESPACE_BEGIN

namespace {

constexpr int kChains = 12;  // independent FMA chains: covers latency x pipes on current CPUs

template <typename T>
double fma_loop(long iterations, T* sink) {
  using namespace Eigen::internal;
  using Packet = typename packet_traits<T>::type;
  Packet acc[kChains];
  for (int k = 0; k < kChains; ++k) acc[k] = pset1<Packet>(static_cast<T>(k) * T(1e-3));
  const Packet mul = pset1<Packet>(T(0.999999));
  const Packet add = pset1<Packet>(T(1e-6));
  for (long it = 0; it < iterations; ++it) {
    for (int k = 0; k < kChains; ++k) acc[k] = pmadd(acc[k], mul, add);
  }
  T total = T(0);
  for (int k = 0; k < kChains; ++k) total += predux(acc[k]);
  *sink = total;
  return 2.0 * kChains * packet_traits<T>::size * static_cast<double>(iterations);
}

#ifdef LMDX_HAVE_BF16_DOT
// The same loop with VDPBF16PS: each instruction does 32 bfloat16 products and sums.
__attribute__((target("avx512bf16"))) double bf16_dot_loop(long iterations, float* sink) {
  __m512 acc[kChains];
  for (int k = 0; k < kChains; ++k) acc[k] = _mm512_set1_ps(static_cast<float>(k) * 1e-3f);
  __m512i a = _mm512_set1_epi16(0x3f80);        // 1.0
  const __m512i b = _mm512_set1_epi16(0x3380);  // 2^-24: the sums stay finite
  for (long it = 0; it < iterations; ++it) {
    for (int k = 0; k < kChains; ++k) acc[k] = _mm512_dpbf16_ps(acc[k], (__m512bh)a, (__m512bh)b);
    asm volatile("" : "+v"(a));  // a new operand each time: the loop is not folded
  }
  float total = 0.0f;
  for (int k = 0; k < kChains; ++k) total += _mm512_reduce_add_ps(acc[k]);
  *sink = total;
  return 2.0 * kChains * 32 * static_cast<double>(iterations);
}
#endif

template <typename T>
double fma_or_dot_loop(long iterations, T* sink, bool bf16_dot) {
#ifdef LMDX_HAVE_BF16_DOT
  if constexpr (std::is_same_v<T, float>) {
    if (bf16_dot) return bf16_dot_loop(iterations, sink);
  }
#endif
  (void)bf16_dot;
  return fma_loop<T>(iterations, sink);
}

template <typename T>
double measure(int n_threads, double seconds, bool bf16_dot = false) {
  const int threads = resolve_threads(n_threads);
  T sink = T(0);
  fma_or_dot_loop<T>(1 << 16, &sink, bf16_dot);  // warm up
  long iterations = 1 << 20;
  while (true) {
    double flops = 0.0;
    const auto start = std::chrono::steady_clock::now();
    LMDX_PRAGMA(omp parallel num_threads(threads) reduction(+ : flops)) {
      T local = T(0);
      flops += fma_or_dot_loop<T>(iterations, &local, bf16_dot);
      volatile T keep = local;  // keep the result observable
      (void)keep;
    }
    const double elapsed =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (elapsed >= seconds || iterations > (1L << 40)) return flops / elapsed * 1e-9;
    iterations *= 2;
  }
}

}  // namespace

double measure_peak_gflops(bool double_precision, int n_threads, double seconds) {
  return double_precision ? measure<double>(n_threads, seconds)
                          : measure<float>(n_threads, seconds);
}

double measure_bf16_peak_gflops(int n_threads, double seconds) {
  if (!bf16_dot_available()) {
    resolve_threads(n_threads);
    return 0.0;
  }
  return measure<float>(n_threads, seconds, true);
}

LMDX_NAMESPACE_END
