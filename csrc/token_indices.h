// A batch's embedding indices built on the host in one pass: the [3, rows] word, token type and position indices of
// its real tokens, where each sits in [batch, seq_len], and the spans the range check reads. fastbert/token_indices.py
// is the torch side; the op by op path of fastbert/inputs.py is the reference. Torch-free: raw pointers, sizes and
// dtype codes.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

namespace fastbert {

// An integer input: null data where it was not given. Codes: 0 int64, 1 int32, 2 one byte (bool, uint8: masks).
struct IntInput {
  const void* data;
  int code;
};

// How positions are numbered where none are given (FusedModel.position_numbering): 0, a token's column (BERT);
// 1, base + its rank among its sequence's ids other than base, and base for those (RoBERTa: base = padding_idx).
struct TokenIndicesArgs {
  // Padded form (seqlens null): ids, types, mask [batch, seq_len]; positions [positions_rows, seq_len] with
  // positions_rows 1 (one row for every sequence) or batch. Back-to-back form: ids, types [tokens], sequence b the
  // next seqlens[b] ids (seq_len = the longest), no mask and no positions.
  IntInput ids, types, positions, mask;
  const int64_t* seqlens;
  int64_t batch, seq_len, positions_rows;
  int numbering;
  int64_t base;
  int64_t tokens;           // the real tokens: every one the mask (if any) keeps
  int64_t* out;             // [3, rows], rows >= tokens: each real token's indices in order, then zeros
  int64_t rows;
  int64_t* layout_indices;  // [tokens] each real token's place b * seq_len + column, or null
  int32_t* cu_seqlens;      // [batch + 1] sequence b is rows cu_seqlens[b] .. cu_seqlens[b + 1], or null
};

// mask [batch, seq_len] -> seqlens [batch] int32 (its nonzero entries per row) written; returns (their total, whether
// every row's column 0 is nonzero).
std::pair<int64_t, bool> count_real_tokens(IntInput mask, int64_t batch, int64_t seq_len, int32_t* seqlens);

// Fills args' outputs; returns the min and max of ids, types and positions over every entry read, padding included
// (6 values; zeros where nothing was read). invalid_argument where the real tokens counted are not args.tokens.
std::vector<int64_t> token_indices(const TokenIndicesArgs& args);

}  // namespace fastbert
