// Activation quantization for the int8 GEMMs (quantize_cpu.h): one OpenMP region per call instead of the five to
// seven passes of torch ops it replaces (range, divide, scale and shift, round, clamp, convert), each of which read
// and wrote the whole activation. Rows are vectorized with AVX-512 or AVX2 (picked at run time, as the attention's
// kernel is); the math is the reference's operation for operation, so the bytes are the same.
#include "quantize_cpu.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <stdexcept>

#if defined(_OPENMP)
#include <omp.h>
#endif

#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__))
#define FASTBERT_X86_QUANTIZE 1
#include <immintrin.h>
#endif

namespace fastbert {
namespace {

// Below this many elements one thread does it all: a parallel region's barriers cost more than the work.
constexpr int64_t kElementsPerThread = 1 << 15;

struct Range {
  float low = INFINITY, high = -INFINITY;
  bool nan = false;
};

#if defined(FASTBERT_X86_QUANTIZE)
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma")))
#define AVX2 __attribute__((target("avx2,fma")))

AVX512 void range_512(const float* x, const float* smooth, int64_t n, Range& r) {
  __m512 low = _mm512_set1_ps(INFINITY), high = _mm512_set1_ps(-INFINITY);
  bool nan = false;
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 m = n - j >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n - j)) - 1);
    __m512 v = _mm512_maskz_loadu_ps(m, x + j);
    if (smooth) v = _mm512_div_ps(v, _mm512_mask_loadu_ps(_mm512_set1_ps(1.f), m, smooth + j));
    nan |= _mm512_mask_cmp_ps_mask(m, v, v, _CMP_UNORD_Q) != 0;
    low = _mm512_mask_min_ps(low, m, low, v);
    high = _mm512_mask_max_ps(high, m, high, v);
  }
  r.low = std::min(r.low, _mm512_reduce_min_ps(low));
  r.high = std::max(r.high, _mm512_reduce_max_ps(high));
  r.nan |= nan;
}

AVX512 void per_call_512(const float* x, const float* smooth, int64_t n, float alpha, float shift, uint8_t* out) {
  const __m512 a = _mm512_set1_ps(alpha), c = _mm512_set1_ps(shift);
  const __m512 lo = _mm512_set1_ps(-128.f), hi = _mm512_set1_ps(127.f);
  const __m512i offset = _mm512_set1_epi32(128);
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 m = n - j >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n - j)) - 1);
    __m512 v = _mm512_maskz_loadu_ps(m, x + j);
    if (smooth) v = _mm512_div_ps(v, _mm512_mask_loadu_ps(_mm512_set1_ps(1.f), m, smooth + j));
    v = _mm512_roundscale_ps(_mm512_fmadd_ps(v, a, c), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    v = _mm512_min_ps(_mm512_max_ps(v, lo), hi);
    _mm512_mask_cvtepi32_storeu_epi8(out + j, m, _mm512_add_epi32(_mm512_cvtps_epi32(v), offset));
  }
}

AVX512 void per_token_512(const float* x, const float* smooth, int64_t n, uint8_t* out, float* scale) {
  const __m512 abs_mask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
  __m512 largest = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 m = n - j >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n - j)) - 1);
    __m512 v = _mm512_maskz_loadu_ps(m, x + j);
    if (smooth) v = _mm512_div_ps(v, _mm512_mask_loadu_ps(_mm512_set1_ps(1.f), m, smooth + j));
    largest = _mm512_max_ps(largest, _mm512_and_ps(v, abs_mask));
  }
  const float s = std::max(_mm512_reduce_max_ps(largest), FLT_MIN) / 127.f;
  *scale = s;
  const __m512 sv = _mm512_set1_ps(s);
  const __m512i offset = _mm512_set1_epi32(128);
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 m = n - j >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n - j)) - 1);
    __m512 v = _mm512_maskz_loadu_ps(m, x + j);
    if (smooth) v = _mm512_div_ps(v, _mm512_mask_loadu_ps(_mm512_set1_ps(1.f), m, smooth + j));
    v = _mm512_roundscale_ps(_mm512_div_ps(v, sv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm512_mask_cvtepi32_storeu_epi8(out + j, m, _mm512_add_epi32(_mm512_cvtps_epi32(v), offset));
  }
}

// AVX2: 8 lanes, the tail by the same operations on one element at a time (_mm_*_ss).
AVX2 inline float load_scaled(const float* x, const float* smooth, int64_t j) {
  return smooth ? _mm_cvtss_f32(_mm_div_ss(_mm_set_ss(x[j]), _mm_set_ss(smooth[j]))) : x[j];
}

