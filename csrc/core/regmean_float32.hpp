// The float32 path of the RegMean merge (regmean.cpp tries it first for precision "float32",
// and "auto" on layers large enough to be threaded).
//
// The merge of one layer in float32 -- factorization, the K - 1 right-hand-side products
// and the solve -- and the certificate of its output error against the float64 formula:
// with X = W_M^T - W-^T from float32 and E = X - X_64 (X_64 = A^{-1} B in float64, A the
// system, B the right-hand side), A E z = A X z - B z = -r for any probe z, where the
// residual r is computed in float64 from products with the Gram differences and the system.
// With x = A_32^{-1} B z (the pre-check's solve), E z = (X z - x) + A^{-1} (A x - B z): the
// first part is exact, the second is solved with the float32 factor and refined once in
// float64. ||E z||_A^2 over Gaussian probes estimates ||E||_A^2 >= ||E||_S^2
// (S = A - ridge I), and ||W_M z||_S^2 the merged weight's ||W_M||_S^2.
// O((K + 4) d_in^2 kProbes) float64 work and three float32 solves with kProbes columns.
//
// Each deviation (W_i - W-)^T is formed once: in float64 for the probes, and rounded to
// float32 side by side (dev = [dev_1; ..; dev_{K-1}]). Each Gram difference D_i is formed in
// float64 by tiles of rows for the probes' right-hand side B z; with K <= 3 it is also
// rounded to float32 side by side (D = [D_1 .. D_{K-1}]) for the one product D dev after the
// factor's pre-check; with more models it is not held but formed again after the pre-check,
// block of rows by block of rows, for the products D_i dev_i.
//
// Memory beyond the system (lhs, 8 d_in^2 bytes) and the caller's arrays: the float32
// factor (4 d_in^2 bytes), dev (4 (K - 1) d_in d_out bytes), the float32 result (4 d_in
// d_out bytes), and for the differences 4 (K - 1) d_in^2 bytes with K <= 3 (K: the models
// with c_i > 0), otherwise at most 4 d_in^2 bytes whatever K (a float32 block of rows per
// thread, at most one per block of rows) plus 512 d_in bytes per thread (a float64 tile).
// After the products, a copy of the float32 right-hand side (4 d_in d_out bytes) until the
// final certificate; where that refuses the layer, the copy moves into the caller's
// merged_t for rhs32. The large matrices are PooledMatrix (core/workspace.hpp): what one
// layer gives back stays in the process for the next layer of that shape, up to
// kMatrixPoolBytes in all.
#pragma once

#include <vector>

#include "core/phases.hpp"
#include "core/regmean_kernels.hpp"
#include "core/workspace.hpp"

LMDX_NAMESPACE_BEGIN

namespace detail {

struct Float32Merge {
  const std::vector<RegMeanModel>& models;
  const std::vector<double>& coef;
  const std::vector<double>& s;
  size_t pivot;
  const std::vector<size_t>& others;
  Index d_in, d_out;
  WeightLayout layout;
  const MatrixXd& mean_t;
  const MatrixXd& lhs;  // sum_i s_i G_i, lower triangle (the upper one is not read)
  double noise_floor;  // relative, as regmean_merge_layer's
  double alpha;        // RegMean's off-diagonal scale
  // Formed once for both paths (form_rhs_inputs): the Gaussian probes z (d_out x kProbes),
  // y = [(W_j - W-)^T z] in float64, B z in float64, the deviations in float32 (dev32, m
  // d_in x d_out) and, with m <= kHeldDifferences, the Gram differences in float32 side by
  // side (diff32); products32 releases the float32 ones.
  bool rhs_formed = false;
  // run() stopped at the a-priori predictor: the layer is far from float32's tolerance.
  bool predicted_far = false;
  MatrixXd z{}, y{}, bz{};
  PooledMatrixXf dev32{}, diff32{};
  // run()'s final certificate refused the layer after the products: merged_t holds the
  // float32 right-hand side B_32 (widened, exactly) for rhs32, which then skips its
  // predictor and products.
  bool rhs_in_merged = false;
  // Set by the pre-check (factor_error_estimate): on the probes, W-^T z, A W-^T z, x (B z
  // solved with the float32 factor), A x, res = A x - B z, e (res solved with it), A e, and
  // ||e||_A^2.
  MatrixXd mean_z{}, a_mean_z{}, x_probe{}, a_x{}, res{}, e_probe{}, a_e{};
  double e_norm2 = 0.0;
  double probe_ridge = -1.0;  // the absolute ridge of a_mean_z's system

