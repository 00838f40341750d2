// A 64-bit hash of a few words sampled from each buffer (see fingerprint.cpp). Torch-free like the rest of _C.
#pragma once

#include <cstdint>
#include <vector>

namespace fastbert {

// pointers[i]: the first byte of a contiguous CPU buffer of nbytes[i] bytes, alive for the call.
uint64_t fingerprint(const std::vector<std::uintptr_t>& pointers, const std::vector<int64_t>& nbytes);

}  // namespace fastbert
