// Fused BERT embedding: out[n] = LayerNorm(word[ids[n]] + position[pos[n]] + token_type[tt[n]]) * weight + bias.
//
// Shared by the CPU kernel, the CUDA kernel and the pybind11 bindings. Torch-free on purpose: the kernels get raw
// pointers, sizes and a dtype code from Python (see fastbert/_extension.py), so the extension builds under pip's
// build isolation without torch and never breaks against the user's torch version.
#pragma once

#include <cstdint>

namespace fastbert {

// Same codes as fastbert/_extension.py's _DTYPE_CODES.
enum class DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// One call's operands. Every tensor is contiguous and row-major; every table has `hidden` columns and the
// out/table/weight/bias pointers all hold elements of `dtype`. Shapes:
//   input_ids, position_ids, token_type_ids: [n_tokens] int64 (clamped into their table's rows by the kernels)
//   word: [vocab, hidden], position: [max_positions, hidden], token_type: [type_vocab, hidden]
//   weight, bias: [hidden];  out: [n_tokens, hidden]
struct EmbeddingLayerNormArgs {
  void* out;
  const int64_t* input_ids;
  const int64_t* position_ids;
  const int64_t* token_type_ids;
  const void* word;
  const void* position;
  const void* token_type;
  const void* weight;
  const void* bias;
  int64_t n_tokens;
  int64_t hidden;
  int64_t vocab;
  int64_t max_positions;
  int64_t type_vocab;
  float eps;
  DType dtype;
};

// Clamp an index into [0, rows): out-of-range ids never read outside their table. (rows >= 1 is checked by the
// bindings before any kernel runs.)
#if defined(__CUDACC__)
__host__ __device__
#endif
inline int64_t clamp_row(int64_t id, int64_t rows) {
  return id < 0 ? 0 : (id >= rows ? rows - 1 : id);
}

// float32 and bfloat16 (OpenMP over tokens when built with it). `num_threads` <= 0: OpenMP's default.
void embedding_layer_norm_cpu(const EmbeddingLayerNormArgs& args, int num_threads);

#if defined(FASTBERT_WITH_CUDA)
// float32, float16 and bfloat16, launched on `stream` (a cudaStream_t as an integer) on the current device.
// Throws std::runtime_error with CUDA's error string when the launch fails.
void embedding_layer_norm_cuda(const EmbeddingLayerNormArgs& args, std::uintptr_t stream);

// "" when the CUDA kernel can run on the current device, else CUDA's reason (no kernel image for this GPU,
// driver too old for the runtime fastbert was built with, no device, ...).
const char* embedding_layer_norm_cuda_probe();
#endif

}  // namespace fastbert
