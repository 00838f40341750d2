// Padding-free attention on the CPU with its two matmuls in int8 (AVX-512 VNNI): the quantized variant of
// attention_cpu.h for models `fastbert.quantize` judged with it, without position bias or window.
//
//   per sequence and head:  kq = round(k / sk), vq = round(v / sv)       s8, one scale each: amax / 127
//                           qq = round(q_i / sq_i)                        s8, one scale per query row
//                           s_ij = (qq_i . kq_j) * sq_i * sk * scale      (exact int32 dot products)
//                           p_ij = round(255 exp(s_ij - max_j s_ij))      u8: the row's largest is 255
//                           out_i = (sum_j p_ij vq_j) * sv / sum_j p_ij   (exact int32 sums)
//
// With q set, each output row's u8 for the int8 GEMM that reads it next is written in the same pass (the O projection's
// static input: quantize_static_row of the row / smooth, quantize_cpu.h), as the CPU LayerNorm writes its own.
//
// The reference is fastbert/ops/attention_int8.py's attention_int8_ref (the same integers; its exp is torch's, so a
// probability can sit one level away at a rounding tie). A (sequence, head) whose k or v holds a NaN or an infinity
// gets NaN rows, as does a query row holding one: float32 attention would spread them too.
#pragma once

#include <cstdint>

namespace fastbert {

struct AttentionInt8CpuArgs {
  float* out;              // [T, H, D], contiguous
  const float* qkv;        // [T, 3, H, D], contiguous (the fused QKV GEMM's output)
  const int64_t* seqlens;  // [batch]: sequence b is the next seqlens[b] rows (sum = T)
  int64_t batch;
  int64_t heads;           // H
  int64_t head_dim;        // D
  float scale;             // 1 / sqrt(D), as the model uses it
  uint8_t* q;              // [T, H, D] u8 of out, or null: no quantized output
  const float* smooth;     // [H D] divisors (SmoothQuant) of the quantized output, or null
  double q_scale;          // the quantized output's scale (finite, > 0) and zero point ([0, 255]): checked by the
  int64_t q_zero_point;    // caller, as for quantize_static_cpu
};

// Whether this CPU and build run the kernel: x86-64 with AVX-512 F/BW/DQ/VL and VNNI.
bool attention_int8_cpu_available();

// OpenMP threads over (sequence, head, block of queries), as attention_cpu; `num_threads` <= 0: OpenMP's default.
// std::runtime_error where attention_int8_cpu_available() is false.
void attention_int8_cpu(const AttentionInt8CpuArgs& args, int num_threads);

}  // namespace fastbert
