// The int8 CPU attention of attention_int8_cpu.h, AVX-512 VNNI.
//
// vpdpbusd multiplies u8 by s8 four at a time into int32 lanes, so each operand is laid out in groups of 4 along the
// dimension summed over, and the s8 query rows go in as u8 with 128 added; the 128 * sum_d kq_jd it adds to every
// score is one int32 per key (comp), taken off afterwards. Per task (one sequence's head, a block of its queries;
// L keys, Lp = L rounded up to 16, D4 = D rounded up to 4, Dv = D rounded up to 16):
//   one pass over the rows (prefetched: they are 3 H D floats apart): k's and v's ranges, and the block's queries
//   qu [queries][D4] u8 (128 past D) with their scales; then, with k's and v's scales,
//   kp [D4 / 4][Lp][4] s8   key j's dims 4g..4g+3 at [g][j]; zero past L and past D
//   vp [Lp / 4][Dv][4] s8   keys 4g..4g+3 of dim d at [g][d]; zero past L and past D
//   per 8 query rows: scores [8][Lp] float32 in registers then L1, their u8 probabilities pu [8][Lp] (zero past
//   L), then out = pu vp in 4 x 64-dim register tiles.
// Per key and query row, D / 4 vpdpbusd for q k^T and D / 64 for p v, where float32 needs D FMAs each: on an Intel
// Xeon (AVX-512 VNNI, 2 threads), 12 heads of 64 at 8 x 128 tokens, 12 layers took 15 ms against the float32
// kernel's 34.
#include "attention_int8_cpu.h"
#include "attention_tasks.h"
#include "quantize_cpu.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <vector>

#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__))
#define FASTBERT_INT8_ATTENTION 1
#include <immintrin.h>
#pragma GCC diagnostic ignored "-Wpsabi"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // (GCC 12's AVX-512 headers: their own __Y = __Y)
#define VNNI __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")))
#endif

namespace fastbert {

#if defined(FASTBERT_INT8_ATTENTION)
namespace {

constexpr int QK_ROWS = 8;  // query rows per q k^T tile: 8 x 2 int32 accumulators
constexpr int PV_ROWS = 4;  // query rows per p v tile: 4 x 4 accumulators of 16 dims
constexpr int MAX_VECS = 4;  // vectors a row of a tile holds at most
constexpr int64_t AHEAD = 8;  // rows of q, k and v prefetched ahead of the pass over them

struct Scratch {
  std::vector<int8_t> kp, vp, rows;
  std::vector<int32_t> comp;
  std::vector<uint8_t> qu, pu, q_finite;
  std::vector<float> q_scale, scores;
};

// mask of the first n lanes (none for n <= 0, all for n >= 16)
VNNI inline __mmask16 first(int64_t n) {
  return n >= 16 ? __mmask16(0xffff) : n <= 0 ? __mmask16(0) : __mmask16((1u << n) - 1u);
}

// Running max |x| of `count` floats into `m`, and x * 0 into `poison` (NaN from there on once x holds a NaN or an
// infinity): no reduction per row.
VNNI inline void absmax_into(const float* x, int64_t count, __m512& m, __m512& poison) {
  for (int64_t d = 0; d < count; d += 16) {
    const __m512 v = _mm512_maskz_loadu_ps(first(count - d), x + d);
    m = _mm512_max_ps(m, _mm512_abs_ps(v));
    poison = _mm512_fmadd_ps(v, _mm512_setzero_ps(), poison);
  }
}

// max |x| over the lanes of m, infinity where poison holds a NaN
VNNI inline float reduce_absmax(__m512 m, __m512 poison) {
  return _mm512_cmp_ps_mask(poison, poison, _CMP_UNORD_Q) ? std::numeric_limits<float>::infinity()
                                                           : _mm512_reduce_max_ps(m);
}

// The symmetric 8-bit scale of a range: amax / 127, at least float32's smallest normal (its inverse stays finite), or
// 1 for an all-zero range.
inline float scale_of(float absmax) {
  return absmax > 0.f ? std::max(absmax / 127.f, std::numeric_limits<float>::min()) : 1.f;
}

// round(x * inverse) of x's `count` floats (zero past them) in int32 lanes, d .. d + 16. Round half to even (the
// default rounding mode), as torch.round.
VNNI inline __m512i quantized(const float* x, int64_t count, float inverse, int64_t d) {
  return _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_maskz_loadu_ps(first(count - d), x + d), _mm512_set1_ps(inverse)));
}

