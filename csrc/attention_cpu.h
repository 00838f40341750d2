// Padding-free attention on the CPU, float32: each sequence's rows attend to that sequence only, optionally with a
// relative-position bias by distance (MPNet's).
//
//   out[i, h] = sum_{j : |j - i| <= window} softmax_j(scale * q[i, h] . k[j, h] + bias[h, clamp(j - i, -R, R) + R]) v[j, h]
//
// i, j run over one sequence's rows; distances are between their offsets, or between their columns in the padded
// batch when the caller passes them (a mask with holes). The reference is
// kernels/attention.py's attention_varlen_ref; fastbert/_extension.py checks every tensor before the kernel runs.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace fastbert {

struct AttentionCpuArgs {
  float* out;                   // [T, H, D], contiguous
  const float* qkv;             // [T, 3, H, D], contiguous (the fused QKV GEMM's output)
  const int64_t* seqlens;       // [batch]: sequence b is the next seqlens[b] rows (sum = T)
  int64_t batch;
  int64_t heads;                // H
  int64_t head_dim;             // D
  const float* relative_bias;   // [H, 2R + 1], contiguous, or null for none
  int64_t radius;               // R
  int64_t window;               // query i sees key j only where |j - i| <= window; < 0: every key
  const int32_t* columns;       // [T] the tokens' columns, distances between them; null: their offsets
  float scale;                  // 1 / sqrt(D), as the model uses it
};

// The instruction sets the kernel can run with here, fastest first: "avx512", "avx2"; none when this CPU or build
// has neither (the caller then takes torch's attention).
std::vector<std::string> attention_cpu_isas();

// OpenMP threads over (sequence, head, block of queries); `num_threads` <= 0: OpenMP's default. `isa`: one of
// attention_cpu_isas(), "" for the fastest (std::invalid_argument for one this CPU lacks).
void attention_cpu(const AttentionCpuArgs& args, int num_threads, const std::string& isa);

}  // namespace fastbert
