// A cheap fingerprint of tensors' memory: a few 8-byte words sampled from each, mixed into one 64-bit hash.
//
// fastbert keeps tensors derived from parameters (the stacked QKV weight, oneDNN's packed weights) and must notice
// when a parameter's values change. Most writes move the parameter's version counter; writes through `.data`,
// collectives, and other processes sharing the memory do not. Comparing a fingerprint of sampled words per forward
// catches those (a LoRA merge, a broadcast or an optimizer step changes every element), for ~16 memory reads per
// tensor instead of a pass over the weights.
//
// Sampled positions depend only on the size, so the same tensor is always sampled at the same places: the words at
// 16 positions spread by the golden ratio over the tensor (no stride that could line up with the rows of a weight
// matrix) and its last 8 bytes. Tensors of at most 128 bytes are read whole.
#include "fingerprint.h"

#include <cstring>

namespace fastbert {

namespace {

constexpr int64_t kSamples = 16;
constexpr int64_t kWholeBytes = 128;

// splitmix64's finalizer: every input bit affects every output bit.
inline uint64_t mix(uint64_t h) {
  h ^= h >> 30;
  h *= 0xbf58476d1ce4e5b9ull;
  h ^= h >> 27;
  h *= 0x94d049bb133111ebull;
  return h ^ (h >> 31);
}

inline uint64_t load_word(const unsigned char* p) {
  uint64_t word;
  std::memcpy(&word, p, sizeof(word));  // no alignment assumed
  return word;
}

uint64_t fold(uint64_t h, uint64_t word) { return mix(h ^ word) + 0x9e3779b97f4a7c15ull; }

}  // namespace

uint64_t fingerprint_add(uint64_t h, std::uintptr_t pointer, int64_t nbytes) {
  const auto* data = reinterpret_cast<const unsigned char*>(pointer);
  h = fold(h, static_cast<uint64_t>(nbytes));
  if (nbytes <= 0) return h;
  if (nbytes <= kWholeBytes) {
    int64_t i = 0;
    for (; i + 8 <= nbytes; i += 8) h = fold(h, load_word(data + i));
    for (; i < nbytes; ++i) h = fold(h, data[i]);
    return h;
  }
  const int64_t words = nbytes / 8;
  for (int64_t i = 0; i < kSamples; ++i) {
    // frac(i * phi) spreads the samples evenly without a regular stride
    const double position = static_cast<double>(i) * 0.6180339887498949;
    const int64_t word = static_cast<int64_t>((position - static_cast<int64_t>(position)) * words);
    h = fold(h, load_word(data + 8 * word));
  }
  return fold(h, load_word(data + nbytes - 8));
}

uint64_t fingerprint(const std::vector<std::uintptr_t>& pointers, const std::vector<int64_t>& nbytes) {
  uint64_t h = kFingerprintSeed;
  for (size_t t = 0; t < pointers.size(); ++t) h = fingerprint_add(h, pointers[t], nbytes[t]);
  return h;
}

}  // namespace fastbert
