// LayerNorm on the CPU (layer_norm_cpu.h): one row at a time, three passes over a row that stays in L1 (sum, squared
// deviations, normalize and store), then the row's u8 from the values just stored. AVX-512 or AVX2, picked at run time
// as the quantizer and the attention pick theirs.
#include "layer_norm_cpu.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>

#if defined(_OPENMP)
#include <omp.h>
#endif

#include "quantize_cpu.h"

#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__))
#define FASTBERT_X86_LAYER_NORM 1
#include <immintrin.h>
#endif

namespace fastbert {
namespace {

// Below this many elements one thread does it all (as the embedding kernel measured: ~2 us to start a region).
constexpr int64_t kElementsPerThread = 1 << 13;

#if defined(FASTBERT_X86_LAYER_NORM)
#define AVX512 __attribute__((target("avx512f,avx512dq,avx2,fma")))
#define AVX2 __attribute__((target("avx2,fma")))

AVX512 void row_512(const float* x, const float* weight, const float* bias, int64_t n, float eps, float* y) {
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 m = n - j >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n - j)) - 1);
    sum = _mm512_add_ps(sum, _mm512_maskz_loadu_ps(m, x + j));
  }
  const float mean = _mm512_reduce_add_ps(sum) / static_cast<float>(n);
  const __m512 mean_v = _mm512_set1_ps(mean);
  __m512 squares = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 m = n - j >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n - j)) - 1);
    const __m512 d = _mm512_maskz_sub_ps(m, _mm512_maskz_loadu_ps(m, x + j), mean_v);
    squares = _mm512_fmadd_ps(d, d, squares);
  }
  const __m512 rstd = _mm512_set1_ps(1.f / std::sqrt(_mm512_reduce_add_ps(squares) / static_cast<float>(n) + eps));
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 m = n - j >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n - j)) - 1);
    const __m512 w = weight ? _mm512_maskz_loadu_ps(m, weight + j) : _mm512_set1_ps(1.f);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(m, bias + j) : _mm512_setzero_ps();
    const __m512 normalized = _mm512_mul_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, x + j), mean_v), rstd);
    _mm512_mask_storeu_ps(y + j, m, _mm512_fmadd_ps(normalized, w, b));
  }
}

// AVX2: 8 lanes, the tail one element at a time with the same operations.
AVX2 float reduce_256(__m256 v) {
  const __m128 halves = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 pairs = _mm_add_ps(halves, _mm_movehl_ps(halves, halves));
  return _mm_cvtss_f32(_mm_add_ss(pairs, _mm_movehdup_ps(pairs)));
}

AVX2 void row_256(const float* x, const float* weight, const float* bias, int64_t n, float eps, float* y) {
  const int64_t body = n / 8 * 8;
  __m256 sum = _mm256_setzero_ps();
  for (int64_t j = 0; j < body; j += 8) sum = _mm256_add_ps(sum, _mm256_loadu_ps(x + j));
  float total = reduce_256(sum);
  for (int64_t j = body; j < n; ++j) total += x[j];
  const float mean = total / static_cast<float>(n);
  const __m256 mean_v = _mm256_set1_ps(mean);
  __m256 squares = _mm256_setzero_ps();
  for (int64_t j = 0; j < body; j += 8) {
    const __m256 d = _mm256_sub_ps(_mm256_loadu_ps(x + j), mean_v);
    squares = _mm256_fmadd_ps(d, d, squares);
  }
  float square_total = reduce_256(squares);
  for (int64_t j = body; j < n; ++j) square_total += (x[j] - mean) * (x[j] - mean);
  const float rstd = 1.f / std::sqrt(square_total / static_cast<float>(n) + eps);
  const __m256 rstd_v = _mm256_set1_ps(rstd);
  for (int64_t j = 0; j < body; j += 8) {
    const __m256 w = weight ? _mm256_loadu_ps(weight + j) : _mm256_set1_ps(1.f);
    const __m256 b = bias ? _mm256_loadu_ps(bias + j) : _mm256_setzero_ps();
    const __m256 normalized = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(x + j), mean_v), rstd_v);
    _mm256_storeu_ps(y + j, _mm256_fmadd_ps(normalized, w, b));
  }
  for (int64_t j = body; j < n; ++j) {
    y[j] = std::fma((x[j] - mean) * rstd, weight ? weight[j] : 1.f, bias ? bias[j] : 0.f);
  }
}

bool has_avx512() {
  static const bool yes = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq");
  }();
  return yes;
}
#endif

}  // namespace

void layer_norm_cpu(const LayerNormCpuArgs& a, int num_threads, bool avx2) {
  if (!quantize_cpu_available()) throw std::runtime_error("fastbert's CPU LayerNorm needs an x86-64 CPU with AVX2");
#if defined(FASTBERT_X86_LAYER_NORM)
  const bool wide = has_avx512() && !avx2;
#if defined(_OPENMP)
  const int most = num_threads > 0 ? num_threads : omp_get_max_threads();
  const int threads =
      static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(most, a.rows * a.cols / kElementsPerThread)));
#endif
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t r = 0; r < a.rows; ++r) {
    const float* x = a.x + r * a.cols;
    float* y = a.y + r * a.cols;
    if (wide) row_512(x, a.weight, a.bias, a.cols, a.eps, y);
    else row_256(x, a.weight, a.bias, a.cols, a.eps, y);
    if (a.q) quantize_static_row(y, a.smooth, a.cols, a.scale, a.zero_point, a.q + r * a.cols, avx2);
  }
#else
  (void)a, (void)num_threads, (void)avx2;
#endif
}

}  // namespace fastbert
