// The extension module: a table of contents. Each bind_<concept>() lives in its own file
// and wraps the matching csrc/core/<concept>.hpp. The module is built once per
// instruction-set level as _core_<level>; lmdx/_core.py imports the best one.
#include "bindings/common.hpp"

#ifndef LMDX_MODULE_NAME
#error "LMDX_MODULE_NAME must be defined by the build"
#endif

PYBIND11_MODULE(LMDX_MODULE_NAME, m) {
  m.doc() = "lmdx native core (C++/Eigen); use the lmdx package, not this module";
  lmdx_bind::bind_config(m);
  lmdx_bind::bind_bench(m);
  lmdx_bind::bind_moments(m);
  lmdx_bind::bind_spd(m);
  lmdx_bind::bind_regmean(m);
  lmdx_bind::bind_average(m);
  lmdx_bind::bind_fisher(m);
  lmdx_bind::bind_gram_product(m);
}
