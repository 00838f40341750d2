// CUDA kernel of the fused BERT embedding (float32, float16, bfloat16; see embedding_layer_norm.h for the shapes).
//
// One warp per token row, kWarpsPerBlock rows per block. Per row (H = hidden), statistics in fp32:
//   x    = word[id] + position[pos] + token_type[tt]       pass 1: gather, sum, park x in shared memory
//   mean = sum(x) / H                                       warp shuffle reduction
//   var  = sum((x - mean)^2) / H                            pass 2 over shared memory: no E[x^2] - mean^2 cancellation
//   out  = (x - mean) * rsqrt(var + eps) * weight + bias    pass 3, one rounding to the output dtype
// Global traffic per row: 3 gathered reads + weight/bias (L2-resident) + 1 write, each a 16-byte vector per lane
// when H and every pointer allow it (kVec = 16 / sizeof(T)), else one element per lane.
// Shared memory holds each lane's own elements only ("registers of dynamic size"): no __syncwarp between passes.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "embedding_layer_norm.h"

namespace fastbert {
namespace {

constexpr int kWarpSize = 32;
constexpr int kWarpsPerBlock = 4;
// Above this much dynamic shared memory per block a kernel must opt in (cudaFuncAttributeMaxDynamicSharedMemorySize).
constexpr size_t kDefaultSharedMemoryBytes = 48 * 1024;

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ T from_float(float f);
template <>
__device__ __forceinline__ float from_float<float>(float f) { return f; }
template <>
__device__ __forceinline__ __half from_float<__half>(float f) { return __float2half_rn(f); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float f) { return __float2bfloat16_rn(f); }

// kVec elements moved as one load/store (16 bytes for the vector path).
template <typename T, int kVec>
struct alignas(sizeof(T) * kVec) Packed {
  T v[kVec];
};

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// Floats of shared memory per row: H rounded up to whole warp-wide chunks of kVec elements per lane.
template <int kVec>
__host__ __device__ int cached_row_floats(int hidden) {
  const int chunk = kWarpSize * kVec;
  return (hidden + chunk - 1) / chunk * chunk;
}

// grid: ceil(n_tokens / kWarpsPerBlock) blocks of kWarpsPerBlock warps; dynamic shared memory:
// kWarpsPerBlock * cached_row_floats<kVec>(hidden) floats. Requires hidden % kVec == 0 and 16-byte aligned rows.
template <typename T, int kVec>
__global__ void __launch_bounds__(kWarpsPerBlock * kWarpSize)
    embedding_layer_norm_kernel(T* __restrict__ out,                    // [n_tokens, hidden]
                                const int64_t* __restrict__ input_ids,  // [n_tokens]
                                const int64_t* __restrict__ position_ids,
                                const int64_t* __restrict__ token_type_ids,
                                const T* __restrict__ word,        // [vocab, hidden]
                                const T* __restrict__ position,    // [max_positions, hidden]
                                const T* __restrict__ token_type,  // [type_vocab, hidden]
                                const T* __restrict__ weight,      // [hidden]
                                const T* __restrict__ bias,        // [hidden]
                                int64_t n_tokens, int hidden, int64_t vocab, int64_t max_positions,
                                int64_t type_vocab, float eps) {
  using Pack = Packed<T, kVec>;
  extern __shared__ float cache[];  // [kWarpsPerBlock, cached_row_floats]
  const int warp = threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  const int64_t n = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + warp;
  if (n >= n_tokens) return;  // the whole warp leaves together, so the shuffles below see all 32 lanes

  // Lane-interleaved layout: chunk c, element k of lane l lives at (c * kVec + k) * 32 + l, conflict-free.
  float* x = cache + warp * cached_row_floats<kVec>(hidden) + lane;
  const Pack* w = reinterpret_cast<const Pack*>(word + clamp_row(input_ids[n], vocab) * hidden);
  const Pack* p = reinterpret_cast<const Pack*>(position + clamp_row(position_ids[n], max_positions) * hidden);
  const Pack* t = reinterpret_cast<const Pack*>(token_type + clamp_row(token_type_ids[n], type_vocab) * hidden);
  const int packs = hidden / kVec;

  float sum = 0.f;
  for (int i = lane, c = 0; i < packs; i += kWarpSize, ++c) {
    const Pack a = w[i], b = p[i], d = t[i];
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      const float v = to_float(a.v[k]) + to_float(b.v[k]) + to_float(d.v[k]);
      x[(c * kVec + k) * kWarpSize] = v;
      sum += v;
    }
  }
  const float mean = warp_sum(sum) / hidden;

  float squares = 0.f;
  for (int i = lane, c = 0; i < packs; i += kWarpSize, ++c) {
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      const float d = x[(c * kVec + k) * kWarpSize] - mean;
      squares += d * d;
    }
  }
  const float rstd = rsqrtf(warp_sum(squares) / hidden + eps);

