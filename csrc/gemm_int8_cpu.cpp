// The int8 GEMM of gemm_int8_cpu.h: AVX2 (by target attribute; the extension itself is built for the compiler's
// baseline), 4 rows x 16 columns of int32 accumulators per register tile. Per 4 inputs: 2 loads of the weight panel
// (16 outputs x 4 inputs), per row one broadcast of its 4 u8 inputs, then vpmaddubsw (u8 x s8 pairs summed into
// int16) and vpmaddwd by ones (pairs of those into int32) per 8 outputs: 2 multiplies for 32 products, where the
// float32 GEMM's FMA does 8. Threads take tasks of rows by panels as gemm_cpu.cpp's (gemm_tasks.h).
#include "gemm_int8_cpu.h"

#include "gelu_avx2.h"
#include "gemm_tasks.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>

#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__))
#define FASTBERT_X86_GEMM_INT8 1
#include <immintrin.h>
#endif

namespace fastbert {
namespace {

constexpr int kPanel = 16;        // columns per panel: 2 AVX2 vectors of int32
constexpr int kGroup = 4;         // inputs per broadcast: 4 u8 in one int32 lane
constexpr int kTileRows = 4;      // rows per register tile: 8 accumulators, 2 weights, the ones, a broadcast
constexpr int64_t kOpsPerThread = 1 << 19;  // below this a GEMM runs on one thread (a region costs ~2 us)

#if defined(FASTBERT_X86_GEMM_INT8)
#define AVX2 __attribute__((target("avx2,fma")))

// One group of 4 inputs for R rows: xg points at the group in row 0, rows `stride` bytes apart.
template <int R>
AVX2 __attribute__((always_inline)) inline void step(const uint8_t* xg, int64_t stride, const int8_t* w,
                                                      __m256i (&c)[kTileRows][2]) {
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32));
  for (int r = 0; r < R; ++r) {  // (unrolled: R is a constant)
    int32_t group;
    std::memcpy(&group, xg + r * stride, sizeof group);
    const __m256i v = _mm256_set1_epi32(group);
    c[r][0] = _mm256_add_epi32(c[r][0], _mm256_madd_epi16(_mm256_maddubs_epi16(v, w0), ones));
    c[r][1] = _mm256_add_epi32(c[r][1], _mm256_madd_epi16(_mm256_maddubs_epi16(v, w1), ones));
  }
}

