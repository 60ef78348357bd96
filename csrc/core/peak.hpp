// Measured peak FMA throughput of this machine for the instruction set this copy of the
// core was compiled for. Benchmarks report kernel speed as a fraction of it.
#pragma once

#include "core/config.hpp"

LMDX_NAMESPACE_BEGIN

/// GFLOP/s of a register-resident FMA loop (2 flops per lane per FMA) on n_threads threads
/// for about `seconds`. float64 if `double_precision`, else float32.
double measure_peak_gflops(bool double_precision, int n_threads, double seconds);

LMDX_NAMESPACE_END
