// How the CPU attentions (attention_cpu.h, attention_int8_cpu.h) split their work over OpenMP threads: one task per
// (sequence, head), longest sequences first so that dynamic scheduling ends with the small tasks, unless that leaves
// fewer than 4 tasks per thread (one long sequence on many cores): then blocks of at least 64 queries, each block
// packing its head's keys and values again. A thread takes a whole sequence at a time where there are at least two
// per thread, else its share of the sequence's heads: a sequence's heads share the cache lines and pages of its rows
// (Intel Xeon, 2 threads, 12 heads of 64, 12 layers: the int8 attention at 8 x 128 15.7 ms against 17.2 taking one
// head at a time, the float32 one on lengths 256..24 33.2 against 34.3).
#pragma once

#include <algorithm>
#include <climits>
#include <cstdint>
#include <new>
#include <vector>

#if defined(_OPENMP)
#include <omp.h>
#endif

namespace fastbert {

struct AttentionTask {
  int64_t row0, length;          // the sequence's first row and its length
  int64_t head, i_begin, i_end;  // the head; its queries [i_begin, i_end)
};

inline int attention_threads(int num_threads) {
#if defined(_OPENMP)
  return num_threads > 0 ? num_threads : omp_get_max_threads();
#else
  (void)num_threads;
  return 1;
#endif
}

inline std::vector<AttentionTask> attention_tasks(const int64_t* seqlens, int64_t batch, int64_t heads, int threads) {
  std::vector<int64_t> order(batch), starts(batch);
  int64_t row = 0;
  for (int64_t b = 0; b < batch; b++) {
    order[b] = b;
    starts[b] = row;
    row += seqlens[b];
  }
  std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) { return seqlens[x] > seqlens[y]; });
  const int64_t heads_of_sequences = batch * heads;
  int64_t block = INT64_MAX;
  if (batch > 0 && heads_of_sequences < 4 * threads) {
    const int64_t splits = (4 * threads + heads_of_sequences - 1) / std::max<int64_t>(heads_of_sequences, 1);
    block = std::max<int64_t>(64, (seqlens[order[0]] + splits - 1) / splits);
  }
  std::vector<AttentionTask> tasks;
  for (int64_t b : order)
    for (int64_t h = 0; h < heads; h++)
      for (int64_t i = 0, L = seqlens[b]; i < L; i += std::min(block, L - i))
        tasks.push_back({starts[b], L, h, i, i + std::min(block, L - i)});
  return tasks;
}

// attend(task, scratch) for every task on `threads` OpenMP threads, each with a Scratch of its own. An allocation
// failure inside is rethrown after the parallel region (an exception must not leave one: it would end the process).
template <typename Scratch, typename Attend>
void for_each_attention_task(const std::vector<AttentionTask>& tasks, int threads, Attend attend) {
  const int64_t count = static_cast<int64_t>(tasks.size());
  int64_t first_sequence = 0;  // (its tasks: heads x blocks)
  while (first_sequence < count && tasks[first_sequence].row0 == tasks[0].row0) first_sequence++;
  const int64_t sequences_per_thread = count / std::max<int64_t>(first_sequence, 1) / std::max(threads, 1);
  const int64_t run = sequences_per_thread >= 2 ? first_sequence : std::max<int64_t>(1, first_sequence / threads);
  bool out_of_memory = false;
#if defined(_OPENMP)
#pragma omp parallel num_threads(threads) if (count > 1 && threads > 1)
#else
  (void)threads;
#endif
  {
    Scratch scratch;
#if defined(_OPENMP)
#pragma omp for schedule(dynamic, run)
#endif
    for (int64_t t = 0; t < count; t++) {
      try {
        attend(tasks[t], scratch);
      } catch (const std::bad_alloc&) {
#if defined(_OPENMP)
#pragma omp atomic write
#endif
        out_of_memory = true;
      }
    }
  }
  if (out_of_memory) throw std::bad_alloc();
}

}  // namespace fastbert