// The int32 sums of R rows (R <= kTileRows) of x times one panel over every input, then the epilogue: stored to the
// panel's `columns` (<= 16) columns of y or y_u8.
template <int R>
AVX2 inline void tile(const GemmInt8CpuArgs& a, const uint8_t* x, const int8_t* panel, int64_t column, int columns,
                      int64_t row) {
  const int64_t full = a.in / kGroup, rest = a.in - full * kGroup;
  __m256i c[kTileRows][2];
  for (int r = 0; r < R; ++r) c[r][0] = c[r][1] = _mm256_setzero_si256();
  const int8_t* w = panel;
#pragma GCC unroll 4
  for (int64_t g = 0; g < full; ++g, w += kPanel * kGroup) step<R>(x + g * kGroup, a.x_stride, w, c);
  if (rest > 0) {  // the last inputs, zero-filled to a group (the row is never read past its end)
    uint8_t tail[kTileRows][kGroup] = {};
    for (int r = 0; r < R; ++r) std::memcpy(tail[r], x + r * a.x_stride + full * kGroup, rest);
    step<R>(tail[0], kGroup, w, c);
  }

  // Epilogue, per row: (acc - z * column sums) as float32, times x_scale * the weight scales (* the row's scale),
  // plus the bias, then the GELU or the residual; stored as float32 or quantized to u8.
  alignas(32) float scale[kPanel] = {}, bias[kPanel] = {}, edge[kPanel];
  for (int j = 0; j < columns; ++j) {
    scale[j] = a.x_scale * a.scales[column + j];
    bias[j] = a.bias ? a.bias[column + j] : 0.f;
  }
  const __m256i z = _mm256_set1_epi32(a.x_zero_point);
  const __m256i zs0 =
      _mm256_mullo_epi32(z, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.column_sums + column)));
  const __m256i zs1 =
      _mm256_mullo_epi32(z, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.column_sums + column + 8)));
  for (int r = 0; r < R; ++r) {
    __m256 y0 = _mm256_cvtepi32_ps(_mm256_sub_epi32(c[r][0], zs0));
    __m256 y1 = _mm256_cvtepi32_ps(_mm256_sub_epi32(c[r][1], zs1));
    __m256 s0 = _mm256_load_ps(scale), s1 = _mm256_load_ps(scale + 8);
    if (a.x_row_scales) {
      const __m256 row_scale = _mm256_set1_ps(a.x_row_scales[row + r]);
      s0 = _mm256_mul_ps(s0, row_scale), s1 = _mm256_mul_ps(s1, row_scale);
    }
    y0 = _mm256_fmadd_ps(y0, s0, _mm256_load_ps(bias));
    y1 = _mm256_fmadd_ps(y1, s1, _mm256_load_ps(bias + 8));
    if (a.gelu) y0 = gelu_avx2(y0), y1 = gelu_avx2(y1);
    _mm256_store_ps(edge, y0);
    _mm256_store_ps(edge + 8, y1);
    const int64_t at = (row + r) * a.out + column;
    if (a.residual)
      for (int j = 0; j < columns; ++j) edge[j] += a.residual[at + j];
    if (a.y_u8) {
      // quantize_cpu.cpp's per_call rows: one fused multiply-add, rounded to nearest even, clamped
      const float alpha = a.y_inverse_scale, shift = static_cast<float>(a.y_zero_point - 128);
      for (int j = 0; j < columns; ++j) {
        const float q = std::min(127.f, std::max(-128.f, std::nearbyint(std::fma(edge[j], alpha, shift))));
        a.y_u8[at + j] = static_cast<uint8_t>(static_cast<int>(q) + 128);
      }
    } else {
      std::memcpy(a.y + at, edge, columns * sizeof(float));
    }
  }
}

// Rows [row0, row0 + rows) of x times panel p, tile by tile.
AVX2 void panel_rows(const GemmInt8CpuArgs& a, int64_t row0, int64_t rows, int64_t p) {
  const int64_t column = p * kPanel, groups = (a.in + kGroup - 1) / kGroup;
  const int columns = static_cast<int>(std::min<int64_t>(kPanel, a.out - column));
  const int8_t* panel = a.packed + p * groups * kPanel * kGroup;
  for (int64_t r = row0; r < row0 + rows;) {
    const int n = static_cast<int>(std::min<int64_t>(kTileRows, row0 + rows - r));
    const uint8_t* x = a.x + r * a.x_stride;
    switch (n) {
      case 4: tile<4>(a, x, panel, column, columns, r); break;
      case 3: tile<3>(a, x, panel, column, columns, r); break;
      case 2: tile<2>(a, x, panel, column, columns, r); break;
      default: tile<1>(a, x, panel, column, columns, r); break;
    }
    r += n;
  }
}
#endif

}  // namespace

bool gemm_int8_cpu_available() {
#if defined(FASTBERT_X86_GEMM_INT8)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
  return false;
#endif
}

void gemm_int8_cpu(const GemmInt8CpuArgs& a, int num_threads) {
  if (!gemm_int8_cpu_available())
    throw std::runtime_error("fastbert's int8 CPU GEMM needs an x86-64 CPU with AVX2 and FMA");
#if defined(FASTBERT_X86_GEMM_INT8)
  const GemmTasks split(a.rows, a.in, a.out, kPanel, num_threads, kOpsPerThread);
#pragma omp parallel for schedule(dynamic, 1) num_threads(split.threads) if (split.threads > 1)
  for (int64_t task = 0; task < split.tasks; ++task)
    for (int64_t p = split.first_panel(task); p < split.end_panel(task); ++p)
      panel_rows(a, split.row0(task), split.rows(task, a.rows), p);
#else
  (void)a, (void)num_threads;
#endif
}

}  // namespace fastbert
