#include "core/peak.hpp"

#include <Eigen/Core>
#include <chrono>

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

template <typename T>
double measure(int n_threads, double seconds) {
  const int threads = resolve_threads(n_threads);
  T sink = T(0);
  fma_loop<T>(1 << 16, &sink);  // warm up
  long iterations = 1 << 20;
  while (true) {
    double flops = 0.0;
    const auto start = std::chrono::steady_clock::now();
    LMDX_PRAGMA(omp parallel num_threads(threads) reduction(+ : flops)) {
      T local = T(0);
      flops += fma_loop<T>(iterations, &local);
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

LMDX_NAMESPACE_END
