// Activation quantization for the int8 GEMMs on the CPU: float32 [rows, cols] -> uint8, in one parallel region.
//
//   per call:  s, z from the min and max of x / smooth over the real rows (fastbert/int8_linear.py's qparams), then
//              q = clamp(round(fma(x / smooth, 1 / s, z - 128)), -128, 127) + 128         for every row
//   per token: s_r = max(max_j |x_rj / smooth_j|, FLT_MIN) / 127,  q = round((x_rj / smooth_j) / s_r) + 128
//   static:    as per call with s, z given (calibrated by fastbert.quantize's guard): no range is taken
//
// round is to nearest even, and every operation is the one torch's ops run in fastbert/int8_linear.py's reference path
// (the fused multiply-add of torch.add with alpha, IEEE division), so the bytes are the reference's. The caller
// (fastbert/_extension.py) checks every pointer and size before the kernel runs.
#pragma once

#include <cstdint>

namespace fastbert {

struct QuantizeCpuArgs {
  const float* x;            // [rows, cols], contiguous
  uint8_t* out;              // [rows, cols], contiguous
  int64_t rows;
  int64_t cols;
  const float* smooth;       // [cols] divisors (SmoothQuant), or null
  const int64_t* real_index; // [real_rows] rows that set the range (per call), or null: the first real_rows rows
  int64_t real_rows;
};

// Per call: quantizes every row with the range of the real rows; returns the scale and zero point it used.
void quantize_per_call_cpu(const QuantizeCpuArgs& args, double* scale, int64_t* zero_point, int num_threads,
                           bool avx2 = false);

// Static: quantizes every row with the given scale and zero point (values past its range saturate at 0 and 255).
void quantize_static_cpu(const QuantizeCpuArgs& args, double scale, int64_t zero_point, int num_threads,
                         bool avx2 = false);

// One row of quantize_static_cpu, the same bytes: for an op that writes the u8 of each row as it writes the row
// (layer_norm_cpu.h). The caller has checked scale and zero point (quantize_static_cpu's rule) and the CPU.
void quantize_static_row(const float* x, const float* smooth, int64_t cols, double scale, int64_t zero_point,
                         uint8_t* out, bool avx2 = false);

// Per token: quantizes each row with a scale of its own, written to scales [rows].
void quantize_per_token_cpu(const QuantizeCpuArgs& args, float* scales, int num_threads, bool avx2 = false);

// avx2 (every kernel above): the AVX2 rows even where AVX-512 runs, the same bytes (tests check both on one machine).

// Whether this CPU runs the kernels (x86-64 with AVX2 and FMA).
bool quantize_cpu_available();

}  // namespace fastbert