  const Pack* g = reinterpret_cast<const Pack*>(weight);
  const Pack* b = reinterpret_cast<const Pack*>(bias);
  Pack* o = reinterpret_cast<Pack*>(out + n * hidden);
  for (int i = lane, c = 0; i < packs; i += kWarpSize, ++c) {
    const Pack gi = g[i], bi = b[i];
    Pack r;
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      const float normed = (x[(c * kVec + k) * kWarpSize] - mean) * rstd;
      r.v[k] = from_float<T>(normed * to_float(gi.v[k]) + to_float(bi.v[k]));
    }
    o[i] = r;
  }
}

void check_cuda(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string("fastbert embedding_layer_norm: ") + what + ": " + cudaGetErrorString(err));
  }
}

template <typename T, int kVec>
void launch(const EmbeddingLayerNormArgs& a, cudaStream_t stream) {
  const auto kernel = embedding_layer_norm_kernel<T, kVec>;
  const int hidden = static_cast<int>(a.hidden);
  const size_t shared_bytes = sizeof(float) * kWarpsPerBlock * cached_row_floats<kVec>(hidden);
  if (shared_bytes > kDefaultSharedMemoryBytes) {  // hidden > 3072: opt in to more (fails on GPUs without it)
    // Compare with the current device's limit first: cudaFuncSetAttribute takes an int, so an absurd hidden would
    // wrap static_cast<int>(shared_bytes) to a small value it accepts (and the launch's 32-bit size likewise),
    // leaving the kernel to write past its shared memory; and the error below names the sizes, not just "invalid".
    int device = 0, max_bytes = 0;
    check_cuda(cudaGetDevice(&device), "cudaGetDevice");
    check_cuda(cudaDeviceGetAttribute(&max_bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, device),
               "cudaDeviceGetAttribute");
    if (shared_bytes > static_cast<size_t>(max_bytes)) {
      throw std::runtime_error("fastbert embedding_layer_norm: hidden=" + std::to_string(hidden) + " needs " +
                               std::to_string(shared_bytes) + " bytes of shared memory per block, this GPU allows " +
                               std::to_string(max_bytes));
    }
    check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(shared_bytes)),
               "hidden size too large for this GPU's shared memory");
  }
  const int64_t blocks = (a.n_tokens + kWarpsPerBlock - 1) / kWarpsPerBlock;
  kernel<<<static_cast<unsigned>(blocks), kWarpsPerBlock * kWarpSize, shared_bytes, stream>>>(
      static_cast<T*>(a.out), a.input_ids, a.position_ids, a.token_type_ids, static_cast<const T*>(a.word),
      static_cast<const T*>(a.position), static_cast<const T*>(a.token_type), static_cast<const T*>(a.weight),
      static_cast<const T*>(a.bias), a.n_tokens, hidden, a.vocab, a.max_positions, a.type_vocab, a.eps);
  check_cuda(cudaGetLastError(), "kernel launch failed");
}

bool aligned16(const void* ptr) { return reinterpret_cast<std::uintptr_t>(ptr) % 16 == 0; }

// 16-byte vectors when every row starts 16-byte aligned; the scalar kernel otherwise (odd hidden, offset views).
template <typename T>
void dispatch_vector_width(const EmbeddingLayerNormArgs& a, cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  const bool vectorizable = a.hidden % kVec == 0 && aligned16(a.out) && aligned16(a.word) && aligned16(a.position) &&
                            aligned16(a.token_type) && aligned16(a.weight) && aligned16(a.bias);
  if (vectorizable) {
    launch<T, kVec>(a, stream);
  } else {
    launch<T, 1>(a, stream);
  }
}

}  // namespace

void embedding_layer_norm_cuda(const EmbeddingLayerNormArgs& args, std::uintptr_t stream_handle) {
  const auto stream = reinterpret_cast<cudaStream_t>(stream_handle);
  switch (args.dtype) {
    case DType::kFloat32:
      return dispatch_vector_width<float>(args, stream);
    case DType::kFloat16:
      return dispatch_vector_width<__half>(args, stream);
    case DType::kBFloat16:
      return dispatch_vector_width<__nv_bfloat16>(args, stream);
  }
  throw std::invalid_argument("unknown dtype code");
}

const char* embedding_layer_norm_cuda_probe() {
  // Loading the kernel's attributes needs what a launch needs: a driver new enough for this runtime, a device,
  // and a cubin (or PTX to JIT) for it.
  cudaFuncAttributes attributes;
  const cudaError_t err = cudaFuncGetAttributes(&attributes, embedding_layer_norm_kernel<float, 1>);
  cudaGetLastError();  // clear it, so the next launch check reports only that launch
  return err == cudaSuccess ? "" : cudaGetErrorString(err);
}

}  // namespace fastbert