  // A v, A = alpha lhs + (1 - alpha) diag(lhs) + ridge I (lhs's lower triangle).
  MatrixXd system_times(const MatrixXd& v, double ridge, int threads) const;

  // A_32^{-1} r with the float32 factor, r scaled into float32's range first.
  static MatrixXd solve32(const Eigen::MatrixXf& l32, const MatrixXd& r, int threads);

  // ||u||_S^2 summed over the columns, from u and A u.
  static double s_norm2(const MatrixXd& u, const MatrixXd& au, double ridge);

  // The pre-check: the certificate's estimate for the float32 factor's error alone. The
  // probes' right-hand side B z solved with it (x), checked against the float64 system
  // (res = A x - B z, e = its solve with the float32 factor: x - X_64 z ~ e), relative to
  // ||W_M z||_S with W_M z ~ W- z + x. The products' own rounding comes on top, so a layer
  // above the tolerance here cannot be certified. Keeps x, A x, res, e, A e, W-^T z and
  // A W-^T z for the final certificate.
  double factor_error_estimate(const Eigen::MatrixXf& l32, double ridge, int threads);

  // The a-priori predictor of the output error (before any right-hand side, see
  // kPredictorFactor) without its pivot ratio: the predicted error is this times the float32
  // factor's largest / smallest pivot. spread: the relative spread of the weights.
  double predictor_scale(double spread) const;

  // The probes, the deviations and the Gram differences (above), phases "deviations" and
  // "differences"; nothing when already formed.
  void form_rhs_inputs(int threads, PhaseLog& phases);

  // sum_j |D_j| |W_j - W-|^T |z| (d_in x kProbes), the float32 products' rounding bound on
  // the probes (the float32-rhs predictor's input), from the formed inputs.
  MatrixXd rounding_bound(int threads) const;

  // x32 (d_in x d_out) = the right-hand side sum_j D_j (W_j - W-)^T in float32; releases
  // dev32 and diff32.
  void products32(int threads, Eigen::MatrixXf& x32);

  // Precision "float32-rhs": the right-hand side in float32 (products32), the factorization l and
  // the solve in float64; certified like the float32 path, on the probes: its error
  // E = A^{-1} (B_32 - B) is known exactly there (E z = A^{-1} (B_32 z - B z)), since the
  // float64 factor's own error is negligible. B_32 is the products' (or, after run()'s final
  // certificate refused the layer, the one run() left in merged_t). Returns false (merged_t
  // then holds nothing useful) when the certificate exceeds kOutputErrorTolerance, unless
  // forced; otherwise merged_t = W_M^T, info.precision "float32-rhs" and
  // info.output_error_estimate set. ridge: the absolute ridge of l's system.
  bool rhs32(const MatrixXd& l, double ridge, int threads, bool forced, RegMeanInfo& info,
             MatrixXd& merged_t);

  // Merge into merged_t and fill info (precision "float32", output_error_estimate). Returns
  // false when the float32 factorization fails or
  // (unless forced) the predictor or the certificate exceeds kOutputErrorTolerance. Its
  // memory (above) grows with K through the deviations only once K >= 4.
  bool run(const SolveOptions& opt, bool forced, RegMeanInfo& info, MatrixXd& merged_t);
};

}  // namespace detail

LMDX_NAMESPACE_END