AVX2 void range_256(const float* x, const float* smooth, int64_t n, Range& r) {
  __m256 low = _mm256_set1_ps(INFINITY), high = _mm256_set1_ps(-INFINITY);
  bool nan = false;
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    __m256 v = _mm256_loadu_ps(x + j);
    if (smooth) v = _mm256_div_ps(v, _mm256_loadu_ps(smooth + j));
    nan |= _mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)) != 0;
    low = _mm256_min_ps(low, v);
    high = _mm256_max_ps(high, v);
  }
  float lows[8], highs[8];
  _mm256_storeu_ps(lows, low);
  _mm256_storeu_ps(highs, high);
  for (int k = 0; k < 8; ++k) {
    r.low = std::min(r.low, lows[k]);
    r.high = std::max(r.high, highs[k]);
  }
  for (; j < n; ++j) {
    const float v = load_scaled(x, smooth, j);
    r.nan |= std::isnan(v);
    r.low = std::min(r.low, v);
    r.high = std::max(r.high, v);
  }
  r.nan |= nan;
}

AVX2 inline void store8(__m256i values, uint8_t* out) {  // 8 int32 in [0, 255] -> 8 bytes
  const __m128i words = _mm_packus_epi32(_mm256_castsi256_si128(values), _mm256_extracti128_si256(values, 1));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(out), _mm_packus_epi16(words, words));
}

AVX2 void per_call_256(const float* x, const float* smooth, int64_t n, float alpha, float shift, uint8_t* out) {
  const __m256 a = _mm256_set1_ps(alpha), c = _mm256_set1_ps(shift);
  const __m256 lo = _mm256_set1_ps(-128.f), hi = _mm256_set1_ps(127.f);
  const __m256i offset = _mm256_set1_epi32(128);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    __m256 v = _mm256_loadu_ps(x + j);
    if (smooth) v = _mm256_div_ps(v, _mm256_loadu_ps(smooth + j));
    v = _mm256_round_ps(_mm256_fmadd_ps(v, a, c), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    v = _mm256_min_ps(_mm256_max_ps(v, lo), hi);
    store8(_mm256_add_epi32(_mm256_cvtps_epi32(v), offset), out + j);
  }
  for (; j < n; ++j) {
    __m128 v = _mm_fmadd_ss(_mm_set_ss(load_scaled(x, smooth, j)), _mm_set_ss(alpha), _mm_set_ss(shift));
    v = _mm_round_ss(v, v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    v = _mm_min_ss(_mm_max_ss(v, _mm_set_ss(-128.f)), _mm_set_ss(127.f));
    out[j] = static_cast<uint8_t>(_mm_cvtss_si32(v) + 128);
  }
}

AVX2 void per_token_256(const float* x, const float* smooth, int64_t n, uint8_t* out, float* scale) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 largest = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    __m256 v = _mm256_loadu_ps(x + j);
    if (smooth) v = _mm256_div_ps(v, _mm256_loadu_ps(smooth + j));
    largest = _mm256_max_ps(largest, _mm256_and_ps(v, abs_mask));
  }
  float lanes[8];
  _mm256_storeu_ps(lanes, largest);
  float top = 0.f;
  for (int k = 0; k < 8; ++k) top = std::max(top, lanes[k]);
  for (int64_t t = j; t < n; ++t) top = std::max(top, std::fabs(load_scaled(x, smooth, t)));
  const float s = std::max(top, FLT_MIN) / 127.f;
  *scale = s;
  const __m256 sv = _mm256_set1_ps(s);
  const __m256i offset = _mm256_set1_epi32(128);
  for (j = 0; j + 8 <= n; j += 8) {
    __m256 v = _mm256_loadu_ps(x + j);
    if (smooth) v = _mm256_div_ps(v, _mm256_loadu_ps(smooth + j));
    v = _mm256_round_ps(_mm256_div_ps(v, sv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    store8(_mm256_add_epi32(_mm256_cvtps_epi32(v), offset), out + j);
  }
  for (; j < n; ++j) {
    __m128 v = _mm_div_ss(_mm_set_ss(load_scaled(x, smooth, j)), _mm_set_ss(s));
    v = _mm_round_ss(v, v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    out[j] = static_cast<uint8_t>(_mm_cvtss_si32(v) + 128);
  }
}

bool has_avx512() {
  static const bool yes = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
  }();
  return yes;
}
#endif

int threads_for(int64_t elements, int num_threads) {
#if defined(_OPENMP)
  const int most = num_threads > 0 ? num_threads : omp_get_max_threads();
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(most, elements / kElementsPerThread)));
#else
  (void)elements;
  (void)num_threads;
  return 1;
#endif
}

void check(const QuantizeCpuArgs& a) {
  if (!quantize_cpu_available()) throw std::runtime_error("fastbert's int8 quantizer needs an x86-64 CPU with AVX2");
  if (a.rows < 0 || a.cols < 0 || a.real_rows < 0 || (!a.real_index && a.real_rows > a.rows)) {
    throw std::invalid_argument("rows, cols and real_rows must be >= 0, real_rows <= rows");
  }
}

}  // namespace