// out[0, n16) = round(x * inverse) as s8 (n16 a multiple of 16); returns their sum.
VNNI int32_t quantize_row(const float* x, int64_t count, float inverse, int64_t n16, int8_t* out) {
  __m512i sum = _mm512_setzero_si512();
  for (int64_t d = 0; d < n16; d += 16) {
    const __m512i level = quantized(x, count, inverse, d);
    sum = _mm512_add_epi32(sum, level);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + d), _mm512_cvtsepi32_epi8(level));
  }
  return _mm512_reduce_add_epi32(sum);
}

// out[0, n4) = round(x * inverse) + 128 as u8 (128 past x's `count` floats)
VNNI void quantize_row_u8(const float* x, int64_t count, float inverse, int64_t n4, uint8_t* out) {
  for (int64_t d = 0; d < n4; d += 16) {
    const __m512i level = _mm512_add_epi32(quantized(x, count, inverse, d), _mm512_set1_epi32(128));
    _mm_mask_storeu_epi8(out + d, first(n4 - d), _mm512_cvtepi32_epi8(level));
  }
}

// vp[g][d][0..4) = rows[0..4)[d] for the 4 s8 rows of Dv bytes each (keys 4g .. 4g + 3): bytes interleaved 4 ways.
VNNI void interleave4(const int8_t* rows, int64_t Dv, int8_t* vp) {
  for (int64_t d = 0; d < Dv; d += 16) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows + d));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows + Dv + d));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows + 2 * Dv + d));
    const __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows + 3 * Dv + d));
    const __m128i ab_low = _mm_unpacklo_epi8(a, b), ab_high = _mm_unpackhi_epi8(a, b);  // a0 b0 a1 b1 ...
    const __m128i ce_low = _mm_unpacklo_epi8(c, e), ce_high = _mm_unpackhi_epi8(c, e);
    __m128i* out = reinterpret_cast<__m128i*>(vp + 4 * d);
    _mm_storeu_si128(out, _mm_unpacklo_epi16(ab_low, ce_low));  // a0 b0 c0 e0 a1 b1 c1 e1 ... (dims d .. d + 3)
    _mm_storeu_si128(out + 1, _mm_unpackhi_epi16(ab_low, ce_low));
    _mm_storeu_si128(out + 2, _mm_unpacklo_epi16(ab_high, ce_high));
    _mm_storeu_si128(out + 3, _mm_unpackhi_epi16(ab_high, ce_high));
  }
}

// e^x for x <= 0, as the float32 kernel's (attention_cpu_kernel.h): 2^n 2^f, degree-6 polynomial; 0 below -87.
VNNI inline __m512 exp_nonpositive(__m512 x) {
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.535336188319500e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.339887440266574e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618437357674640e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550332471162809e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402264791363012e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472028550421e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.f), _CMP_GT_OQ), _mm512_scalef_ps(p, n));
}

