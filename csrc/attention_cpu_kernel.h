// The attention kernel of attention_cpu.h for one instruction set; attention_cpu.cpp includes this file once per
// set, with (all required):
//   KERNEL_NAMESPACE   the namespace to define it in
//   KERNEL_TARGET      __attribute__((target(...))) of every function here
//   LANES              floats per vector register (16: AVX-512, 8: AVX2)
//   TILE_ROWS          queries per register tile (ROWS)
//   QK_VECS, PV_VECS   vectors per row in the q k^T and p v register tiles (with ROWS rows, the accumulators must
//                      fit the 32 (AVX-512) or 16 (AVX2) vector registers beside the operands)
//
// One task = one sequence's head h and a block of its queries; per task (L keys, D = head_dim):
//   kt [D, Lp]  = k^T, zero past L      vp [L, Dp] = v, zero past D      (Lp, Dp: L, D rounded up to LANES)
//   line[t]     = bias[h, clamp(t - (L - 1), -R, R) + R]: row i's bias for key j is line[j - i + L - 1]
//                 (a sequence with holes reads the table by its columns instead, key by key)
//   DeBERTa: the rows [first, first + N) of pos_key / pos_query that the sequence's distances reach, transposed like
//   kt ([D, Np], Np = N rounded up to LANES); p2c [L, Np] = k . rqt (every key's dot products with them), and
//   rline[t]    = rel_index[(L - 1 - t) + center] - first: row i's row for key j is rline[j - i + L - 1]
//   per ROWS queries: s = q kt (registers -> [ROWS, Lp] in L1), p = exp(scale s + bias - max) row by row (DeBERTa:
//                     c2p = q rkt [ROWS, Np] beside it, exp(scale (s + c2p[i, r] + p2c[j, r]) - max), the two
//                     terms gathered by r),
//                     out = (p vp) / sum(p), first D lanes stored.
//   Without bias, window or holes the softmax takes the max of the raw scores and exponentiates in one more pass.
// Each query's whole row of scores is kept (ROWS rows of Lp floats: L1 up to about a thousand keys, L2 beyond), so
// the softmax is exact in one pass, with no running rescale.
// bfloat16 (T = bf16): q, k and v become float32 as they are copied into the tiles (kt by 32-bit gathers of element
// pairs, vp and each tile's queries or, for p2c, keys row by row; DeBERTa's tables come in float32), so everything
// after runs the float32 code; each output is rounded to bfloat16 (to nearest even, as torch rounds) when stored.
// No other rounding: the scores, softmax and sums are float32, where torch's bf16 SDPA rounds the probabilities to
// bf16 before p v.
// Vectors are GCC/Clang vector extensions; no -ffast-math: the sums' order is fixed.

