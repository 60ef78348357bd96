// Single-thread GFLOP/s of the Eigen kernels lmdx's core is built from, compiled with the
// same flags as a core variant. It shows how far the core can go on Eigen alone (the
// "ceiling"), to compare with bench_core.py's end-to-end numbers and with OpenBLAS.
//
// Build and run (AVX2 path; use -march=x86-64-v4 for the AVX-512 one):
//   EIGEN=$(python -m cmeel cmake)/include/eigen3
//   g++ -O3 -march=x86-64-v3 -mtune=generic -DEIGEN_DONT_PARALLELIZE -I"$EIGEN" \
//       bench/eigen_ceiling.cpp -o /tmp/eigen_ceiling && /tmp/eigen_ceiling
#include <Eigen/Cholesky>
#include <Eigen/Core>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>

using namespace Eigen;

template <class F>
double median_seconds(F f, int reps = 5) {
  std::vector<double> t;
  for (int r = 0; r < reps; ++r) {
    const auto start = std::chrono::steady_clock::now();
    f();
    t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

int main() {
  std::printf("Eigen %d.%d.%d, SIMD: %s\n", EIGEN_WORLD_VERSION, EIGEN_MAJOR_VERSION,
              EIGEN_MINOR_VERSION, SimdInstructionSetsInUse());
  {
    const int d = 1024, n = 2048;
    MatrixXf x = MatrixXf::Random(d, n), c = MatrixXf::Zero(d, d);
    const double useful = double(n) * d * (d + 1);
    double t = median_seconds([&] { c.selfadjointView<Lower>().rankUpdate(x); });
    std::printf("ssyrk  d=%d n=%d              %6.1f GFLOP/s\n", d, n, useful / t * 1e-9);
    t = median_seconds([&] { c.noalias() += x * x.transpose(); });
    std::printf("sgemm  %dx%dx%d (full X X^T)  %6.1f GFLOP/s\n", d, d, n, 2.0 * n * d * d / t * 1e-9);
  }
  {
    const int d = 3072, k = 256;
    MatrixXd a = MatrixXd::Random(d, k), b = MatrixXd::Random(k, d), c = MatrixXd::Zero(d, d);
    double t = median_seconds([&] { c.noalias() -= a * b; }, 3);
    std::printf("dgemm  %dx%dx%d               %6.1f GFLOP/s\n", d, d, k, 2.0 * d * d * k / t * 1e-9);
    MatrixXd l = MatrixXd::Random(d, d);
    l.diagonal().array() += d;
    for (int w : {128, 512}) {
      MatrixXd r = MatrixXd::Random(d, w);
      t = median_seconds([&] { l.triangularView<Lower>().solveInPlace(r); }, 3);
      std::printf("dtrsm  L, d=%d, %3d columns     %6.1f GFLOP/s\n", d, w, 1.0 * d * d * w / t * 1e-9);
      t = median_seconds([&] { l.transpose().triangularView<Upper>().solveInPlace(r); }, 3);
      std::printf("dtrsm  L^T, d=%d, %3d columns   %6.1f GFLOP/s\n", d, w, 1.0 * d * d * w / t * 1e-9);
    }
    MatrixXd s = l * l.transpose();
    t = median_seconds([&] { LLT<MatrixXd> llt(s); }, 3);
    std::printf("LLT    d=%d                    %6.1f GFLOP/s\n", d, 1.0 * d * d * d / 3 / t * 1e-9);
  }
  return 0;
}
