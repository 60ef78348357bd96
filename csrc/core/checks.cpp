#include "core/checks.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <sstream>
#include <stdexcept>

#include "core/parallel.hpp"

LMDX_NAMESPACE_BEGIN

template <typename T>
Index first_nonfinite(const T* x, Index n, int n_threads) {
  const int requested = resolve_threads(n_threads);  // checked even where one thread is used
  const int threads = n < (Index(1) << 16) ? 1 : requested;
  Index first = std::numeric_limits<Index>::max();
  LMDX_PRAGMA(omp parallel for num_threads(threads) reduction(min : first) schedule(static))
  for (Index block = 0; block < n; block += 4096) {
    const Index end = std::min(n, block + 4096);
    // x * 0 is 0 for a finite x and NaN otherwise, and its sum is a vectorized reduction
    // (allFinite() runs one compare and branch per element).
    const Eigen::Map<const Eigen::Array<T, Eigen::Dynamic, 1>> values(x + block, end - block);
    if (!((values * T(0)).sum() == T(0))) {
      for (Index i = block; i < end; ++i) {
        if (!Eigen::numext::isfinite(x[i])) {
          first = std::min(first, i);
          break;
        }
      }
    }
  }
  return first == std::numeric_limits<Index>::max() ? Index(-1) : first;
}

template <typename T>
void require_finite(const T* x, Index n, Index cols, const std::string& what, int n_threads) {
  const Index bad = first_nonfinite(x, n, n_threads);
  if (bad < 0) return;
  std::string where =
      cols > 0 ? "row " + std::to_string(bad / cols) + ", column " + std::to_string(bad % cols)
               : "index " + std::to_string(bad);
  const char* kind = Eigen::numext::isnan(x[bad]) ? "NaN" : "Inf";
  throw std::invalid_argument(what + ": contains " + kind + " at " + where +
                              "; remove or fix non-finite values before passing them to lmdx");
}

void require_symmetric(const double* g, Index d, const std::string& what, int n_threads) {
  const Eigen::Map<const MatrixXd> m(g, d, d);
  // Compare 64 x 64 tiles with their mirror tiles: a whole-matrix m - m^T walks one operand
  // across rows and cost ~50 ms at d = 2048, a third of the factorization itself. Tile
  // columns are shared by the threads (max is exact, so the result does not depend on them).
  constexpr Index kTile = 64;
  const Index n_tiles = (d + kTile - 1) / kTile;
  const int requested = resolve_threads(n_threads);
  const int threads = d < 512 ? 1 : requested;
  double scale = 0.0;
  double asym = 0.0;
  LMDX_PRAGMA(omp parallel for num_threads(threads) schedule(dynamic, 1)
                  reduction(max : scale, asym))
  for (Index t = 0; t < n_tiles; ++t) {
    const Index j0 = t * kTile;
    const Index w = std::min(kTile, d - j0);
    for (Index i0 = j0; i0 < d; i0 += kTile) {
      const Index h = std::min(kTile, d - i0);
      const auto lower = m.block(i0, j0, h, w);
      const auto upper = m.block(j0, i0, w, h);
      scale = std::max(scale, lower.cwiseAbs().maxCoeff());
      scale = std::max(scale, upper.cwiseAbs().maxCoeff());
      asym = std::max(asym, (lower - upper.transpose()).cwiseAbs().maxCoeff());
    }
  }
  if (asym > 1e-12 * scale) {
    std::ostringstream msg;
    msg.precision(6);
    msg << what << ": not symmetric (max |A - A^T| = " << asym << ", max |A| = " << scale
        << "); pass a symmetric matrix, e.g. (A + A.T) / 2";
    throw std::invalid_argument(msg.str());
  }
}

std::vector<double> checked_coefficients(const std::vector<double>& coefficients, size_t k,
                                         const std::string& prefix) {
  if (coefficients.empty()) return std::vector<double>(k, 1.0);
  if (coefficients.size() != k) {
    throw std::invalid_argument(prefix + "coefficients: expected " + std::to_string(k) +
                                " values (one per model), got " +
                                std::to_string(coefficients.size()));
  }
  double total = 0.0;
  for (size_t i = 0; i < k; ++i) {
    const double c = coefficients[i];
    if (!std::isfinite(c) || c < 0.0) {
      throw std::invalid_argument(prefix + "coefficients[" + std::to_string(i) +
                                  "]: must be finite and >= 0, got " + std::to_string(c));
    }
    total += c;
  }
  if (!(total > 0.0)) throw std::invalid_argument(prefix + "coefficients: must not all be zero");
  return coefficients;
}

template Index first_nonfinite<float>(const float*, Index, int);
template Index first_nonfinite<double>(const double*, Index, int);
template void require_finite<float>(const float*, Index, Index, const std::string&, int);
template void require_finite<double>(const double*, Index, Index, const std::string&, int);
template void require_finite<Eigen::half>(const Eigen::half*, Index, Index, const std::string&,
                                          int);
template void require_finite<Eigen::bfloat16>(const Eigen::bfloat16*, Index, Index,
                                              const std::string&, int);

LMDX_NAMESPACE_END
