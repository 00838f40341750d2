// Padding-free attention on the CPU, float32 or bfloat16 in and out (float32 scores, softmax and sums either way):
// each sequence's rows attend to that sequence only, optionally with a relative-position bias by distance (MPNet's)
// or DeBERTa's disentangled position terms (their tables in float32 either way).
//
//   out[i, h] = sum_{j : |j - i| <= window} softmax_j(scale * q[i, h] . k[j, h] + bias[h, clamp(j - i, -R, R) + R]) v[j, h]
//
// or DeBERTa's disentangled scores, scale * (q . k + the query's and the key's position terms) gathered from tables.
// i, j run over one sequence's rows; distances are between their offsets, or between their columns in the padded
// batch when the caller passes them (a mask with holes). The reference is
// kernels/attention.py's attention_varlen_ref; fastbert/_extension.py checks every tensor before the kernel runs.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace fastbert {

struct AttentionCpuArgs {
  void* out;                    // [T, H, D], contiguous, of qkv's type
  const void* qkv;              // [T, 3, H, D], contiguous (the fused QKV GEMM's output): float, or bfloat16's bits
  bool bf16;                    // qkv and out are bfloat16 (uint16_t bits); the tables below are float either way
  const int64_t* seqlens;       // [batch]: sequence b is the next seqlens[b] rows (sum = T)
  int64_t batch;
  int64_t heads;                // H
  int64_t head_dim;             // D
  const float* relative_bias;   // [H, 2R + 1], contiguous, or null for none
  int64_t radius;               // R
  int64_t window;               // query i sees key j only where |j - i| <= window; < 0: every key
  const int32_t* columns;       // [T] the tokens' columns, distances between them; null: their offsets
  float scale;                  // 1 / sqrt(D), as the model uses it
  // DeBERTa's disentangled terms (fastbert/ops/disentangled.py), null for none: the score of query i and key j is
  // scale * (q_i . k_j + q_i . pos_key[r, h] + k_j . pos_query[r, h]) with r = rel_index[column_i - column_j +
  // rel_center]; each task forms the dot products with the rows its sequence's distances reach, in cache.
  const float* pos_key;         // [R, H, D] contiguous (the relative rows through the key projection), or null
  const float* pos_query;       // [R, H, D] contiguous (through the query projection), or null
  int64_t rel_rows;             // R
  const int32_t* rel_index;     // [2 rel_center + 1], rows in [0, R); non-null where c2p or p2c is
  int64_t rel_center;           // reaches every distance between a sequence's columns
};

// The instruction sets the kernel can run with here, fastest first: "avx512", "avx2"; none when this CPU or build
// has neither (the caller then takes torch's attention).
std::vector<std::string> attention_cpu_isas();

// OpenMP threads over (sequence, head, block of queries); `num_threads` <= 0: OpenMP's default. `isa`: one of
// attention_cpu_isas(), "" for the fastest (std::invalid_argument for one this CPU lacks).
void attention_cpu(const AttentionCpuArgs& args, int num_threads, const std::string& isa);

}  // namespace fastbert
