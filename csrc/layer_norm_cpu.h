// LayerNorm over the rows of a float32 matrix on the CPU, optionally writing, in the same pass, the u8 that the
// int8 GEMM reading the result takes (so no later pass reads the float32 rows again to quantize them).
//
//   y[r] = (x[r] - mean) / sqrt(var + eps) * weight + bias     [rows, cols] float32; mean and var over the row,
//                                                               the variance from the deviations (no cancellation)
//   q[r] = quantize_static_row(y[r] / smooth, scale, zero_point)   [rows, cols] u8, when q is not null: the same
//                                                               bytes as quantize_static_cpu of y (quantize_cpu.h)
//
// weight or bias null: 1 or 0 (a LayerNorm without affine parameters, or without a bias). The caller
// (fastbert/ops/norm.py) checks every pointer, size, scale and zero point before the kernel runs.
#pragma once

#include <cstdint>

namespace fastbert {

struct LayerNormCpuArgs {
  const float* x;        // [rows, cols], contiguous
  float* y;              // [rows, cols], contiguous (may be x: each row is read whole before it is written)
  const float* weight;   // [cols] or null
  const float* bias;     // [cols] or null
  int64_t rows;
  int64_t cols;
  float eps;
  uint8_t* q;            // [rows, cols] u8, or null: no quantized output
  const float* smooth;   // [cols] divisors (SmoothQuant) of the quantized output, or null
  double scale;          // of the quantized output
  int64_t zero_point;
};

// OpenMP over rows; num_threads <= 0: OpenMP's default. Throws std::runtime_error on a CPU without AVX2 and FMA.
// avx2: the AVX2 rows even where AVX-512 runs (tests check both on one machine).
void layer_norm_cpu(const LayerNormCpuArgs& args, int num_threads, bool avx2 = false);

}  // namespace fastbert