namespace KERNEL_NAMESPACE {

typedef float vec __attribute__((vector_size(LANES * 4)));
typedef int32_t ivec __attribute__((vector_size(LANES * 4)));
typedef uint32_t uvec __attribute__((vector_size(LANES * 4)));
typedef uint16_t bf16;  // a bfloat16's bits: the upper half of a float32's

constexpr int ROWS = TILE_ROWS;  // queries per register tile

// (not vec{} + x: IEEE's 0 + x is an add before the broadcast, and a broadcast from a register takes the port of the
// second FMA unit; from memory it is one load)
KERNEL_TARGET static inline vec splat(float x) {
#if LANES == 16
  return reinterpret_cast<vec>(_mm512_set1_ps(x));
#else
  return reinterpret_cast<vec>(_mm256_set1_ps(x));
#endif
}
KERNEL_TARGET static inline vec load(const float* p) { vec v; std::memcpy(&v, p, sizeof v); return v; }
KERNEL_TARGET static inline void store(float* p, vec v) { std::memcpy(p, &v, sizeof v); }

KERNEL_TARGET static inline ivec load_int(const int32_t* p) { ivec v; std::memcpy(&v, p, sizeof v); return v; }

// base[index[k]] for each lane k (every index in bounds: the caller clamps the lanes it masks afterwards)
KERNEL_TARGET static inline vec gather(const float* base, ivec index) {
#if LANES == 16
  return reinterpret_cast<vec>(_mm512_i32gather_ps(reinterpret_cast<__m512i>(index), base, 4));
#else
  return reinterpret_cast<vec>(_mm256_i32gather_ps(base, reinterpret_cast<__m256i>(index), 4));
#endif
}

// LANES 32-bit words at base + 2 index[k] bytes: for bf16 rows, elements (d, d + 1) of LANES rows at once
KERNEL_TARGET static inline uvec gather_pairs(const bf16* base, ivec index) {
#if LANES == 16
  return reinterpret_cast<uvec>(_mm512_i32gather_epi32(reinterpret_cast<__m512i>(index), base, 2));
#else
  return reinterpret_cast<uvec>(_mm256_i32gather_epi32(reinterpret_cast<const int*>(base),
                                                       reinterpret_cast<__m256i>(index), 2));
#endif
}

KERNEL_TARGET static inline vec bits_to_vec(uvec bits) { vec v; std::memcpy(&v, &bits, sizeof v); return v; }

KERNEL_TARGET static inline float to_float(float x) { return x; }
KERNEL_TARGET static inline float to_float(bf16 x) {
  const uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// float32 -> bfloat16, to nearest even; a NaN stays a (quiet) NaN
KERNEL_TARGET static inline bf16 to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<bf16>((bits >> 16) | 0x40u);
  return static_cast<bf16>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

// n elements of a row of T -> float32
KERNEL_TARGET static inline void row_to_float(const float* src, int64_t n, float* dst) {
  std::memcpy(dst, src, n * sizeof(float));
}
KERNEL_TARGET static inline void row_to_float(const bf16* src, int64_t n, float* dst) {
  for (int64_t i = 0; i < n; i++) dst[i] = to_float(src[i]);
}

// ROWS rows of T (row r at rows[r], D elements) as float32 rows in out: the rows themselves for float, else converted
// into buffer [ROWS, D]
template <typename T>
KERNEL_TARGET static inline void float_rows(const T* const* rows, int64_t D, float* buffer, const float** out) {
  for (int r = 0; r < ROWS; r++) {
    if constexpr (std::is_same_v<T, float>) {
      out[r] = rows[r];
    } else {
      row_to_float(rows[r], D, buffer + r * D);
      out[r] = buffer + r * D;
    }
  }
}

// the first `count` lanes of v -> dst (rounded to bfloat16 for bf16)
KERNEL_TARGET static inline void store_out(float* dst, vec v, int64_t count) {
  if (count == LANES) {
    store(dst, v);
  } else {
    float lanes[LANES];
    store(lanes, v);
    std::memcpy(dst, lanes, count * sizeof(float));
  }
}
KERNEL_TARGET static inline void store_out(bf16* dst, vec v, int64_t count) {
  for (int64_t i = 0; i < count; i++) dst[i] = to_bf16(v[i]);
}

KERNEL_TARGET static inline float reduce_max(vec v) {
  float m = v[0];
  for (int i = 1; i < LANES; i++) m = v[i] > m ? v[i] : m;
  return m;
}

KERNEL_TARGET static inline float reduce_sum(vec v) {
  float s = 0.f;
  for (int i = 0; i < LANES; i++) s += v[i];
  return s;
}

// e^x for x <= 0 (scores minus their row's max), 0 below -87 (where e^x leaves float32's normal range) and for
// -inf, NaN for NaN (a NaN score poisons its row, as in torch): e^x = 2^n 2^f with n = round(x log2 e), f in [-1/2, 1/2], 2^f by a degree-6 polynomial (relative error
// about 2e-7, below float32's rounding of the scores themselves).
KERNEL_TARGET static inline vec exp_nonpositive(vec x) {
  const vec t = x * splat(1.44269504088896341f);
  const vec n = (t + splat(12582912.f)) - splat(12582912.f);  // round to nearest (|t| < 2^22)
  const vec f = t - n;
  vec p = splat(1.535336188319500e-4f);
  p = p * f + splat(1.339887440266574e-3f);
  p = p * f + splat(9.618437357674640e-3f);
  p = p * f + splat(5.550332471162809e-2f);
  p = p * f + splat(2.402264791363012e-1f);
  p = p * f + splat(6.931472028550421e-1f);
  p = p * f + splat(1.f);
  const vec low = splat(-87.f);
  const ivec bits = (__builtin_convertvector(x > low ? n : low, ivec) + 127) << 23;  // 2^n
  vec scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return x > low ? p * scale : (x != x ? x : splat(0.f));
}

struct Scratch {
  std::vector<float> kt, vp, line, scores, rkt, rqt, c2p, p2c, tile_rows;
  std::vector<int32_t> rline;
};

// s[r, j] = q_r . kt[:, j] for the ROWS query rows `q` (each D floats) and the Lp keys of kt: QK_VECS * LANES keys
// per register tile, then LANES at a time.
template <int VECS>
KERNEL_TARGET static inline void score_tile(const float* const* q, const float* kt, int64_t D, int64_t Lp, int64_t j0,
                                            float* s) {
  vec acc[ROWS][VECS];
  for (int r = 0; r < ROWS; r++)
    for (int c = 0; c < VECS; c++) acc[r][c] = splat(0.f);
  for (int64_t d = 0; d < D; d++) {
    vec key[VECS];
    for (int c = 0; c < VECS; c++) key[c] = load(kt + d * Lp + j0 + c * LANES);
    for (int r = 0; r < ROWS; r++) {
      const vec query = splat(q[r][d]);
      for (int c = 0; c < VECS; c++) acc[r][c] += query * key[c];
    }
  }
  for (int r = 0; r < ROWS; r++)
    for (int c = 0; c < VECS; c++) store(s + r * Lp + j0 + c * LANES, acc[r][c]);
}

// s[r, :Np] = rows[r] . kt[:, :Np] for the ROWS rows (each D floats) and the Np columns of kt (a multiple of LANES).
KERNEL_TARGET static inline void score_rows(const float* const* rows, const float* kt, int64_t D, int64_t Np,
                                            float* s) {
  int64_t j0 = 0;
  for (; j0 + QK_VECS * LANES <= Np; j0 += QK_VECS * LANES) score_tile<QK_VECS>(rows, kt, D, Np, j0, s);
  for (; j0 < Np; j0 += LANES) score_tile<1>(rows, kt, D, Np, j0, s);
}

// out[r, c0 : c0 + VECS * LANES] = sum_j p[r, j] vp[j, c0 : ...] for the ROWS rows of p (row stride Lp), L keys.
template <int VECS>
KERNEL_TARGET static inline void value_tile(const float* p, const float* vp, int64_t L, int64_t Lp, int64_t Dp,
                                            int64_t c0, vec (*out)[PV_VECS]) {
  vec acc[ROWS][VECS];
  for (int r = 0; r < ROWS; r++)
    for (int c = 0; c < VECS; c++) acc[r][c] = splat(0.f);
  for (int64_t j = 0; j < L; j++) {
    vec value[VECS];
    for (int c = 0; c < VECS; c++) value[c] = load(vp + j * Dp + c0 + c * LANES);
    for (int r = 0; r < ROWS; r++) {
      const vec weight = splat(p[r * Lp + j]);
      for (int c = 0; c < VECS; c++) acc[r][c] += weight * value[c];
    }
  }
  for (int r = 0; r < ROWS; r++)
    for (int c = 0; c < VECS; c++) out[r][c] = acc[r][c];
}

// Which keys query i sees and what it adds to their scores: its slice of the line (entry j: key j's bias) or
// nothing, and the window; or, for a sequence with holes, the tokens' columns and the table itself.
struct RowTerms {
  const float* line;     // row i's slice of the line, or null
  const int32_t* columns;  // [L] the sequence's columns, or null (consecutive)
  const float* table;    // [2R + 1] this head's bias by distance, or null (read with columns only)
  int64_t radius, window;  // window < 0: none
  int64_t i;
  // DeBERTa: row i's c2p [rows] and the sequence's p2c [L, rows] for this head (either may be null), with row i's
  // slice of rline (consecutive columns) or the index by distance less ``first`` (read with columns)
  const float* c2p;
  const float* p2c;
  int64_t rows;
  const int32_t* rline;
  const int32_t* index;
  int64_t center, first;
};

KERNEL_TARGET static inline bool disentangled(const RowTerms& t) { return t.c2p || t.p2c; }

// scores row [Lp] -> exp(scale s + bias - max) (zero for keys past L or outside the window); returns 1 / sum.
KERNEL_TARGET static inline float softmax_row(float* row, const RowTerms& t, int64_t L, int64_t Lp, float scale) {
  const vec minus_inf = splat(-INFINITY);
  vec top = minus_inf;
  if (!t.columns && !t.line && !t.rline && (t.window < 0 || t.window >= L)) {
    // Nothing added and every key seen: the max of the raw scores (rounding s scale keeps their order, so max scale
    // is the max of s scale), then exp(s scale - max scale) in one pass
    for (int64_t j = L; j < Lp; j++) row[j] = -INFINITY;
    for (int64_t j = 0; j < Lp; j += LANES) top = load(row + j) > top ? load(row + j) : top;
    const vec m = splat(reduce_max(top) * scale), scaled = splat(scale);
    vec sum = splat(0.f);
    for (int64_t j = 0; j < Lp; j += LANES) {
      const vec e = exp_nonpositive(load(row + j) * scaled - m);
      store(row + j, e);
      sum += e;
    }
    return 1.f / reduce_sum(sum);
  }
  if (t.columns) {  // holes: distances between columns, one key at a time
    const int64_t ci = t.columns[t.i];
    for (int64_t j = 0; j < Lp; j++) {
      const int64_t distance = j < L ? t.columns[j] - ci : 0;
      float x = row[j] * scale;
      if (t.table) x += t.table[std::min(std::max(distance, -t.radius), t.radius) + t.radius];
      if (disentangled(t) && j < L) {
        const int64_t r = t.index[t.center - distance] - t.first;  // (by query column - key column)
        x = (row[j] + (t.c2p ? t.c2p[r] : 0.f) + (t.p2c ? t.p2c[j * t.rows + r] : 0.f)) * scale;
      }
      row[j] = j >= L || (t.window >= 0 && std::abs(distance) > t.window) ? -INFINITY : x;
    }
    for (int64_t j = 0; j < Lp; j += LANES) top = load(row + j) > top ? load(row + j) : top;
  } else {
    ivec lane;
    for (int i = 0; i < LANES; i++) lane[i] = i;
    const int32_t window = static_cast<int32_t>(t.window < 0 ? L : std::min(t.window, L));  // (L < 2^31)
    const int32_t last = static_cast<int32_t>(L - 1), rows = static_cast<int32_t>(t.rows);
    for (int64_t j = 0; j < Lp; j += LANES) {
      const ivec key = lane + static_cast<int32_t>(j), distance = key - static_cast<int32_t>(t.i);
      vec x = load(row + j);
      if (t.rline) {  // (rline holds row 0 past the last key; the p2c rows of keys past L are clamped to L - 1)
        const ivec r = load_int(t.rline + j);
        if (t.c2p) x += gather(t.c2p, r);
        if (t.p2c) x += gather(t.p2c, (key < last ? key : last) * rows + r);
      }
      x *= splat(scale);
      if (t.line) x += load(t.line + j);
      x = key < static_cast<int32_t>(L) && distance <= window && -distance <= window ? x : minus_inf;
      store(row + j, x);
      top = x > top ? x : top;
    }
  }
  const vec m = splat(reduce_max(top));
  vec sum = splat(0.f);
  for (int64_t j = 0; j < Lp; j += LANES) {
    const vec e = exp_nonpositive(load(row + j) - m);
    store(row + j, e);
    sum += e;
  }
  return 1.f / reduce_sum(sum);
}

// One task: head h of the sequence at rows [row0, row0 + L), queries [i_begin, i_end) of it; qkv and out of T.
template <typename T>
KERNEL_TARGET static void attend_block(const fastbert::AttentionCpuArgs& a, int64_t row0, int64_t L, int64_t h,
                                       int64_t i_begin, int64_t i_end, Scratch& scratch) {
  const int64_t H = a.heads, D = a.head_dim, qkv_stride = 3 * H * D, out_stride = H * D;
  const int64_t Lp = (L + LANES - 1) / LANES * LANES, Dp = (D + LANES - 1) / LANES * LANES;
  const T* q = static_cast<const T*>(a.qkv) + row0 * qkv_stride + h * D;
  const T* k = q + H * D;
  const T* v = q + 2 * H * D;
  T* const out = static_cast<T*>(a.out);

  scratch.kt.assign(D * Lp, 0.f);
  scratch.vp.assign(L * Dp, 0.f);
  scratch.scores.resize(ROWS * Lp);
  float* kt = scratch.kt.data();
  float* vp = scratch.vp.data();
  // k^T: LANES keys' element d by one gather (a scalar transposition costs a fifth of the task at 128 tokens). The
  // keys' rows are 3 H D floats apart, which no hardware prefetcher follows: the next LANES rows of k and v are
  // prefetched while these are gathered.
  int64_t gathered = 0;
  if (qkv_stride * LANES < INT32_MAX) {
    ivec offsets;
    for (int i = 0; i < LANES; i++) offsets[i] = static_cast<int32_t>(i * qkv_stride);
    for (; gathered + LANES <= L; gathered += LANES) {
      for (int64_t j = gathered + LANES; j < std::min<int64_t>(gathered + 2 * LANES, L); j++)
        for (int64_t d = 0; d < D; d += 16) {
          __builtin_prefetch(k + j * qkv_stride + d);
          __builtin_prefetch(v + j * qkv_stride + d);
        }
      const T* keys = k + gathered * qkv_stride;
      if constexpr (std::is_same_v<T, float>) {
        for (int64_t d = 0; d < D; d++) store(kt + d * Lp + gathered, gather(keys + d, offsets));
      } else {  // (elements d and d + 1 in one word: the low half is d's bits, the high half d + 1's)
        int64_t d = 0;
        for (; d + 1 < D; d += 2) {
          const uvec pair = gather_pairs(keys + d, offsets);
          store(kt + d * Lp + gathered, bits_to_vec(pair << 16));
          store(kt + (d + 1) * Lp + gathered, bits_to_vec(pair & 0xffff0000u));
        }
        for (; d < D; d++)
          for (int i = 0; i < LANES; i++) kt[d * Lp + gathered + i] = to_float(keys[i * qkv_stride + d]);
      }
    }
  }
  for (int64_t j = gathered; j < L; j++)
    for (int64_t d = 0; d < D; d++) kt[d * Lp + j] = to_float(k[j * qkv_stride + d]);
  for (int64_t j = 0; j < L; j++) row_to_float(v + j * qkv_stride, D, vp + j * Dp);
  const float* line = nullptr;
  const int32_t* columns = a.columns ? a.columns + row0 : nullptr;
  if (a.relative_bias && !columns) {
    // 2L - 1 distances, plus Lp - L + 1 entries read (and masked) for the keys past L
    scratch.line.assign(2 * L + Lp, 0.f);
    const float* table = a.relative_bias + h * (2 * a.radius + 1);
    for (int64_t t = 0; t < 2 * L - 1; t++) {
      const int64_t distance = std::min(std::max(t - (L - 1), -a.radius), a.radius);
      scratch.line[t] = table[distance + a.radius];
    }
    line = scratch.line.data();
  }
  // DeBERTa: the rows this sequence's distances reach, [first, first + N), and every key's dot products with r_q's
  const bool terms = a.pos_key || a.pos_query;
  scratch.tile_rows.resize(ROWS * D);  // (bf16: a tile's query or key rows in float32)
  int64_t first = 0, Np = 0;
  const int32_t* rline = nullptr;
  float* c2p = nullptr;
  float* p2c = nullptr;
  if (terms) {
    int64_t reach = L - 1;  // the largest distance between two of its columns
    if (columns) reach = *std::max_element(columns, columns + L) - *std::min_element(columns, columns + L);
    int64_t last = first = a.rel_index[a.rel_center];
    for (int64_t d = -reach; d <= reach; d++) {
      first = std::min<int64_t>(first, a.rel_index[a.rel_center + d]);
      last = std::max<int64_t>(last, a.rel_index[a.rel_center + d]);
    }
    Np = (last - first + 1 + LANES - 1) / LANES * LANES;
    const auto transposed = [&](const float* rows, std::vector<float>& out) {  // rows [R, H, D] -> [D, Np] of head h
      out.assign(D * Np, 0.f);
      for (int64_t r = first; r <= last; r++)
        for (int64_t d = 0; d < D; d++) out[d * Np + (r - first)] = rows[(r * H + h) * D + d];
    };
    if (a.pos_key) {
      transposed(a.pos_key, scratch.rkt);
      scratch.c2p.resize(ROWS * Np);
      c2p = scratch.c2p.data();
    }
    if (a.pos_query) {
      transposed(a.pos_query, scratch.rqt);
      scratch.p2c.resize((L + ROWS) * Np);  // (a last tile of fewer than ROWS keys writes copies past L)
      p2c = scratch.p2c.data();
      for (int64_t j0 = 0; j0 < L; j0 += ROWS) {
        const T* rows[ROWS];
        for (int r = 0; r < ROWS; r++) rows[r] = k + std::min<int64_t>(j0 + r, L - 1) * qkv_stride;
        const float* key[ROWS];
        float_rows(rows, D, scratch.tile_rows.data(), key);
        score_rows(key, scratch.rqt.data(), D, Np, p2c + j0 * Np);
      }
    }
    if (!columns) {
      // 2L - 1 distances, plus Lp - L + 1 entries of row 0 read (and masked) for the keys past L
      scratch.rline.assign(2 * L + Lp, 0);
      for (int64_t t = 0; t < 2 * L - 1; t++)
        scratch.rline[t] = static_cast<int32_t>(a.rel_index[(L - 1 - t) + a.rel_center] - first);
      rline = scratch.rline.data();
    }
  }

  float* s = scratch.scores.data();
  for (int64_t i0 = i_begin; i0 < i_end; i0 += ROWS) {
    const int rows = static_cast<int>(std::min<int64_t>(ROWS, i_end - i0));
    const T* query_rows[ROWS];
    for (int r = 0; r < ROWS; r++) query_rows[r] = q + (i0 + std::min(r, rows - 1)) * qkv_stride;  // spare: a copy
    const float* query[ROWS];
    float_rows(query_rows, D, scratch.tile_rows.data(), query);
    for (int64_t i = i0 + ROWS; i < std::min<int64_t>(i0 + 2 * ROWS, i_end); i++)  // (the next tile's queries)
      for (int64_t d = 0; d < D; d += 16) __builtin_prefetch(q + i * qkv_stride + d);

    score_rows(query, kt, D, Lp, s);
    if (c2p) score_rows(query, scratch.rkt.data(), D, Np, c2p);

    float inverse_sum[ROWS];
    for (int r = 0; r < rows; r++) {
      const int64_t i = i0 + r;
      const RowTerms row_terms{line ? line + (L - 1 - i) : nullptr, columns,
                               a.relative_bias ? a.relative_bias + h * (2 * a.radius + 1) : nullptr, a.radius,
                               a.window, i,
                               c2p ? c2p + r * Np : nullptr, p2c, Np, rline ? rline + (L - 1 - i) : nullptr,
                               a.rel_index, a.rel_center, first};
      inverse_sum[r] = softmax_row(s + r * Lp, row_terms, L, Lp, a.scale);
    }

    for (int64_t c0 = 0; c0 < Dp; c0 += PV_VECS * LANES) {
      vec acc[ROWS][PV_VECS];
      const int64_t vecs = std::min<int64_t>(PV_VECS, (Dp - c0) / LANES);
      switch (vecs) {
        case PV_VECS: value_tile<PV_VECS>(s, vp, L, Lp, Dp, c0, acc); break;
#if PV_VECS > 3
        case 3: value_tile<3>(s, vp, L, Lp, Dp, c0, acc); break;
#endif
#if PV_VECS > 2
        case 2: value_tile<2>(s, vp, L, Lp, Dp, c0, acc); break;
#endif
        default: value_tile<1>(s, vp, L, Lp, Dp, c0, acc); break;
      }
      for (int r = 0; r < rows; r++) {
        T* o = out + (row0 + i0 + r) * out_stride + h * D;
        for (int64_t c = 0; c < vecs; c++) {
          const int64_t first = c0 + c * LANES;
          store_out(o + first, acc[r][c] * splat(inverse_sum[r]), std::min<int64_t>(LANES, D - first));
        }
      }
    }
  }
}

KERNEL_TARGET void run(const fastbert::AttentionCpuArgs& a, int num_threads) {
  const int threads = fastbert::attention_threads(num_threads);
  fastbert::for_each_attention_task<Scratch>(
      fastbert::attention_tasks(a.seqlens, a.batch, a.heads, threads), threads,
      [&](const fastbert::AttentionTask& t, Scratch& scratch) {
        if (a.bf16) {
          attend_block<bf16>(a, t.row0, t.length, t.head, t.i_begin, t.i_end, scratch);
        } else {
          attend_block<float>(a, t.row0, t.length, t.head, t.i_begin, t.i_end, scratch);
        }
      });
}

}  // namespace KERNEL_NAMESPACE
