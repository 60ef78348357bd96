// Measured peak FMA (and bf16 dot-product) throughput of this machine for the instruction
// set this copy of the module was compiled for. Benchmarks report kernel speed as a fraction
// of it. Not part of the core (csrc/core: the math); compiled into each module beside the
// bindings.
#pragma once

#include "core/config.hpp"

LMDX_NAMESPACE_BEGIN

/// GFLOP/s of a register-resident FMA loop (2 flops per lane per FMA) on n_threads threads
/// for about `seconds`. float64 if `double_precision`, else float32.
double measure_peak_gflops(bool double_precision, int n_threads, double seconds);

/// GFLOP/s of a register-resident bf16 dot-product loop (VDPBF16PS: 2 flops per bfloat16
/// product), or 0 where this copy of the core has no bf16 dot-product kernel for this CPU.
double measure_bf16_peak_gflops(int n_threads, double seconds);

LMDX_NAMESPACE_END
