// How the CPU GEMMs (gemm_cpu.cpp, gemm_int8_cpu.cpp) split their work between threads: tasks of up to kBlockRows
// rows by up to kBlockPanels panels of 16 columns, each task the whole input dimension in one sweep, taken by OpenMP
// threads one at a time (schedule(dynamic, 1): a thread the OS deschedules on a busy machine leaves its later tasks
// to the others). Task t covers row block t / panel_blocks and panels [p0, p1) of panel block t % panel_blocks.
#pragma once

#include <algorithm>
#include <cstdint>

#if defined(_OPENMP)
#include <omp.h>
#endif

namespace fastbert {

struct GemmTasks {
  static constexpr int64_t kBlockRows = 256;
  static constexpr int64_t kBlockPanels = 4;
  int64_t panels = 0, panel_blocks = 0, block_panels = 0, tasks = 0;
  int threads = 1;

  // rows x in -> out with panels of `panel` columns; one thread below `work_per_thread` multiply-adds x 2 (a
  // parallel region costs ~2 us); num_threads <= 0: OpenMP's default.
  GemmTasks(int64_t rows, int64_t in, int64_t out, int64_t panel, int num_threads, int64_t work_per_thread) {
    panels = (out + panel - 1) / panel;
    const int64_t row_blocks = (rows + kBlockRows - 1) / kBlockRows;
#if defined(_OPENMP)
    const int most = num_threads > 0 ? num_threads : omp_get_max_threads();
#else
    const int most = 1;
    (void)num_threads;
#endif
    // Panels per task: up to kBlockPanels, fewer where that would leave under 4 tasks per thread.
    block_panels = std::clamp<int64_t>(row_blocks * panels / (4 * std::max(most, 1)), 1, kBlockPanels);
    panel_blocks = (panels + block_panels - 1) / block_panels;
    tasks = row_blocks * panel_blocks;
    threads = 2 * rows * in * out < work_per_thread ? 1 : static_cast<int>(std::min<int64_t>(most, tasks));
  }

  int64_t row0(int64_t task) const { return (task / panel_blocks) * kBlockRows; }
  int64_t rows(int64_t task, int64_t all_rows) const { return std::min(kBlockRows, all_rows - row0(task)); }
  int64_t first_panel(int64_t task) const { return (task % panel_blocks) * block_panels; }
  int64_t end_panel(int64_t task) const { return std::min(panels, first_panel(task) + block_panels); }
};

}  // namespace fastbert
