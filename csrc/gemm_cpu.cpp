// The CPU GEMM of gemm_cpu.h: AVX2 and FMA (by target attribute; the extension itself is built for the compiler's
// baseline), 6 rows x 16 columns of accumulators per register tile: per input, 2 loads of the weight panel, 6
// broadcasts of x, 12 FMAs, 12 of the 16 vector registers holding sums. A thread's task is up to 256 rows by up to
// 4 panels, the whole input dimension in one sweep (a panel of 16 x 3072 floats stays in L2 across the rows), while
// the panel it reads next is requested into L2 (1.08x a 38-token forward of all-MiniLM-L6-v2, whose weights are
// read from memory once per forward).
// Seen on an AMD EPYC Zen 3 (AVX2 only), 2 threads, bert-base's GEMMs at 128 rows: 135-155 GFLOP/s, where torch's
// F.linear (MKL) ran 100-125.
#include "gemm_cpu.h"
#include "gelu_avx2.h"
#include "gemm_tasks.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <stdexcept>

#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__))
#define FASTBERT_X86_GEMM 1
#include <immintrin.h>
#endif

namespace fastbert {
namespace {

constexpr int kPanel = 16;         // columns per panel: 2 AVX2 vectors
constexpr int kTileRows = 6;       // rows per register tile
constexpr int64_t kPartial = 64;   // inputs summed from zero before joining an output's running sum
constexpr int64_t kFlopsPerThread = 1 << 18;  // below this a GEMM runs on one thread (a region costs ~2 us)

#if defined(FASTBERT_X86_GEMM)
#define AVX2 __attribute__((target("avx2,fma")))

// Sums of R rows (R <= kTileRows) of x times one panel over inputs [0, in), plus bias, plus residual, through the
// GELU where `act` says so: stored to the panel's `columns` (<= 16) columns of y. Meanwhile `lines` cache lines from
// `ahead` (a slice of the panel the thread reads next) are requested into L2, spread over the sweep.
template <int R>
AVX2 inline void tile(const float* x, int64_t x_stride, const float* panel, int64_t in, const float* bias,
                      const float* residual, float* y, int64_t out, int columns, bool act, const float* ahead,
                      int64_t lines) {
  float edge[kPanel] = {};  // a partial panel's bias or residual row, zero past its columns
  __m256 sum[kTileRows][2];
  if (bias != nullptr && columns < kPanel) std::memcpy(edge, bias, columns * sizeof(float));
  const float* b = columns < kPanel ? edge : bias;
  for (int r = 0; r < R; ++r) {
    sum[r][0] = b ? _mm256_loadu_ps(b) : _mm256_setzero_ps();
    sum[r][1] = b ? _mm256_loadu_ps(b + 8) : _mm256_setzero_ps();
  }
  const int64_t lines_per_partial = lines > 0 ? (lines * kPartial + in - 1) / in : 0;  // (lines <= in)
  for (int64_t i0 = 0; i0 < in; i0 += kPartial) {
    const int64_t i1 = std::min(in, i0 + kPartial);
    for (int64_t l = 0; l < lines_per_partial && lines > 0; ++l, --lines, ahead += kPanel)
      _mm_prefetch(reinterpret_cast<const char*>(ahead), _MM_HINT_T1);
    // Named accumulators, not an array: GCC keeps an array indexed in a loop on the stack.
    __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00, c31 = c00,
           c40 = c00, c41 = c00, c50 = c00, c51 = c00;
    const float* xi = x + i0;
    const float* w = panel + i0 * kPanel;
#pragma GCC unroll 4
    for (int64_t i = i0; i < i1; ++i, ++xi, w += kPanel) {
      const __m256 w0 = _mm256_loadu_ps(w), w1 = _mm256_loadu_ps(w + 8);
      // Row r of the tile (when the tile has it): one broadcast of x, two FMAs.
#define FASTBERT_GEMM_ROW(r)                                                                      \
  if constexpr (R > r) {                                                                          \
    const __m256 v = _mm256_broadcast_ss(xi + r * x_stride);                                      \
    c##r##0 = _mm256_fmadd_ps(v, w0, c##r##0), c##r##1 = _mm256_fmadd_ps(v, w1, c##r##1);        \
  }
      FASTBERT_GEMM_ROW(0) FASTBERT_GEMM_ROW(1) FASTBERT_GEMM_ROW(2)
      FASTBERT_GEMM_ROW(3) FASTBERT_GEMM_ROW(4) FASTBERT_GEMM_ROW(5)
#undef FASTBERT_GEMM_ROW
    }
    const __m256 partial[kTileRows][2] = {{c00, c01}, {c10, c11}, {c20, c21}, {c30, c31}, {c40, c41}, {c50, c51}};
    for (int r = 0; r < R; ++r) {
      sum[r][0] = _mm256_add_ps(sum[r][0], partial[r][0]);
      sum[r][1] = _mm256_add_ps(sum[r][1], partial[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    __m256 y0 = sum[r][0], y1 = sum[r][1];
    const float* res = residual ? residual + r * out : nullptr;
    if (act) y0 = gelu_avx2(y0), y1 = gelu_avx2(y1);
    if (columns == kPanel) {
      if (res) y0 = _mm256_add_ps(y0, _mm256_loadu_ps(res)), y1 = _mm256_add_ps(y1, _mm256_loadu_ps(res + 8));
      _mm256_storeu_ps(y + r * out, y0);
      _mm256_storeu_ps(y + r * out + 8, y1);
    } else {
      if (res) {
        std::memcpy(edge, res, columns * sizeof(float));
        y0 = _mm256_add_ps(y0, _mm256_loadu_ps(edge)), y1 = _mm256_add_ps(y1, _mm256_loadu_ps(edge + 8));
      }
      _mm256_storeu_ps(edge, y0);
      _mm256_storeu_ps(edge + 8, y1);
      std::memcpy(y + r * out, edge, columns * sizeof(float));
    }
  }
}

// Rows of a tile, from the rows left: kTileRows, but never a tile under 4 rows where the rows allow (a tile of R
// rows keeps 2 R chains of FMAs in flight; under 8 chains the FMA latency, not throughput, bounds it: 38 rows run
// as 6 x 5 + 4 + 4, not 6 x 6 + 2).
inline int tile_rows(int64_t left) {
  if (left >= kTileRows + 4 || left <= kTileRows) return static_cast<int>(std::min<int64_t>(kTileRows, left));
  return static_cast<int>(left - 4);  // 7..9 rows left: 3..5 now, then 4
}

// Rows [0, rows) of x times panel p, tile by tile; meanwhile panel `next` (the panel this thread reads after p, or
// -1) is requested into L2, a slice per tile: the first sweep over a panel otherwise waits on memory, since a model's
// weights (tens of MB) outgrow the caches and each is read once per forward.
AVX2 void panel_rows(const GemmCpuArgs& a, int64_t row0, int64_t rows, int64_t p, int64_t next) {
  const int64_t column = p * kPanel;
  const int columns = static_cast<int>(std::min<int64_t>(kPanel, a.out - column));
  const float* panel = a.packed + p * a.in * kPanel;
  const float* bias = a.bias ? a.bias + column : nullptr;
  const float* ahead = next >= 0 ? a.packed + next * a.in * kPanel : nullptr;
  const int64_t tiles = (rows + kTileRows - 1) / kTileRows;
  const int64_t lines_per_tile = ahead ? (a.in + tiles - 1) / tiles : 0;  // a panel row of 16 floats is one line
  int64_t prefetched = 0;
  for (int64_t r = row0; r < row0 + rows;) {
    const int n = tile_rows(row0 + rows - r);
    const float* x = a.x + r * a.x_stride;
    const float* residual = a.residual ? a.residual + r * a.out + column : nullptr;
    float* y = a.y + r * a.out + column;
    const int64_t lines = std::min(lines_per_tile, a.in - prefetched);
    const float* slice = ahead ? ahead + prefetched * kPanel : nullptr;
    prefetched += lines;
    switch (n) {
      case 6: tile<6>(x, a.x_stride, panel, a.in, bias, residual, y, a.out, columns, a.gelu, slice, lines); break;
      case 5: tile<5>(x, a.x_stride, panel, a.in, bias, residual, y, a.out, columns, a.gelu, slice, lines); break;
      case 4: tile<4>(x, a.x_stride, panel, a.in, bias, residual, y, a.out, columns, a.gelu, slice, lines); break;
      case 3: tile<3>(x, a.x_stride, panel, a.in, bias, residual, y, a.out, columns, a.gelu, slice, lines); break;
      case 2: tile<2>(x, a.x_stride, panel, a.in, bias, residual, y, a.out, columns, a.gelu, slice, lines); break;
      default: tile<1>(x, a.x_stride, panel, a.in, bias, residual, y, a.out, columns, a.gelu, slice, lines); break;
    }
    r += n;
  }
}
#endif

}  // namespace

bool gemm_cpu_available() {
#if defined(FASTBERT_X86_GEMM)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
  return false;
#endif
}

void gemm_cpu(const GemmCpuArgs& a, int num_threads) {
  if (!gemm_cpu_available()) throw std::runtime_error("fastbert's CPU GEMM needs an x86-64 CPU with AVX2 and FMA");
#if defined(FASTBERT_X86_GEMM)
  const GemmTasks split(a.rows, a.in, a.out, kPanel, num_threads, kFlopsPerThread);
#pragma omp parallel for schedule(dynamic, 1) num_threads(split.threads) if (split.threads > 1)
  for (int64_t task = 0; task < split.tasks; ++task) {
    const int64_t row0 = split.row0(task), rows = split.rows(task, a.rows);
    const int64_t p0 = split.first_panel(task), p1 = split.end_panel(task);
    // After its last panel a thread most likely takes the task `threads` further on (dynamic, but near round robin).
    const int64_t later = task + split.threads;
    const int64_t next_task_panel = later < split.tasks ? split.first_panel(later) : -1;
    for (int64_t p = p0; p < p1; ++p) panel_rows(a, row0, rows, p, p + 1 < p1 ? p + 1 : next_task_panel);
  }
#else
  (void)a, (void)num_threads;
#endif
}

}  // namespace fastbert