bool quantize_cpu_available() {
#if defined(FASTBERT_X86_QUANTIZE)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
  return false;
#endif
}

void quantize_per_call_cpu(const QuantizeCpuArgs& a, double* scale, int64_t* zero_point, int num_threads, bool avx2) {
  check(a);
#if defined(FASTBERT_X86_QUANTIZE)
  const bool wide = has_avx512() && !avx2;
  Range total;
  float alpha = 1.f, shift = -128.f;
  const int threads = threads_for(a.rows * a.cols, num_threads);
#pragma omp parallel num_threads(threads)
  {
    Range mine;
#pragma omp for schedule(static)
    for (int64_t i = 0; i < a.real_rows; ++i) {
      const float* row = a.x + (a.real_index ? a.real_index[i] : i) * a.cols;
      if (wide) range_512(row, a.smooth, a.cols, mine); else range_256(row, a.smooth, a.cols, mine);
    }
#pragma omp critical
    {
      total.low = std::min(total.low, mine.low);
      total.high = std::max(total.high, mine.high);
      total.nan |= mine.nan;
    }
#pragma omp barrier
#pragma omp single
    {
      // fastbert/int8_linear.py's qparams, in double as Python computes it: 0 is exact in u8.
      double s = 1.0;
      int64_t z = 0;
      if (a.real_rows > 0 && !total.nan) {
        const double low = std::min<double>(total.low, 0.0), high = std::max<double>(total.high, 0.0);
        const double candidate = (high - low) / 255.0;
        if (candidate != 0.0 && std::isfinite(candidate)) {
          s = candidate;
          z = static_cast<int64_t>(std::min(255.0, std::max(0.0, std::nearbyint(-low / s))));
        }
      }
      *scale = s;
      *zero_point = z;
      alpha = static_cast<float>(1.0 / s);
      shift = static_cast<float>(z - 128);
    }  // (an implicit barrier: every thread sees alpha and shift)
#pragma omp for schedule(static)
    for (int64_t i = 0; i < a.rows; ++i) {
      if (wide) per_call_512(a.x + i * a.cols, a.smooth, a.cols, alpha, shift, a.out + i * a.cols);
      else per_call_256(a.x + i * a.cols, a.smooth, a.cols, alpha, shift, a.out + i * a.cols);
    }
  }
#else
  (void)scale, (void)zero_point, (void)num_threads, (void)avx2;
#endif
}

void quantize_static_cpu(const QuantizeCpuArgs& a, double scale, int64_t zero_point, int num_threads, bool avx2) {
  check(a);
  if (!(scale > 0.0) || !std::isfinite(scale) || zero_point < 0 || zero_point > 255) {
    throw std::invalid_argument("scale must be finite and > 0, zero_point in [0, 255]");
  }
#if defined(FASTBERT_X86_QUANTIZE)
#pragma omp parallel for schedule(static) num_threads(threads_for(a.rows * a.cols, num_threads))
  for (int64_t i = 0; i < a.rows; ++i) {
    quantize_static_row(a.x + i * a.cols, a.smooth, a.cols, scale, zero_point, a.out + i * a.cols, avx2);
  }
#else
  (void)num_threads, (void)avx2;
#endif
}

void quantize_static_row(const float* x, const float* smooth, int64_t cols, double scale, int64_t zero_point,
                         uint8_t* out, bool avx2) {
#if defined(FASTBERT_X86_QUANTIZE)
  const float alpha = static_cast<float>(1.0 / scale), shift = static_cast<float>(zero_point - 128);
  if (has_avx512() && !avx2) per_call_512(x, smooth, cols, alpha, shift, out);
  else per_call_256(x, smooth, cols, alpha, shift, out);
#else
  (void)x, (void)smooth, (void)cols, (void)scale, (void)zero_point, (void)out, (void)avx2;
#endif
}

void quantize_per_token_cpu(const QuantizeCpuArgs& a, float* scales, int num_threads, bool avx2) {
  check(a);
#if defined(FASTBERT_X86_QUANTIZE)
  const bool wide = has_avx512() && !avx2;
#pragma omp parallel for schedule(static) num_threads(threads_for(a.rows * a.cols, num_threads))
  for (int64_t i = 0; i < a.rows; ++i) {
    if (wide) per_token_512(a.x + i * a.cols, a.smooth, a.cols, a.out + i * a.cols, scales + i);
    else per_token_256(a.x + i * a.cols, a.smooth, a.cols, a.out + i * a.cols, scales + i);
  }
#else
  (void)scales, (void)num_threads, (void)avx2;
#endif
}

}  // namespace fastbert