// out[r][c] = sum over g < groups of the 4-byte dot products of row r of a (u8, a_stride bytes apart, bytes 4g..4g+3)
// with the 16 lanes of b + g * b_stride + 64 c (s8, 4 bytes a lane): ROWS x VECS int32 vectors. q k^T and p v are both
// this, over head dims and keys. (The sums stay in local registers: stores through `out` could alias the u8 loads.)
template <int ROWS, int VECS>
VNNI inline void dot_tile(const uint8_t* a, int64_t a_stride, const int8_t* b, int64_t b_stride, int64_t groups,
                          __m512i (*out)[MAX_VECS]) {
  static_assert(VECS <= MAX_VECS, "out has MAX_VECS vectors a row");
  __m512i acc[ROWS][VECS];
  for (int r = 0; r < ROWS; r++)
    for (int c = 0; c < VECS; c++) acc[r][c] = _mm512_setzero_si512();
  for (int64_t g = 0; g < groups; g++) {
    __m512i column[VECS];
    for (int c = 0; c < VECS; c++) column[c] = _mm512_loadu_si512(b + g * b_stride + 64 * c);
    for (int r = 0; r < ROWS; r++) {
      int32_t four;
      std::memcpy(&four, a + r * a_stride + 4 * g, 4);
      const __m512i row = _mm512_set1_epi32(four);
      for (int c = 0; c < VECS; c++) acc[r][c] = _mm512_dpbusd_epi32(acc[r][c], row, column[c]);
    }
  }
  for (int r = 0; r < ROWS; r++)
    for (int c = 0; c < VECS; c++) out[r][c] = acc[r][c];
}

// scores[r][j0 .. j0 + 16 VECS) = float(qu_r . kp[:, j] - comp[j]) * factor[r] for the QK_ROWS rows of qu.
template <int VECS>
VNNI inline void score_tile(const uint8_t* qu, const int8_t* kp, const int32_t* comp, const float* factor, int64_t D4,
                            int64_t Lp, int64_t j0, float* scores) {
  __m512i dots[QK_ROWS][MAX_VECS];
  dot_tile<QK_ROWS, VECS>(qu, D4, kp + j0 * 4, Lp * 4, D4 / 4, dots);
  for (int c = 0; c < VECS; c++) {
    const __m512i offset = _mm512_loadu_si512(comp + j0 + 16 * c);
    for (int r = 0; r < QK_ROWS; r++)
      _mm512_storeu_ps(scores + r * Lp + j0 + 16 * c,
                       _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(dots[r][c], offset)),
                                     _mm512_set1_ps(factor[r])));
  }
}

// The u8 of head h's D outputs of a row, where the caller asked for it (the static quantizer's bytes).
VNNI void quantize_output(const AttentionInt8CpuArgs& a, int64_t row, int64_t head) {
  if (!a.q) return;
  const int64_t at = (row * a.heads + head) * a.head_dim;
  quantize_static_row(a.out + at, a.smooth ? a.smooth + head * a.head_dim : nullptr, a.head_dim, a.q_scale,
                      a.q_zero_point, a.q + at);
}

VNNI void fill_nan(const AttentionInt8CpuArgs& a, int64_t row, int64_t head) {
  float* o = a.out + (row * a.heads + head) * a.head_dim;
  std::fill(o, o + a.head_dim, std::numeric_limits<float>::quiet_NaN());
  quantize_output(a, row, head);
}

