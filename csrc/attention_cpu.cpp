// Launcher of the CPU attention (attention_cpu.h): the kernel (attention_cpu_kernel.h) compiled for AVX-512 and for
// AVX2 in this one file, each with its target attribute, and the one this CPU supports picked at run time. The
// extension itself is built for the compiler's baseline, so it loads on any x86-64 CPU and elsewhere (where there
// is no kernel: attention_cpu_isas() is empty).
//
// Per thread and key: 2 D FLOPs of q k^T plus 2 D of p v against one exp; the register tiles (ROWS queries by
// QK_VECS or PV_VECS vectors) keep each loaded key or value vector for ROWS FMAs. Seen on an AMD EPYC Zen 4 (AVX-512),
// one thread, 12 heads of 64, 256 tokens: 84 GFLOP/s, where torch's bmm, softmax and bmm reached 40 to 66.
#include "attention_cpu.h"
#include "attention_tasks.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__))
#define FASTBERT_X86_KERNELS 1
#include <immintrin.h>  // (the gathers: k^T, bf16 pairs, DeBERTa's position terms)
// (vectors wider than the baseline's registers cross no function boundary: every helper is inlined)
#pragma GCC diagnostic ignored "-Wpsabi"

// 32 vector registers: 8 x 2 accumulators beside the loaded operands (8 query rows per tile: measured 1.2-1.4x the
// throughput of 4 x 3 on an Intel Xeon with AVX-512, 12 heads of 64, 128 to 512 tokens).
#define KERNEL_NAMESPACE avx512
#define KERNEL_TARGET __attribute__((target("avx512f,avx512dq,avx2,fma")))
#define LANES 16
#define TILE_ROWS 8
#define QK_VECS 2
#define PV_VECS 2
#include "attention_cpu_kernel.h"
#undef KERNEL_NAMESPACE
#undef KERNEL_TARGET
#undef LANES
#undef TILE_ROWS
#undef QK_VECS
#undef PV_VECS

// 16 vector registers: 4 x 2 accumulators beside the loaded operands.
#define KERNEL_NAMESPACE avx2
#define KERNEL_TARGET __attribute__((target("avx2,fma")))
#define LANES 8
#define TILE_ROWS 4
#define QK_VECS 2
#define PV_VECS 2
#include "attention_cpu_kernel.h"
#undef KERNEL_NAMESPACE
#undef KERNEL_TARGET
#undef LANES
#undef TILE_ROWS
#undef QK_VECS
#undef PV_VECS
#endif

namespace fastbert {

std::vector<std::string> attention_cpu_isas() {
  std::vector<std::string> isas;
#if defined(FASTBERT_X86_KERNELS)
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq")) isas.push_back("avx512");
  if (avx2) isas.push_back("avx2");
#endif
  return isas;
}

void attention_cpu(const AttentionCpuArgs& args, int num_threads, const std::string& isa) {
  const std::vector<std::string> isas = attention_cpu_isas();
  if (isas.empty()) throw std::runtime_error("fastbert's CPU attention needs an x86-64 CPU with AVX2 and FMA");
  const std::string chosen = isa.empty() ? isas.front() : isa;
  if (std::find(isas.begin(), isas.end(), chosen) == isas.end()) {
    throw std::invalid_argument("isa " + chosen + " is not one this CPU runs");
  }
#if defined(FASTBERT_X86_KERNELS)
  if (chosen == "avx512") return avx512::run(args, num_threads);
  return avx2::run(args, num_threads);
#else
  (void)args;
  (void)num_threads;
#endif
}

}  // namespace fastbert
