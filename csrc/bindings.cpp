// fastbert._C: the torch-free pybind11 module (DESIGN.md section 2).
//
// Python passes tensors as raw pointers (tensor.data_ptr()), their sizes and a dtype code; fastbert/_extension.py
// owns the torch side (checks, contiguity, allocation, the torch.library op). The checks here are the last line
// of defence of a raw-pointer API: sizes that would make a kernel read outside a table raise ValueError.
// build_info() reports what setup.py compiled, from macros it defines (FASTBERT_WITH_CUDA, FASTBERT_CUDA_*).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cmath>
#include <cstdint>
#include <sstream>
#include <stdexcept>
#include <string>
#include <memory>
#include <vector>

#include "attention_cpu.h"
#include "attention_int8_cpu.h"
#include "embedding_layer_norm.h"
#include "fingerprint.h"
#include "gemm_cpu.h"
#include "gemm_int8_cpu.h"
#include "layer_norm_cpu.h"
#include "module_tree.h"
#include "parameter_state.h"
#include "quantize_cpu.h"
#include "token_indices.h"

namespace py = pybind11;

namespace {

using fastbert::DType;
using fastbert::EmbeddingLayerNormArgs;

EmbeddingLayerNormArgs make_args(std::uintptr_t out, std::uintptr_t input_ids, std::uintptr_t position_ids,
                                 std::uintptr_t token_type_ids, std::uintptr_t word, std::uintptr_t position,
                                 std::uintptr_t token_type, std::uintptr_t weight, std::uintptr_t bias,
                                 int64_t n_tokens, int64_t hidden, int64_t vocab, int64_t max_positions,
                                 int64_t type_vocab, double eps, int dtype) {
  if (n_tokens < 0 || hidden < 0) throw std::invalid_argument("n_tokens and hidden must be >= 0");
  if (hidden > INT32_MAX) throw std::invalid_argument("hidden must fit in 32 bits");
  if (vocab < 1 || max_positions < 1 || type_vocab < 1) {
    throw std::invalid_argument("every embedding table needs at least one row (indices are clamped into it)");
  }
  if (dtype < 0 || dtype > 2) throw std::invalid_argument("dtype code must be 0 (float32), 1 (float16) or 2 (bfloat16)");
  const bool has_work = n_tokens > 0 && hidden > 0;
  if (has_work && !(out && input_ids && position_ids && token_type_ids && word && position && token_type && weight && bias)) {
    throw std::invalid_argument("null data pointer");
  }
  return {reinterpret_cast<void*>(out),
          reinterpret_cast<const int64_t*>(input_ids),
          reinterpret_cast<const int64_t*>(position_ids),
          reinterpret_cast<const int64_t*>(token_type_ids),
          reinterpret_cast<const void*>(word),
          reinterpret_cast<const void*>(position),
          reinterpret_cast<const void*>(token_type),
          reinterpret_cast<const void*>(weight),
          reinterpret_cast<const void*>(bias),
          n_tokens,
          hidden,
          vocab,
          max_positions,
          type_vocab,
          static_cast<float>(eps),
          static_cast<DType>(dtype)};
}

void embedding_layer_norm_cpu(std::uintptr_t out, std::uintptr_t input_ids, std::uintptr_t position_ids,
                              std::uintptr_t token_type_ids, std::uintptr_t word, std::uintptr_t position,
                              std::uintptr_t token_type, std::uintptr_t weight, std::uintptr_t bias, int64_t n_tokens,
                              int64_t hidden, int64_t vocab, int64_t max_positions, int64_t type_vocab, double eps,
                              int dtype, int num_threads) {
  const EmbeddingLayerNormArgs args = make_args(out, input_ids, position_ids, token_type_ids, word, position,
                                                token_type, weight, bias, n_tokens, hidden, vocab, max_positions,
                                                type_vocab, eps, dtype);
  if (n_tokens == 0 || hidden == 0) return;
  fastbert::embedding_layer_norm_cpu(args, num_threads);
}

void embedding_layer_norm_cuda(std::uintptr_t out, std::uintptr_t input_ids, std::uintptr_t position_ids,
                               std::uintptr_t token_type_ids, std::uintptr_t word, std::uintptr_t position,
                               std::uintptr_t token_type, std::uintptr_t weight, std::uintptr_t bias, int64_t n_tokens,
                               int64_t hidden, int64_t vocab, int64_t max_positions, int64_t type_vocab, double eps,
                               int dtype, std::uintptr_t stream) {
  const EmbeddingLayerNormArgs args = make_args(out, input_ids, position_ids, token_type_ids, word, position,
                                                token_type, weight, bias, n_tokens, hidden, vocab, max_positions,
                                                type_vocab, eps, dtype);
#if defined(FASTBERT_WITH_CUDA)
  if (n_tokens == 0 || hidden == 0) return;
  fastbert::embedding_layer_norm_cuda(args, stream);
#else
  (void)args;
  (void)stream;
  throw std::runtime_error(std::string("fastbert._C was built without CUDA: ") + FASTBERT_CUDA_SKIP_REASON);
#endif
}

void attention_cpu(std::uintptr_t out, std::uintptr_t qkv, const std::vector<int64_t>& seqlens, int64_t heads,
                   int64_t head_dim, std::uintptr_t relative_bias, int64_t radius, int64_t window,
                   std::uintptr_t columns, double scale, int num_threads, const std::string& isa,
                   std::uintptr_t pos_key, std::uintptr_t pos_query, int64_t rel_rows, std::uintptr_t rel_index,
                   int64_t rel_center, bool bf16) {
  if (heads < 1 || head_dim < 1) throw std::invalid_argument("heads and head_dim must be >= 1");
  if (radius < 0) throw std::invalid_argument("radius must be >= 0");
  if ((pos_key || pos_query) && (!rel_index || rel_rows < 1 || rel_center < 0)) {
    throw std::invalid_argument("pos_key and pos_query need rel_index, rel_rows >= 1 and rel_center >= 0");
  }
  int64_t tokens = 0;
  for (int64_t length : seqlens) {
    if (length < 0) throw std::invalid_argument("seqlens must be >= 0");
    tokens += length;
  }
  if (tokens == 0) return;
  if (!out || !qkv) throw std::invalid_argument("null data pointer");
  const fastbert::AttentionCpuArgs args{reinterpret_cast<void*>(out), reinterpret_cast<const void*>(qkv), bf16,
                                        seqlens.data(), static_cast<int64_t>(seqlens.size()), heads, head_dim,
                                        reinterpret_cast<const float*>(relative_bias), radius, window,
                                        reinterpret_cast<const int32_t*>(columns), static_cast<float>(scale),
                                        reinterpret_cast<const float*>(pos_key), reinterpret_cast<const float*>(pos_query),
                                        rel_rows, reinterpret_cast<const int32_t*>(rel_index), rel_center};
  fastbert::attention_cpu(args, num_threads, isa);
}

void attention_int8_cpu(std::uintptr_t out, std::uintptr_t qkv, const std::vector<int64_t>& seqlens, int64_t heads,
                        int64_t head_dim, double scale, int num_threads, std::uintptr_t q, std::uintptr_t smooth,
                        double q_scale, int64_t q_zero_point) {
  if (heads < 1 || head_dim < 1) throw std::invalid_argument("heads and head_dim must be >= 1");
  // (int32 sums: 255 * 127 per key of p v, 255 * 127 per dim of q k^T)
  if (head_dim > 1024) throw std::invalid_argument("head_dim must be <= 1024");
  int64_t tokens = 0;
  for (int64_t length : seqlens) {
    if (length < 0 || length > 65536) throw std::invalid_argument("seqlens must be in [0, 65536]");
    tokens += length;
  }
  if (q && (!(q_scale > 0.0) || !std::isfinite(q_scale) || q_zero_point < 0 || q_zero_point > 255)) {
    throw std::invalid_argument("q_scale must be finite and > 0, q_zero_point in [0, 255]");
  }
  if (tokens == 0) return;
  if (!out || !qkv) throw std::invalid_argument("null data pointer");
  fastbert::attention_int8_cpu({reinterpret_cast<float*>(out), reinterpret_cast<const float*>(qkv), seqlens.data(),
                                static_cast<int64_t>(seqlens.size()), heads, head_dim, static_cast<float>(scale),
                                reinterpret_cast<uint8_t*>(q), reinterpret_cast<const float*>(smooth), q_scale,
                                q_zero_point},
                               num_threads);
}

fastbert::QuantizeCpuArgs quantize_args(std::uintptr_t x, std::uintptr_t out, int64_t rows, int64_t cols,
                                         std::uintptr_t smooth, std::uintptr_t real_index, int64_t real_rows) {
  if (rows < 0 || cols < 0) throw std::invalid_argument("rows and cols must be >= 0");
  if (rows * cols > 0 && (!x || !out)) throw std::invalid_argument("null data pointer");
  return {reinterpret_cast<const float*>(x), reinterpret_cast<uint8_t*>(out), rows, cols,
          reinterpret_cast<const float*>(smooth), reinterpret_cast<const int64_t*>(real_index), real_rows};
}

// isa "" (the fastest the CPU runs) or "avx2" (the AVX2 rows where AVX-512 runs too): the quantizer's and the
// LayerNorm's tests check both on one machine.
bool avx2_rows(const std::string& isa) {
  if (!isa.empty() && isa != "avx2") throw std::invalid_argument("isa must be '' (the fastest) or 'avx2'");
  return isa == "avx2";
}

std::pair<double, int64_t> quantize_per_call_cpu(std::uintptr_t x, std::uintptr_t out, int64_t rows, int64_t cols,
                                                 std::uintptr_t smooth, std::uintptr_t real_index, int64_t real_rows,
                                                 int num_threads, const std::string& isa) {
  const bool avx2 = avx2_rows(isa);
  double scale = 1.0;
  int64_t zero_point = 0;
  fastbert::quantize_per_call_cpu(quantize_args(x, out, rows, cols, smooth, real_index, real_rows), &scale,
                                  &zero_point, num_threads, avx2);
  return {scale, zero_point};
}

void quantize_static_cpu(std::uintptr_t x, std::uintptr_t out, int64_t rows, int64_t cols, std::uintptr_t smooth,
                         double scale, int64_t zero_point, int num_threads, const std::string& isa) {
  const bool avx2 = avx2_rows(isa);
  fastbert::quantize_static_cpu(quantize_args(x, out, rows, cols, smooth, 0, 0), scale, zero_point, num_threads,
                                avx2);
}

void quantize_per_token_cpu(std::uintptr_t x, std::uintptr_t out, int64_t rows, int64_t cols, std::uintptr_t smooth,
                            std::uintptr_t scales, int num_threads, const std::string& isa) {
  const bool avx2 = avx2_rows(isa);
  if (rows > 0 && !scales) throw std::invalid_argument("null scales pointer");
  fastbert::quantize_per_token_cpu(quantize_args(x, out, rows, cols, smooth, 0, rows),
                                   reinterpret_cast<float*>(scales), num_threads, avx2);
}

void gemm_cpu(std::uintptr_t x, int64_t x_stride, std::uintptr_t packed, std::uintptr_t bias, std::uintptr_t residual,
              std::uintptr_t y, int64_t rows, int64_t in, int64_t out, int num_threads, bool gelu) {
  if (rows < 0 || in < 0 || out < 0 || x_stride < in) throw std::invalid_argument("rows, in, out >= 0, x_stride >= in");
  if (gelu && residual) throw std::invalid_argument("gelu with a residual");
  if (rows * out == 0) return;
  if (!y || (in > 0 && (!x || !packed))) throw std::invalid_argument("null data pointer");
  fastbert::gemm_cpu({reinterpret_cast<const float*>(x), x_stride, reinterpret_cast<const float*>(packed),
                      reinterpret_cast<const float*>(bias), reinterpret_cast<const float*>(residual),
                      reinterpret_cast<float*>(y), rows, in, out, gelu},
                     num_threads);
}

// The int8 GEMM's arguments after the checks every caller shares (x is set by the caller).
fastbert::GemmInt8CpuArgs int8_gemm_args(std::uintptr_t packed, std::uintptr_t column_sums, std::uintptr_t scales,
                                         std::uintptr_t bias, std::uintptr_t residual, std::uintptr_t y,
                                         std::uintptr_t y_u8, double y_scale, int64_t y_zero_point, int64_t rows,
                                         int64_t in, int64_t out, bool gelu) {
  if (rows < 0 || in < 0 || out < 0) throw std::invalid_argument("rows, in, out must be >= 0");
  if (gelu && residual) throw std::invalid_argument("gelu with a residual");
  if (y_u8 && (!(y_scale > 0 && y_scale < INFINITY) || y_zero_point < 0 || y_zero_point > 255))
    throw std::invalid_argument("y_scale finite and > 0, y_zero_point in [0, 255]");
  if (in > fastbert::kGemmInt8MaxIn) throw std::invalid_argument("in must be at most 133,676 (int32 sums)");
  if (rows * out > 0 && ((!y && !y_u8) || (y && y_u8) || (in > 0 && !packed) || !column_sums || !scales))
    throw std::invalid_argument("null data pointer, or both y and y_u8");
  fastbert::GemmInt8CpuArgs a{};
  a.packed = reinterpret_cast<const int8_t*>(packed);
  a.column_sums = reinterpret_cast<const int32_t*>(column_sums);
  a.scales = reinterpret_cast<const float*>(scales);
  a.bias = reinterpret_cast<const float*>(bias);
  a.residual = reinterpret_cast<const float*>(residual);
  a.y = reinterpret_cast<float*>(y);
  a.y_u8 = reinterpret_cast<uint8_t*>(y_u8);
  a.y_inverse_scale = static_cast<float>(1.0 / y_scale);  // (quantize_static_row's rounding of it)
  a.y_zero_point = static_cast<int32_t>(y_zero_point);
  a.rows = rows, a.in = in, a.out = out, a.gelu = gelu;
  return a;
}

void gemm_int8_cpu(std::uintptr_t x, int64_t x_stride, std::uintptr_t packed, std::uintptr_t column_sums,
                   std::uintptr_t scales, double x_scale, int64_t x_zero_point, std::uintptr_t bias,
                   std::uintptr_t residual, std::uintptr_t y, std::uintptr_t y_u8, double y_scale,
                   int64_t y_zero_point, int64_t rows, int64_t in, int64_t out, int num_threads, bool gelu) {
  fastbert::GemmInt8CpuArgs a = int8_gemm_args(packed, column_sums, scales, bias, residual, y, y_u8, y_scale,
                                               y_zero_point, rows, in, out, gelu);
  if (x_stride < in) throw std::invalid_argument("x_stride must be >= in");
  if (!(x_scale > 0 && x_scale < INFINITY) || x_zero_point < 0 || x_zero_point > 255)
    throw std::invalid_argument("x_scale finite and > 0, x_zero_point in [0, 255]");
  if (rows * out == 0) return;
  if (in > 0 && !x) throw std::invalid_argument("null data pointer");
  a.x = reinterpret_cast<const uint8_t*>(x), a.x_stride = x_stride;
  a.x_scale = static_cast<float>(x_scale), a.x_zero_point = static_cast<int32_t>(x_zero_point);
  fastbert::gemm_int8_cpu(a, num_threads);
}

// Float32 x (contiguous) quantized per call (quantize_per_call_cpu, the range of its real rows) or, per_token, per
// row (quantize_per_token_cpu), then gemm_int8_cpu of those bytes, in one call: the u8 (and the row scales) go to
// this thread's scratch memory, kept up to kScratchBytes (a fresh allocation pays its page faults on every call).
// Returns the per-call scale and zero point (per token: 1 and 128, the scales being the rows').
std::pair<double, int64_t> gemm_int8_quantizing_cpu(
    std::uintptr_t x, std::uintptr_t smooth, std::uintptr_t real_index, int64_t real_rows, bool per_token,
    std::uintptr_t packed, std::uintptr_t column_sums, std::uintptr_t scales, std::uintptr_t bias,
    std::uintptr_t residual, std::uintptr_t y, std::uintptr_t y_u8, double y_scale, int64_t y_zero_point,
    int64_t rows, int64_t in, int64_t out, int num_threads, bool gelu) {
  constexpr size_t kScratchBytes = size_t{64} << 20;
  thread_local std::vector<uint8_t> scratch;
  thread_local std::vector<float> row_scales;
  fastbert::GemmInt8CpuArgs a = int8_gemm_args(packed, column_sums, scales, bias, residual, y, y_u8, y_scale,
                                               y_zero_point, rows, in, out, gelu);
  const size_t bytes = static_cast<size_t>(rows) * static_cast<size_t>(in);
  std::unique_ptr<uint8_t[]> large;  // (past the scratch's size: uninitialized, freed on return)
  if (bytes <= kScratchBytes && scratch.size() < bytes) scratch.resize(bytes);
  uint8_t* q = bytes <= kScratchBytes ? scratch.data() : (large.reset(new uint8_t[bytes]), large.get());
  double scale = 1.0;
  int64_t zero_point = 128;
  const auto q_args = quantize_args(x, reinterpret_cast<std::uintptr_t>(q), rows, in, smooth,
                                    per_token ? 0 : real_index, per_token ? rows : real_rows);
  if (per_token) {
    if (row_scales.size() < static_cast<size_t>(rows)) row_scales.resize(rows);
    fastbert::quantize_per_token_cpu(q_args, row_scales.data(), num_threads);
    a.x_row_scales = row_scales.data();
  } else {
    fastbert::quantize_per_call_cpu(q_args, &scale, &zero_point, num_threads);
  }
  if (rows * out == 0) return {scale, zero_point};
  a.x = q, a.x_stride = in;
  a.x_scale = static_cast<float>(scale), a.x_zero_point = static_cast<int32_t>(zero_point);
  fastbert::gemm_int8_cpu(a, num_threads);
  return {scale, zero_point};
}

void layer_norm_cpu(std::uintptr_t x, std::uintptr_t y, std::uintptr_t weight, std::uintptr_t bias, int64_t rows,
                    int64_t cols, double eps, std::uintptr_t q, std::uintptr_t smooth, double scale,
                    int64_t zero_point, int num_threads, const std::string& isa) {
  const bool avx2 = avx2_rows(isa);
  if (rows < 0 || cols < 0) throw std::invalid_argument("rows and cols must be >= 0");
  if (rows * cols > 0 && (!x || !y)) throw std::invalid_argument("null data pointer");
  if (q && (!(scale > 0.0) || !std::isfinite(scale) || zero_point < 0 || zero_point > 255)) {
    throw std::invalid_argument("scale must be finite and > 0, zero_point in [0, 255]");
  }
  if (rows * cols == 0) return;
  fastbert::layer_norm_cpu({reinterpret_cast<const float*>(x), reinterpret_cast<float*>(y),
                            reinterpret_cast<const float*>(weight), reinterpret_cast<const float*>(bias), rows, cols,
                            static_cast<float>(eps), reinterpret_cast<uint8_t*>(q),
                            reinterpret_cast<const float*>(smooth), scale, zero_point},
                           num_threads, avx2);
}

fastbert::IntInput int_input(std::uintptr_t data, int code, const char* name) {
  if (code < 0 || code > 2) {
    throw std::invalid_argument(std::string(name) + ": dtype code must be 0 (int64), 1 (int32) or 2 (one byte)");
  }
  return {reinterpret_cast<const void*>(data), code};
}

py::tuple count_real_tokens(std::uintptr_t mask, int mask_code, int64_t batch, int64_t seq_len,
                            std::uintptr_t seqlens) {
  if (batch < 0 || seq_len < 0 || seq_len > INT32_MAX) {
    throw std::invalid_argument("batch must be >= 0 and seq_len in [0, 2^31)");
  }
  if (batch * seq_len > 0 && (!mask || !seqlens)) throw std::invalid_argument("null data pointer");
  const auto counted = fastbert::count_real_tokens(int_input(mask, mask_code, "mask"), batch, seq_len,
                                                   reinterpret_cast<int32_t*>(seqlens));
  return py::make_tuple(counted.first, counted.second);
}

std::vector<int64_t> token_indices(std::uintptr_t ids, int ids_code, std::uintptr_t types, int types_code,
                                   std::uintptr_t positions, int positions_code, int64_t positions_rows,
                                   std::uintptr_t mask, int mask_code, const std::vector<int64_t>& seqlens,
                                   int64_t batch,
                                   int64_t seq_len, int numbering, int64_t base, int64_t tokens, std::uintptr_t out,
                                   int64_t rows, std::uintptr_t layout_indices, std::uintptr_t cu_seqlens) {
  if (batch < 0 || seq_len < 0 || tokens < 0 || tokens > INT32_MAX || rows < tokens) {
    throw std::invalid_argument("batch, seq_len and tokens must be >= 0 (tokens < 2^31) and rows >= tokens");
  }
  if (numbering < 0 || numbering > 1) throw std::invalid_argument("numbering must be 0 (column) or 1 (rank)");
  if (rows > 0 && !out) throw std::invalid_argument("null data pointer");
  const int64_t* lengths = seqlens.empty() ? nullptr : seqlens.data();
  if (lengths) {
    if (static_cast<int64_t>(seqlens.size()) != batch) throw std::invalid_argument("seqlens must have batch entries");
    if (mask || positions) throw std::invalid_argument("back-to-back sequences take no mask and no positions");
    int64_t total = 0;
    for (int64_t b = 0; b < batch; ++b) {
      if (lengths[b] < 0 || lengths[b] > seq_len) throw std::invalid_argument("seqlens must lie in [0, seq_len]");
      total += lengths[b];
    }
    if (total != tokens) throw std::invalid_argument("seqlens must add up to tokens");
  } else if (!mask && tokens != batch * seq_len) {
    throw std::invalid_argument("without a mask every one of the batch * seq_len tokens is real");
  }
  if (positions && positions_rows != 1 && positions_rows != batch) {
    throw std::invalid_argument("positions must have 1 or batch rows");
  }
  const int64_t read = lengths ? tokens : batch * seq_len;
  if (read > 0 && !ids) throw std::invalid_argument("null data pointer");
  fastbert::TokenIndicesArgs args{int_input(ids, ids_code, "ids"), int_input(types, types_code, "types"),
                                  int_input(positions, positions_code, "positions"),
                                  int_input(mask, mask_code, "mask"), lengths, batch, seq_len, positions_rows,
                                  numbering, base, tokens, reinterpret_cast<int64_t*>(out), rows,
                                  reinterpret_cast<int64_t*>(layout_indices), reinterpret_cast<int32_t*>(cu_seqlens)};
  return fastbert::token_indices(args);
}

// "" when the CUDA kernel can run on the current device, else why not.
std::string cuda_probe() {
#if defined(FASTBERT_WITH_CUDA)
  return fastbert::embedding_layer_norm_cuda_probe();
#else
  return std::string("fastbert._C was built without CUDA: ") + FASTBERT_CUDA_SKIP_REASON;
#endif
}

uint64_t fingerprint(const std::vector<std::uintptr_t>& pointers, const std::vector<int64_t>& nbytes) {
  if (pointers.size() != nbytes.size()) throw std::invalid_argument("pointers and nbytes must have the same length");
  for (size_t i = 0; i < pointers.size(); ++i) {
    if (nbytes[i] < 0) throw std::invalid_argument("nbytes must be >= 0");
    if (nbytes[i] > 0 && pointers[i] == 0) throw std::invalid_argument("null data pointer");
  }
  return fastbert::fingerprint(pointers, nbytes);
}

std::vector<std::string> split_words(const std::string& text) {
  std::istringstream stream(text);
  std::vector<std::string> words;
  for (std::string word; stream >> word;) words.push_back(word);
  return words;
}

py::dict build_info() {
  py::dict info;
  info["cpu"] = true;
#if defined(_OPENMP)
  info["openmp"] = true;
#else
  info["openmp"] = false;
#endif
#if defined(FASTBERT_WITH_CUDA)
  info["cuda"] = true;
  info["cuda_version"] = FASTBERT_CUDA_VERSION;
  info["archs"] = split_words(FASTBERT_CUDA_ARCHS);
  const std::string ptx = FASTBERT_CUDA_PTX;
  info["ptx"] = ptx.empty() ? py::none() : py::object(py::str(ptx));
  info["cuda_skip_reason"] = py::none();
#else
  info["cuda"] = false;
  info["cuda_version"] = py::none();
  info["archs"] = py::list();
  info["ptx"] = py::none();
  info["cuda_skip_reason"] = FASTBERT_CUDA_SKIP_REASON;
#endif
  return info;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "fastbert's torch-free kernels: raw pointers, sizes, a dtype code (0 float32, 1 float16, 2 bfloat16)";

  m.def("embedding_layer_norm_cpu", &embedding_layer_norm_cpu,
        "out[n] = LayerNorm(word[ids[n]] + position[pos[n]] + token_type[tt[n]]) * weight + bias on the CPU "
        "(float32/bfloat16; indices clamped into their tables; num_threads <= 0: OpenMP's default).",
        py::arg("out"), py::arg("input_ids"), py::arg("position_ids"), py::arg("token_type_ids"), py::arg("word"),
        py::arg("position"), py::arg("token_type"), py::arg("weight"), py::arg("bias"), py::arg("n_tokens"),
        py::arg("hidden"), py::arg("vocab"), py::arg("max_positions"), py::arg("type_vocab"), py::arg("eps"),
        py::arg("dtype"), py::arg("num_threads"), py::call_guard<py::gil_scoped_release>());

  m.def("embedding_layer_norm_cuda", &embedding_layer_norm_cuda,
        "Same as embedding_layer_norm_cpu on the current CUDA device (float32/float16/bfloat16), launched on "
        "`stream` (a cudaStream_t as an int). Raises RuntimeError with CUDA's message if the launch fails.",
        py::arg("out"), py::arg("input_ids"), py::arg("position_ids"), py::arg("token_type_ids"), py::arg("word"),
        py::arg("position"), py::arg("token_type"), py::arg("weight"), py::arg("bias"), py::arg("n_tokens"),
        py::arg("hidden"), py::arg("vocab"), py::arg("max_positions"), py::arg("type_vocab"), py::arg("eps"),
        py::arg("dtype"), py::arg("stream"), py::call_guard<py::gil_scoped_release>());

  m.def("attention_cpu", &attention_cpu,
        "Padding-free attention on the CPU (attention_cpu.h): out [T, H, D] from qkv [T, 3, H, D] (float32, or "
        "bfloat16 where bf16 is true: float32 inside), each "
        "of the len(seqlens) sequences attending to its own rows, plus relative_bias [H, 2 radius + 1] by distance "
        "when not 0, keys within `window` only when >= 0, distances between int32 `columns` [T] when not 0. Raises "
        "RuntimeError on a CPU without AVX2 and FMA; isa: one of attention_cpu_isas(), '' for the fastest. "
        "DeBERTa's position terms when pos_key or pos_query [rel_rows, H, D] is not 0, their rows picked by the "
        "int32 rel_index [2 rel_center + 1] of column distances.",
        py::arg("out"), py::arg("qkv"), py::arg("seqlens"), py::arg("heads"), py::arg("head_dim"),
        py::arg("relative_bias"), py::arg("radius"), py::arg("window"), py::arg("columns"), py::arg("scale"),
        py::arg("num_threads"), py::arg("isa") = "", py::arg("pos_key") = 0, py::arg("pos_query") = 0, py::arg("rel_rows") = 0,
        py::arg("rel_index") = 0, py::arg("rel_center") = 0, py::arg("bf16") = false,
        py::call_guard<py::gil_scoped_release>());

  m.def("attention_int8_cpu", &attention_int8_cpu,
        "attention_cpu without position terms, its two matmuls in int8 (attention_int8_cpu.h): k and v with one "
        "scale per sequence and head, q one per row, softmax's numerators as u8; when q is not 0, also u8 q [T, H, D] "
        "of out (divided by smooth [H D] when not 0) with q_scale and q_zero_point, quantize_static_cpu's bytes. "
        "Raises RuntimeError where attention_int8_cpu_available() is false.",
        py::arg("out"), py::arg("qkv"), py::arg("seqlens"), py::arg("heads"), py::arg("head_dim"), py::arg("scale"),
        py::arg("num_threads"), py::arg("q") = 0, py::arg("smooth") = 0, py::arg("q_scale") = 1.0,
        py::arg("q_zero_point") = 0, py::call_guard<py::gil_scoped_release>());

  m.def("quantize_per_call_cpu", &quantize_per_call_cpu,
        "u8 [rows, cols] at out from float32 x (divided by smooth [cols] when not 0), one scale and zero point from "
        "the range of the real rows (real_index [real_rows] int64 when not 0, else the first real_rows): returns "
        "(scale, zero_point) (quantize_cpu.h). isa 'avx2': the AVX2 rows where AVX-512 runs too.",
        py::arg("x"), py::arg("out"), py::arg("rows"), py::arg("cols"), py::arg("smooth"), py::arg("real_index"),
        py::arg("real_rows"), py::arg("num_threads"), py::arg("isa") = "", py::call_guard<py::gil_scoped_release>());

  m.def("quantize_static_cpu", &quantize_static_cpu,
        "u8 [rows, cols] at out from float32 x (divided by smooth [cols] when not 0) with the given scale and zero "
        "point (quantize_cpu.h). isa 'avx2': the AVX2 rows where AVX-512 runs too.",
        py::arg("x"), py::arg("out"), py::arg("rows"), py::arg("cols"), py::arg("smooth"), py::arg("scale"),
        py::arg("zero_point"), py::arg("num_threads"), py::arg("isa") = "", py::call_guard<py::gil_scoped_release>());

  m.def("quantize_per_token_cpu", &quantize_per_token_cpu,
        "u8 [rows, cols] at out from float32 x (divided by smooth [cols] when not 0), each row with its own "
        "symmetric scale, written to scales [rows] float32 (quantize_cpu.h). isa 'avx2': the AVX2 rows where "
        "AVX-512 runs too.",
        py::arg("x"), py::arg("out"), py::arg("rows"), py::arg("cols"), py::arg("smooth"), py::arg("scales"),
        py::arg("num_threads"), py::arg("isa") = "", py::call_guard<py::gil_scoped_release>());

  m.def("layer_norm_cpu", &layer_norm_cpu,
        "y [rows, cols] = LayerNorm of float32 x's rows * weight + bias (either 0: none), and, when q is not 0, "
        "u8 q [rows, cols] of y (divided by smooth [cols] when not 0) with the given scale and zero point, the same "
        "bytes as quantize_static_cpu of y (layer_norm_cpu.h). isa 'avx2': the AVX2 rows where AVX-512 runs too.",
        py::arg("x"), py::arg("y"), py::arg("weight"), py::arg("bias"), py::arg("rows"), py::arg("cols"),
        py::arg("eps"), py::arg("q"), py::arg("smooth"), py::arg("scale"), py::arg("zero_point"),
        py::arg("num_threads"), py::arg("isa") = "", py::call_guard<py::gil_scoped_release>());

  m.def("gemm_int8_cpu", &gemm_int8_cpu,
        "y [rows, out] = (u8 x [rows, in] (row stride x_stride) - x_zero_point) @ W^T * (x_scale * scales) + bias "
        "(+ residual; either 0: none), W 7-bit s8 prepacked as [ceil(out / 16), ceil(in / 4), 16, 4] with its "
        "column_sums (gemm_int8_cpu.h); gelu: GELU (erf form) after the bias; into float32 y or, quantized with "
        "y_scale and y_zero_point, u8 y_u8 (the other 0). RuntimeError on a CPU without AVX2 and FMA.",
        py::arg("x"), py::arg("x_stride"), py::arg("packed"), py::arg("column_sums"), py::arg("scales"),
        py::arg("x_scale"), py::arg("x_zero_point"), py::arg("bias"), py::arg("residual"), py::arg("y"),
        py::arg("y_u8"), py::arg("y_scale"), py::arg("y_zero_point"), py::arg("rows"), py::arg("in"), py::arg("out"),
        py::arg("num_threads"), py::arg("gelu") = false, py::call_guard<py::gil_scoped_release>());
  m.def("gemm_int8_quantizing_cpu", &gemm_int8_quantizing_cpu,
        "float32 x [rows, in] (contiguous) quantized per call (quantize_per_call_cpu: smooth, real_index, real_rows as "
        "there) or per_token (quantize_per_token_cpu), then gemm_int8_cpu of its bytes (per token: each row's result "
        "times its scale, before the bias); returns the per-call scale and zero point (per token: 1.0, 128).",
        py::arg("x"), py::arg("smooth"), py::arg("real_index"), py::arg("real_rows"), py::arg("per_token"),
        py::arg("packed"), py::arg("column_sums"), py::arg("scales"), py::arg("bias"), py::arg("residual"),
        py::arg("y"), py::arg("y_u8"), py::arg("y_scale"), py::arg("y_zero_point"), py::arg("rows"), py::arg("in"),
        py::arg("out"), py::arg("num_threads"), py::arg("gelu") = false, py::call_guard<py::gil_scoped_release>());
  m.def("gemm_int8_cpu_available", &fastbert::gemm_int8_cpu_available,
        "Whether this CPU runs gemm_int8_cpu (x86-64 with AVX2 and FMA).");

  m.def("gemm_cpu", &gemm_cpu,
        "y [rows, out] = float32 x [rows, in] (row stride x_stride) @ W^T + bias (+ residual [rows, out]; either 0: "
        "none), W prepacked as [ceil(out / 16), in, 16] panels (gemm_cpu.h); gelu: GELU (erf form) after the bias, "
        "no residual. RuntimeError on a CPU without AVX2 and FMA.",
        py::arg("x"), py::arg("x_stride"), py::arg("packed"), py::arg("bias"), py::arg("residual"), py::arg("y"),
        py::arg("rows"), py::arg("in"), py::arg("out"), py::arg("num_threads"), py::arg("gelu") = false,
        py::call_guard<py::gil_scoped_release>());

  m.def("gemm_cpu_available", &fastbert::gemm_cpu_available,
        "Whether this CPU runs the float32 GEMM of gemm_cpu (x86-64 with AVX2 and FMA).");

  m.def("quantize_cpu_available", &fastbert::quantize_cpu_available,
        "Whether this CPU runs the int8 activation quantizer (x86-64 with AVX2 and FMA).");

  m.def("attention_cpu_isas", &fastbert::attention_cpu_isas,
        "The instruction sets the CPU attention can run with here, fastest first ('avx512', 'avx2'); [] for none.");

  m.def("attention_int8_cpu_available", &fastbert::attention_int8_cpu_available,
        "Whether this CPU runs the int8 attention (x86-64 with AVX-512 F/BW/DQ/VL and VNNI).");

  m.def("fingerprint", &fingerprint,
        "A 64-bit hash of ~16 words sampled from each contiguous CPU buffer (pointers[i], nbytes[i] bytes; buffers "
        "of at most 128 bytes are read whole). Same positions for the same sizes: equal memory, equal hash.",
        py::arg("pointers"), py::arg("nbytes"));

  m.def("module_tree", &fastbert::module_tree,
        "A torch module tree's key, one entry per module (fastbert/plan.py's structure_ref, built natively).",
        py::arg("model"));

  m.def("module_tree_matches", &fastbert::module_tree_matches,
        "module_tree(model) == key for a key module_tree returned, building no tuple where the tree holds the key's "
        "very modules without hooks.",
        py::arg("model"), py::arg("key"));

  m.def("parameter_state", &fastbert::parameter_state,
        "(versions, layout, fingerprint) of the tensors in params (fastbert/derived.py's state_ref, less its epoch), "
        "or None where a CPU tensor is not contiguous.",
        py::arg("params"));

  m.def("count_real_tokens", &count_real_tokens,
        "mask [batch, seq_len] (dtype code 0 int64, 1 int32, 2 one byte) -> (real tokens, whether every row's column 0 "
        "is real); seqlens [batch] int32 written with each row's count.",
        py::arg("mask"), py::arg("mask_code"), py::arg("batch"), py::arg("seq_len"), py::arg("seqlens"));

  m.def("token_indices", &token_indices,
        "A batch's [3, rows] int64 embedding indices (word, token type, position of each real token, then zeros), "
        "each real token's place b * seq_len + column (layout_indices [tokens], or 0) and cu_seqlens [batch + 1] "
        "int32 (or 0), from ids and types [batch, seq_len] with positions [positions_rows, seq_len] and a mask (each "
        "0 where not given), or, with seqlens (batch lengths; [] for none), from ids and types [tokens] back to "
        "back. Positions not given are numbered by column (numbering 0) or as base + rank among ids other than "
        "base (1). Returns the min and max of ids, types and positions over every entry read (token_indices.h).",
        py::arg("ids"), py::arg("ids_code"), py::arg("types"), py::arg("types_code"), py::arg("positions"),
        py::arg("positions_code"), py::arg("positions_rows"), py::arg("mask"), py::arg("mask_code"),
        py::arg("seqlens"), py::arg("batch"), py::arg("seq_len"), py::arg("numbering"), py::arg("base"),
        py::arg("tokens"), py::arg("out"), py::arg("rows"), py::arg("layout_indices"), py::arg("cu_seqlens"));

  m.def("cuda_probe", &cuda_probe,
        "'' when the CUDA kernel can run on the current device, else why not (no kernel image for this GPU, "
        "driver older than the CUDA runtime fastbert was built with, no device, or built without CUDA).");

  m.def("build_info", &build_info,
        "What this build contains: cpu, openmp, cuda, cuda_version, archs (SASS), ptx, cuda_skip_reason.");
}
