// A 64-bit hash of a few words sampled from each buffer (see fingerprint.cpp). Torch-free like the rest of _C.
#pragma once

#include <cstdint>
#include <vector>

namespace fastbert {

// pointers[i]: the first byte of a contiguous CPU buffer of nbytes[i] bytes, alive for the call.
uint64_t fingerprint(const std::vector<std::uintptr_t>& pointers, const std::vector<int64_t>& nbytes);

// The same hash one buffer at a time: h = kFingerprintSeed, then h = fingerprint_add(h, pointers[i], nbytes[i]) for
// each (so a caller can read a buffer the moment it has its address).
constexpr uint64_t kFingerprintSeed = 0x6a09e667f3bcc908ull;
uint64_t fingerprint_add(uint64_t h, std::uintptr_t pointer, int64_t nbytes);

}  // namespace fastbert
