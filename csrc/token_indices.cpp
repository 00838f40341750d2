// See token_indices.h. One sequential pass: a batch holds at most a few ten thousand ids, and what this replaces is
// ~20 torch calls of fixed cost each (stack, aminmax, cumsum, scatter, repeat_interleave), not arithmetic.
#include "token_indices.h"

#include <algorithm>
#include <limits>
#include <stdexcept>

namespace fastbert {
namespace {

inline int64_t read(const IntInput& input, int64_t i) {
  switch (input.code) {
    case 0: return static_cast<const int64_t*>(input.data)[i];
    case 1: return static_cast<const int32_t*>(input.data)[i];
    default: return static_cast<const uint8_t*>(input.data)[i];
  }
}

struct Span {
  int64_t low = std::numeric_limits<int64_t>::max(), high = std::numeric_limits<int64_t>::min();
  void add(int64_t value) {
    low = std::min(low, value);
    high = std::max(high, value);
  }
};

}  // namespace

std::pair<int64_t, bool> count_real_tokens(IntInput mask, int64_t batch, int64_t seq_len, int32_t* seqlens) {
  int64_t total = 0;
  bool first_real = true;
  for (int64_t b = 0; b < batch; ++b) {
    int32_t length = 0;
    for (int64_t s = 0; s < seq_len; ++s) length += read(mask, b * seq_len + s) != 0;
    seqlens[b] = length;
    total += length;
    first_real = first_real && (seq_len == 0 || read(mask, b * seq_len) != 0);
  }
  return {total, first_real};
}

std::vector<int64_t> token_indices(const TokenIndicesArgs& args) {
  const bool back_to_back = args.seqlens != nullptr;
  Span spans[3];
  int64_t n = 0, start = 0;  // n: real tokens written; start: a back-to-back sequence's first id
  if (args.cu_seqlens) args.cu_seqlens[0] = 0;
  for (int64_t b = 0; b < args.batch; ++b) {
    const int64_t length = back_to_back ? args.seqlens[b] : args.seq_len;
    const int64_t positions_row = args.positions_rows == 1 ? 0 : b;
    int64_t rank = 0;  // ids other than base so far in this sequence
    for (int64_t s = 0; s < length; ++s) {
      const int64_t source = back_to_back ? start + s : b * args.seq_len + s;
      const int64_t id = read(args.ids, source);
      const int64_t type = args.types.data ? read(args.types, source) : 0;
      int64_t position = s;
      if (args.positions.data) {
        position = read(args.positions, positions_row * args.seq_len + s);
      } else if (args.numbering == 1) {
        rank += id != args.base;
        position = id != args.base ? args.base + rank : args.base;
      }
      spans[0].add(id);
      spans[1].add(type);
      spans[2].add(position);
      if (args.mask.data && read(args.mask, source) == 0) continue;
      if (n == args.tokens) throw std::invalid_argument("the mask keeps more tokens than counted");
      args.out[n] = id;
      args.out[args.rows + n] = type;
      args.out[2 * args.rows + n] = position;
      if (args.layout_indices) args.layout_indices[n] = b * args.seq_len + s;
      ++n;
    }
    if (args.cu_seqlens) args.cu_seqlens[b + 1] = static_cast<int32_t>(n);
    start += length;
  }
  if (n != args.tokens) throw std::invalid_argument("the mask keeps fewer tokens than counted");
  for (int i = 0; i < 3; ++i) std::fill(args.out + i * args.rows + n, args.out + (i + 1) * args.rows, int64_t{0});
  std::vector<int64_t> result;
  for (const Span& span : spans) {
    const bool read_any = span.low <= span.high;
    result.push_back(read_any ? span.low : 0);
    result.push_back(read_any ? span.high : 0);
  }
  return result;
}

}  // namespace fastbert
