// Float32 GEMM on the CPU with its epilogue, on a weight prepacked once into column panels:
//
//   y[r, o] = sum_i x[r, i] * W[o, i] + bias[o] (+ residual[r, o])        x [rows, in], y and residual [rows, out]
//   or, with gelu, y[r, o] = GELU(sum_i x[r, i] * W[o, i] + bias[o])      (erf form, as torch's F.gelu)
//   packed  [panels, in, 16]: packed[p, i, j] = W[16 p + j, i], zero past out    (panels = ceil(out / 16))
//
// bias or residual null: none. Each output is summed in float32 FMAs, 64 inputs at a time from zero, each partial
// sum then added to the running one (bias first): the rounding error then stays within torch's (MKL's) on
// bert-sized GEMMs, where one long chain of FMAs per output had 3-6x it. The caller (fastbert/native_gemm.py)
// checks every pointer and size before the kernel runs.
#pragma once

#include <cstdint>

namespace fastbert {

struct GemmCpuArgs {
  const float* x;         // [rows, in], row r at x + r * x_stride
  int64_t x_stride;
  const float* packed;    // [panels, in, 16]
  const float* bias;      // [out] or null
  const float* residual;  // [rows, out] contiguous, or null
  float* y;               // [rows, out] contiguous (apart from x and packed; may be residual)
  int64_t rows;
  int64_t in;
  int64_t out;
  bool gelu;              // GELU after the bias (not with a residual)
};

// Whether this CPU runs the kernel (x86-64 with AVX2 and FMA).
bool gemm_cpu_available();

// OpenMP over blocks of rows and of panels; num_threads <= 0: OpenMP's default. Throws std::runtime_error where
// gemm_cpu_available() is false.
void gemm_cpu(const GemmCpuArgs& args, int num_threads);

}  // namespace fastbert
