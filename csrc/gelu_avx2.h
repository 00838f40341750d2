// GELU (erf form, as torch's F.gelu) of 8 floats in AVX2 and FMA: the epilogue of the CPU GEMMs (gemm_cpu.cpp,
// gemm_int8_cpu.cpp).
#pragma once

#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>

namespace fastbert {

// GELU, erf form, as torch's F.gelu: 0.5 x (1 + erf(x / sqrt 2)). erf(|u|) on [0, 4) in 8 segments of 0.5, a
// polynomial of degree 7 in t = |u| - the segment's centre (coefficient j of segment k: kErf[j][k], picked by a
// permute of the 8 segments: no gather), least squares on 4,000 Chebyshev nodes per segment; |u| is clamped below 4,
// where the polynomial gives 1.0 (erf(4) = 1 - 1.5e-8). Its absolute error against float64's erf is at most 6.4e-8
// (about a float32 step of values near 1; not relative: near 0 it is many steps of erf itself), which 1 + erf rounds
// away: the GELU's error stays within torch's own (tests/test_native_gemm.py, per range of x), at most 4.7e-7 on
// [-12, 12] (half a step at 12).
alignas(32) inline constexpr float kErf[8][8] = {
    {0.276326388f, 0.711155653f, 0.92290014f, 0.986671686f, 0.998537302f, 0.999899387f, 0.999995708f, 0.999999881f},
    {1.06001413f, 0.642931044f, 0.236521125f, 0.0527749956f, 0.00714231934f, 0.000586277281f, 2.91890119e-05f,
     8.81428832e-07f},
    {-0.265002966f, -0.482198149f, -0.295651734f, -0.092356205f, -0.0160701573f, -0.00161226746f, -9.48693341e-05f,
     -3.30607099e-06f},
    {-0.309170485f, 0.0267883502f, 0.167535886f, 0.0901573896f, 0.0217245128f, 0.00276038027f, 0.000195812623f,
     7.97032772e-06f},
    {0.126934558f, 0.150675625f, -0.00613203505f, -0.048105523f, -0.0190882571f, -0.00325771049f, -0.000286169437f,
     -1.37854086e-05f},
    {0.0800362676f, -0.0532170907f, -0.0471865535f, 0.00661847321f, 0.0106600598f, 0.00275629107f, 0.000313628843f,
     1.83300617e-05f},
    {-0.0393407941f, -0.0265828297f, 0.0205977373f, 0.00904949475f, -0.00277956529f, -0.00166785053f,
     -0.000273758458f, -2.06924251e-05f},
    {-0.0158033706f, 0.017885495f, 0.00374511047f, -0.00593309943f, -0.000721527031f, 0.000635815377f, 0.000173596491f,
     1.71447045e-05f},
};

__attribute__((target("avx2,fma"))) inline __m256 gelu_avx2(__m256 x) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256 u = _mm256_mul_ps(x, _mm256_set1_ps(0.70710678118654752f));
  // |u| below 4 (NaN too: min gives its second operand; x keeps the NaN)
  const __m256 a = _mm256_min_ps(_mm256_andnot_ps(sign, u), _mm256_set1_ps(3.99999976f));
  const __m256i segment = _mm256_cvttps_epi32(_mm256_add_ps(a, a));
  const __m256 t = _mm256_sub_ps(a, _mm256_fmadd_ps(_mm256_cvtepi32_ps(segment), _mm256_set1_ps(0.5f),
                                                    _mm256_set1_ps(0.25f)));
  __m256 p = _mm256_permutevar8x32_ps(_mm256_load_ps(kErf[7]), segment);
  for (int j = 6; j >= 0; --j) p = _mm256_fmadd_ps(p, t, _mm256_permutevar8x32_ps(_mm256_load_ps(kErf[j]), segment));
  const __m256 erf = _mm256_or_ps(_mm256_min_ps(p, _mm256_set1_ps(1.0f)), _mm256_and_ps(sign, u));
  return _mm256_mul_ps(_mm256_mul_ps(x, _mm256_set1_ps(0.5f)), _mm256_add_ps(_mm256_set1_ps(1.0f), erf));
}

}  // namespace fastbert
#endif
