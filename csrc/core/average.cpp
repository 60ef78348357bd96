#include "core/average.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>

#include "core/checks.hpp"
#include "core/parallel.hpp"

LMDX_NAMESPACE_BEGIN

namespace {

constexpr Index kBlock = 4096;

using ArrayXd = Eigen::Array<double, Eigen::Dynamic, 1>;
// Stack-allocated block buffers: no heap allocation inside parallel regions.
using BlockArray = Eigen::Array<double, Eigen::Dynamic, 1, 0, kBlock, 1>;

// acc[0..len) += factor * x[start..start+len), widened to float64.
void add_scaled(const ArrayView& x, Index start, Index len, double factor,
                Eigen::Ref<ArrayXd> acc) {
  if (x.is_float32) {
    acc += factor * Eigen::Map<const Eigen::ArrayXf>(x.f32() + start, len).cast<double>();
  } else {
    acc += factor * Eigen::Map<const ArrayXd>(x.f64() + start, len);
  }
}

void load(const ArrayView& x, Index start, Index len, BlockArray& out) {
  if (x.is_float32) {
    out = Eigen::Map<const Eigen::ArrayXf>(x.f32() + start, len).cast<double>();
  } else {
    out = Eigen::Map<const ArrayXd>(x.f64() + start, len);
  }
}

// At least one tensor, each of the shape of `reference` (xs[0] when null, named
// `reference_name` in messages) and finite.
void check_inputs(const std::vector<ArrayView>& xs, const std::string& what,
                  const ArrayView* reference, const std::string& reference_name, int n_threads) {
  if (xs.empty()) throw std::invalid_argument(what + ": need at least one tensor");
  const ArrayView& ref = reference != nullptr ? *reference : xs[0];
  for (size_t i = 0; i < xs.size(); ++i) {
    require_same_shape(xs[i], what + "[" + std::to_string(i) + "]", ref, reference_name);
  }
  for (size_t i = 0; i < xs.size(); ++i) {
    require_finite(xs[i], 0, what + "[" + std::to_string(i) + "]", n_threads);
  }
}

}  // namespace

void weighted_average(const std::vector<ArrayView>& tensors,
                      const std::vector<double>& coefficients, void* out, bool out_float32,
                      int n_threads) {
  const int requested = resolve_threads(n_threads);
  if (tensors.empty()) throw std::invalid_argument("tensors: need at least one tensor");
  for (size_t i = 0; i < tensors.size(); ++i) {
    require_same_shape(tensors[i], "tensors[" + std::to_string(i) + "]", tensors[0],
                       "tensors[0]");
  }
  const Index n = tensors[0].size();
  const std::vector<double> coef = checked_coefficients(coefficients, tensors.size());
  double total = 0.0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    total += coef[i];
    // not in the result: checked on their own
    if (coef[i] == 0.0) {
      require_finite(tensors[i], 0, "tensors[" + std::to_string(i) + "]", n_threads);
    }
  }
  const Index n_blocks = (n + kBlock - 1) / kBlock;
  const int threads = n < 4 * kBlock ? 1 : requested;
  bool finite = true;
  LMDX_PRAGMA(omp parallel for num_threads(threads) schedule(static) reduction(&& : finite))
  for (Index b = 0; b < n_blocks; ++b) {
    const Index start = b * kBlock;
    const Index len = std::min(kBlock, n - start);
    BlockArray block = BlockArray::Zero(len);
    for (size_t i = 0; i < tensors.size(); ++i) {
      if (coef[i] != 0.0) add_scaled(tensors[i], start, len, coef[i], block);
    }
    block /= total;
    finite = finite && block.isFinite().all();
    if (out_float32) {
      Eigen::Map<Eigen::ArrayXf>(static_cast<float*>(out) + start, len) = block.cast<float>();
    } else {
      Eigen::Map<ArrayXd>(static_cast<double*>(out) + start, len) = block;
    }
  }
  if (!finite) {  // a NaN or Inf among the inputs: name the first
    for (size_t i = 0; i < tensors.size(); ++i) {
      require_finite(tensors[i], 0, "tensors[" + std::to_string(i) + "]", n_threads);
    }
    throw std::invalid_argument("tensors: the average is not finite");  // not reached
  }
}

void fisher_average(const std::vector<ArrayView>& params, const std::vector<ArrayView>& fishers,
                    const std::vector<double>& coefficients, double eps, double* out,
                    int n_threads) {
  const int requested = resolve_threads(n_threads);
  check_inputs(params, "params", nullptr, "params[0]", n_threads);
  if (fishers.size() != params.size()) {
    throw std::invalid_argument("fishers: expected " + std::to_string(params.size()) +
                                " tensors (one per model), got " + std::to_string(fishers.size()));
  }
  check_inputs(fishers, "fishers", &params[0], "params[0]", n_threads);
  const Index n = params[0].size();
  if (!std::isfinite(eps) || eps < 0.0) {
    throw std::invalid_argument("eps: must be finite and >= 0, got " + std::to_string(eps));
  }
  const std::vector<double> coef = checked_coefficients(coefficients, params.size());
  for (size_t i = 0; i < fishers.size(); ++i) {
    const ArrayView& f = fishers[i];
    if (n == 0) break;
    const double lowest =
        f.is_float32 ? static_cast<double>(Eigen::Map<const Eigen::ArrayXf>(f.f32(), n).minCoeff())
                     : Eigen::Map<const ArrayXd>(f.f64(), n).minCoeff();
    if (lowest < 0.0) {
      throw std::invalid_argument("fishers[" + std::to_string(i) +
                                  "]: must be >= 0 (squared gradients), min is " +
                                  std::to_string(lowest));
    }
  }
  const Index n_blocks = (n + kBlock - 1) / kBlock;
  const int threads = n < 4 * kBlock ? 1 : requested;
  Index zero_at = std::numeric_limits<Index>::max();
  LMDX_PRAGMA(omp parallel for num_threads(threads) schedule(static) reduction(min : zero_at))
  for (Index b = 0; b < n_blocks; ++b) {
    const Index start = b * kBlock;
    const Index len = std::min(kBlock, n - start);
    Eigen::Map<ArrayXd> num(out + start, len);
    num.setZero();
    BlockArray den = BlockArray::Zero(len);
    BlockArray weight(len);
    BlockArray value(len);
    for (size_t i = 0; i < params.size(); ++i) {
      if (coef[i] == 0.0) continue;
      load(fishers[i], start, len, weight);
      weight = coef[i] * (weight + eps);
      den += weight;
      load(params[i], start, len, value);
      num += weight * value;
    }
    for (Index j = 0; j < len; ++j) {
      if (!(den[j] > 0.0)) {
        zero_at = std::min(zero_at, start + j);
        break;
      }
    }
    num /= den;
  }
  if (zero_at != std::numeric_limits<Index>::max()) {
    throw std::invalid_argument("fishers: the weights sum to zero at element " +
                                std::to_string(zero_at) +
                                " (every model's Fisher is 0 there); pass eps > 0");
  }
}

LMDX_NAMESPACE_END
