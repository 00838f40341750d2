// Int8 GEMM on the CPU with its epilogue, for CPUs with AVX2 but no VNNI: u8 activations times 7-bit weights
// prepacked once, int32 sums, the epilogue in float32:
//
//   acc[r, o] = sum_i x[r, i] * W[o, i] - x_zero_point * column_sums[o]         exact in int32
//   y[r, o]   = acc[r, o] * (x_scale * x_row_scales[r] * scales[o]) + bias[o]  (+ residual[r, o], or through GELU,
//               erf form); x_row_scales null: 1 (per-call or static input scales; per token: x_scale 1)
//   y_u8      = clamp(round(fma(y, y_inverse_scale, y_zero_point - 128)), -128, 127) + 128   when y_u8 is given
//               (quantize_cpu.h's static quantization of y, its bytes where y_inverse_scale is its float(1 / scale):
//               the next GEMM's input, no float32 written)
//   packed [panels, groups, 16, 4] s8: packed[p, g, j, k] = W[16 p + j, 4 g + k], zero past out and in
//          (panels = ceil(out / 16), groups = ceil(in / 4)); |W| <= 63
//
// Why 7 bits: AVX2's vpmaddubsw adds two u8 x s8 products into a saturating int16; 2 x 255 x 63 = 32,130 fits, so
// every sum is exact (2 x 255 x 127 would not). The caller (fastbert/int8/native_gemm.py) packs the weight, checks
// every pointer and size before the kernel runs.
#pragma once

#include <cstdint>

namespace fastbert {

// The most inputs whose products (u8 x 7-bit) sum within int32: (2^31 - 1) / (255 x 63).
constexpr int64_t kGemmInt8MaxIn = 133676;

struct GemmInt8CpuArgs {
  const uint8_t* x;            // [rows, in], row r at x + r * x_stride
  int64_t x_stride;
  const int8_t* packed;        // [panels, groups, 16, 4]
  const int32_t* column_sums;  // [panels * 16]: sum_i W[o, i], zero past out
  const float* scales;         // [out]: each output row's weight scale
  float x_scale;
  const float* x_row_scales;   // [rows]: each input row's scale (quantized per token), or null
  int32_t x_zero_point;
  const float* bias;           // [out] or null
  const float* residual;       // [rows, out] contiguous, or null
  float* y;                    // [rows, out] contiguous (may be residual), or null when y_u8 is given
  uint8_t* y_u8;               // [rows, out] contiguous, or null
  float y_inverse_scale;       // of y_u8: float(1 / its scale), the division in double
  int32_t y_zero_point;
  int64_t rows;
  int64_t in;
  int64_t out;
  bool gelu;                   // GELU after the bias (not with a residual)
};

// Whether this CPU runs the kernel (x86-64 with AVX2 and FMA).
bool gemm_int8_cpu_available();

// OpenMP over blocks of rows and of panels; num_threads <= 0: OpenMP's default. Throws std::runtime_error where
// gemm_int8_cpu_available() is false.
void gemm_int8_cpu(const GemmInt8CpuArgs& args, int num_threads);

}  // namespace fastbert