// Queries [i_begin, i_end) of head h of the sequence of L rows from row0.
VNNI void attend_block(const AttentionInt8CpuArgs& a, int64_t row0, int64_t L, int64_t h, int64_t i_begin,
                       int64_t i_end, Scratch& s) {
  const int64_t H = a.heads, D = a.head_dim, D4 = (D + 3) / 4 * 4, Dv = (D + 15) / 16 * 16, Lp = (L + 15) / 16 * 16;
  const int64_t L4 = (L + 3) / 4 * 4, stride = 3 * H * D;  // (row stride of qkv)
  const float* q0 = a.qkv + row0 * stride + h * D;
  const float* k0 = q0 + H * D;
  const float* v0 = k0 + H * D;
  // One pass over the rows: k's and v's ranges, and the block's query rows quantized with their own scales.
  const int64_t queries = i_end - i_begin;
  s.qu.assign((queries + QK_ROWS) * D4, 128);  // (a short last tile reads past the block: rows of zeros)
  s.q_scale.resize(queries);
  s.q_finite.resize(queries);
  __m512 k_lanes = _mm512_setzero_ps(), v_lanes = _mm512_setzero_ps(), k_poison = k_lanes, v_poison = k_lanes;
  for (int64_t j = 0; j < L; j++) {
    if (j + AHEAD < L) {  // (rows 3 H D floats apart: no hardware prefetcher follows them across pages)
      for (int64_t d = 0; d < D; d += 16) {
        _mm_prefetch(reinterpret_cast<const char*>(k0 + (j + AHEAD) * stride + d), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(v0 + (j + AHEAD) * stride + d), _MM_HINT_T0);
        if (j + AHEAD >= i_begin && j + AHEAD < i_end)
          _mm_prefetch(reinterpret_cast<const char*>(q0 + (j + AHEAD) * stride + d), _MM_HINT_T0);
      }
    }
    absmax_into(k0 + j * stride, D, k_lanes, k_poison);
    absmax_into(v0 + j * stride, D, v_lanes, v_poison);
    if (j >= i_begin && j < i_end) {
      const float* q = q0 + j * stride;
      __m512 q_lanes = _mm512_setzero_ps(), q_poison = q_lanes;
      absmax_into(q, D, q_lanes, q_poison);
      const float q_max = reduce_absmax(q_lanes, q_poison);
      s.q_finite[j - i_begin] = std::isfinite(q_max);
      const float sq = scale_of(std::isfinite(q_max) ? q_max : 0.f);
      s.q_scale[j - i_begin] = sq;
      quantize_row_u8(q, D, 1.f / sq, D4, s.qu.data() + (j - i_begin) * D4);
    }
  }
  const float k_max = reduce_absmax(k_lanes, k_poison), v_max = reduce_absmax(v_lanes, v_poison);
  if (!std::isfinite(k_max) || !std::isfinite(v_max)) {
    for (int64_t i = i_begin; i < i_end; i++) fill_nan(a, row0 + i, h);
    return;
  }
  const float sk = scale_of(k_max), sv = scale_of(v_max);
  // k and v in their VNNI layouts, 4 keys at a time (keys past L: zero)
  s.kp.assign(D4 / 4 * Lp * 4, 0);
  s.vp.resize(Lp / 4 * Dv * 4);
  s.comp.assign(Lp, 0);
  s.rows.resize(4 * Dv);
  for (int64_t j0 = 0; j0 < Lp; j0 += 4) {
    for (int64_t r = 0; r < 4; r++) {
      const int64_t j = j0 + r;
      int8_t* row = s.rows.data() + r * Dv;
      if (j >= L) {
        std::fill(row, row + Dv, 0);
        continue;
      }
      s.comp[j] = 128 * quantize_row(k0 + j * stride, D, 1.f / sk, Dv, row);
      for (int64_t g = 0; g < D4 / 4; g++) std::memcpy(&s.kp[(g * Lp + j) * 4], row + 4 * g, 4);
    }
    for (int64_t r = 0; r < 4 && j0 + r < L; r++) quantize_row(v0 + (j0 + r) * stride, D, 1.f / sv, Dv,
                                                              s.rows.data() + r * Dv);
    interleave4(s.rows.data(), Dv, s.vp.data() + j0 * Dv);
  }
  s.pu.assign(QK_ROWS * Lp, 0);
  s.scores.resize(QK_ROWS * Lp);
  for (int64_t i0 = i_begin; i0 < i_end; i0 += QK_ROWS) {
    const int rows = static_cast<int>(std::min<int64_t>(QK_ROWS, i_end - i0));
    const uint8_t* qu = s.qu.data() + (i0 - i_begin) * D4;
    float factor[QK_ROWS];
    bool finite[QK_ROWS];
    for (int r = 0; r < QK_ROWS; r++) {
      const int64_t i = std::min<int64_t>(i0 - i_begin + r, queries - 1);
      factor[r] = s.q_scale[i] * sk * a.scale;
      finite[r] = s.q_finite[i];
    }
    int64_t j0 = 0;
    for (; j0 + 32 <= Lp; j0 += 32) score_tile<2>(qu, s.kp.data(), s.comp.data(), factor, D4, Lp, j0, s.scores.data());
    if (j0 < Lp) score_tile<1>(qu, s.kp.data(), s.comp.data(), factor, D4, Lp, j0, s.scores.data());
    float inverse_sum[QK_ROWS];
    for (int r = 0; r < rows; r++) {  // softmax's numerators as u8, the row's largest 255
      const float* row = s.scores.data() + r * Lp;
      __m512 m = _mm512_set1_ps(-INFINITY);
      for (int64_t j = 0; j < L; j += 16) m = _mm512_max_ps(m, _mm512_mask_loadu_ps(m, first(L - j), row + j));
      const __m512 row_max = _mm512_set1_ps(_mm512_reduce_max_ps(m));
      __m512i sum = _mm512_setzero_si512();
      for (int64_t j = 0; j < L4; j += 16) {
        const __m512 p = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(first(L - j), row + j), row_max));
        const __m512i level = _mm512_maskz_cvtps_epi32(first(L - j), _mm512_mul_ps(p, _mm512_set1_ps(255.f)));
        sum = _mm512_add_epi32(sum, level);
        _mm_mask_storeu_epi8(s.pu.data() + r * Lp + j, first(std::min<int64_t>(16, L4 - j)),
                             _mm512_cvtepi32_epi8(level));
      }
      inverse_sum[r] = sv / static_cast<float>(_mm512_reduce_add_epi32(sum));
    }
    for (int r0 = 0; r0 < rows; r0 += PV_ROWS) {
      __m512i sums[PV_ROWS][MAX_VECS];
      for (int64_t c0 = 0; c0 < Dv; c0 += 64) {
        const int vecs = static_cast<int>(std::min<int64_t>(4, (Dv - c0) / 16));
        const uint8_t* pu = s.pu.data() + r0 * Lp;  // (rows past `rows` are computed, not stored)
        const int8_t* vp = s.vp.data() + c0 * 4;
        switch (vecs) {  // (sums = pu vp over the 64 dims from c0)
          case 4: dot_tile<PV_ROWS, 4>(pu, Lp, vp, Dv * 4, L4 / 4, sums); break;
          case 3: dot_tile<PV_ROWS, 3>(pu, Lp, vp, Dv * 4, L4 / 4, sums); break;
          case 2: dot_tile<PV_ROWS, 2>(pu, Lp, vp, Dv * 4, L4 / 4, sums); break;
          default: dot_tile<PV_ROWS, 1>(pu, Lp, vp, Dv * 4, L4 / 4, sums); break;
        }
        for (int r = 0; r < PV_ROWS && r0 + r < rows; r++) {
          float* o = a.out + ((row0 + i0 + r0 + r) * H + h) * D;
          for (int c = 0; c < vecs; c++) {
            const int64_t d = c0 + 16 * c;
            const __m512 result = finite[r0 + r] ? _mm512_mul_ps(_mm512_cvtepi32_ps(sums[r][c]),
                                                                 _mm512_set1_ps(inverse_sum[r0 + r]))
                                                 : _mm512_set1_ps(std::numeric_limits<float>::quiet_NaN());
            _mm512_mask_storeu_ps(o + d, first(D - d), result);
          }
        }
      }
      for (int r = 0; r < PV_ROWS && r0 + r < rows; r++) quantize_output(a, row0 + i0 + r0 + r, h);
    }
  }
}

VNNI void run(const AttentionInt8CpuArgs& a, int num_threads) {
  const int threads = attention_threads(num_threads);
  for_each_attention_task<Scratch>(attention_tasks(a.seqlens, a.batch, a.heads, threads), threads,
                                   [&](const AttentionTask& t, Scratch& scratch) {
                                     attend_block(a, t.row0, t.length, t.head, t.i_begin, t.i_end, scratch);
                                   });
}

}  // namespace
#endif

bool attention_int8_cpu_available() {
#if defined(FASTBERT_INT8_ATTENTION)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
         __builtin_cpu_supports("avx512vnni");
#else
  return false;
#endif
}

void attention_int8_cpu(const AttentionInt8CpuArgs& args, int num_threads) {
  if (!attention_int8_cpu_available()) {
    throw std::runtime_error("fastbert's int8 CPU attention needs an x86-64 CPU with AVX-512 VNNI");
  }
#if defined(FASTBERT_INT8_ATTENTION)
  if (args.batch > 0) run(args, num_threads);
#else
  (void)num_threads;
#endif
}

}  // namespace fastbert
