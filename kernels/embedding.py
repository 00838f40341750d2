"""Fused BERT embedding: ``LayerNorm(word[ids] + position[pos] + token_type[tt]) * weight + bias``.

Works on flat token lists, so the same op serves the dense [B*S] and the packed [total_tokens] layouts.
input_ids, position_ids, token_type_ids: [tokens] int64; word: [vocab, hidden]; position: [max_pos, hidden];
token_type: [type_vocab, hidden]; weight, bias: [hidden] -> [tokens, hidden] in the tables' dtype.
This is the Triton kernel and its reference; the op (one registered op for this kernel and fastbert._C's C++/CUDA
one, which is preferred where it was built for the device) and its backends are ``fastbert/ops/embedding.py``'s.
"""

import torch
import torch.nn.functional as F

from ._common import calculate_settings, check_float, check_last_dim_contiguous, check_like, for_device, tl, triton
from .layer_norm import _normalize_row


def embedding_layer_norm_ref(
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    token_type_ids: torch.Tensor,
    word: torch.Tensor,
    position: torch.Tensor,
    token_type: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
    upcast: bool = False,
) -> torch.Tensor:
    """The embedding sum then LayerNorm, in the tables' dtype (``upcast=True``: in fp32, rounded once)."""
    dtype = word.dtype
    tables = (word, position, token_type, weight, bias)
    if upcast:
        word, position, token_type, weight, bias = (t.float() for t in tables)
    x = word[input_ids] + position[position_ids] + token_type[token_type_ids]
    return F.layer_norm(x, x.shape[-1:], weight, bias, eps).to(dtype)


# ---------------------------------------------------------------------------------------------------------------
# Triton
#
# One program per token t, all math in fp32 (3 row reads, 1 row write):
#   i = clamp(input_ids[t], 0, vocab - 1);  p = clamp(position_ids[t], 0, max_pos - 1);
#   k = clamp(token_type_ids[t], 0, type_vocab - 1)
#   z = word[i] + position[p] + token_type[k]
#   y = (z - mean(z)) / sqrt(var(z) + eps) * weight + bias  (biased variance; layer_norm._normalize_row)
# The clamp makes a bad id embed a wrong row instead of reading out of bounds; the Python layer range-checks the
# ids before (fastbert.validation) unless the user turned the checks off.
# ---------------------------------------------------------------------------------------------------------------


@triton.jit
def _embedding_layer_norm_kernel(
    INPUT_IDS,  # pointer to the word ids [n_tokens], int32/int64
    POSITION_IDS,  # pointer to the position ids [n_tokens]
    TOKEN_TYPE_IDS,  # pointer to the token type ids [n_tokens]
    WORD,  # pointer to the word table [vocab, H], last dim contiguous
    POSITION,  # pointer to the position table [max_pos, H]
    TOKEN_TYPE,  # pointer to the token type table [type_vocab, H]
    W,  # pointer to the LayerNorm weight [H]
    B,  # pointer to the LayerNorm bias [H]
    Y,  # pointer to the output [n_tokens, H], contiguous
    stride_ids,  # elements between consecutive input ids
    stride_pos_ids,  # ... position ids
    stride_type_ids,  # ... token type ids
    stride_word,  # elements between consecutive rows of WORD
    stride_position,  # ... of POSITION
    stride_token_type,  # ... of TOKEN_TYPE
    vocab,  # rows of WORD (ids are clamped into [0, vocab))
    max_pos,  # rows of POSITION
    type_vocab,  # rows of TOKEN_TYPE
    n_cols,  # H
    eps,  # added to the variance
    BLOCK_N: tl.constexpr,  # H rounded up to a power of two
):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < n_cols
    word_id = tl.load(INPUT_IDS + token * stride_ids).to(tl.int64)
    pos_id = tl.load(POSITION_IDS + token * stride_pos_ids).to(tl.int64)
    type_id = tl.load(TOKEN_TYPE_IDS + token * stride_type_ids).to(tl.int64)
    word_id = tl.minimum(tl.maximum(word_id, 0), vocab - 1)
    pos_id = tl.minimum(tl.maximum(pos_id, 0), max_pos - 1)
    type_id = tl.minimum(tl.maximum(type_id, 0), type_vocab - 1)
    z = tl.load(WORD + word_id * stride_word + cols, mask=mask, other=0.0).to(tl.float32)
    z += tl.load(POSITION + pos_id * stride_position + cols, mask=mask, other=0.0).to(tl.float32)
    z += tl.load(TOKEN_TYPE + type_id * stride_token_type + cols, mask=mask, other=0.0).to(tl.float32)
    y = _normalize_row(z, W, B, cols, mask, n_cols, eps)
    tl.store(Y + token * n_cols + cols, y.to(Y.dtype.element_ty), mask=mask)


_ID_DTYPES = (torch.int64, torch.int32)


def check_embedding_args(input_ids, position_ids, token_type_ids, word, position, token_type, weight, bias, eps):
    """TypeError/ValueError unless the arguments fit the op (module docstring): int64/int32 ids of one [tokens] shape,
    non-empty tables of one float dtype and word's hidden size, weight/bias [hidden], one device, eps >= 0.
    Reads metadata only (fake tensors too). Both implementations check this: the Triton launcher here and
    fastbert._C's (``fastbert.ops.embedding``), each adding what its kernel needs besides."""
    check_float("word", word)
    if word.dim() != 2:
        raise ValueError(f"word must be [vocab, hidden], got shape {tuple(word.shape)}")
    for name, ids in (("input_ids", input_ids), ("position_ids", position_ids), ("token_type_ids", token_type_ids)):
        if not isinstance(ids, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(ids).__name__}")
        if ids.dtype not in _ID_DTYPES:
            raise TypeError(f"{name} must be int64 or int32, got {ids.dtype}")
        if ids.dim() != 1 or ids.shape != input_ids.shape:
            raise ValueError(
                f"{name} must be [tokens] like input_ids {tuple(input_ids.shape)}, got shape {tuple(ids.shape)}"
            )
        if ids.device != word.device:
            raise ValueError(f"{name} is on {ids.device} but the word table is on {word.device}")
    hidden = word.shape[1]
    for name, table in (("position", position), ("token_type", token_type)):
        if not isinstance(table, torch.Tensor) or table.dim() != 2:
            raise ValueError(f"{name} must be a [rows, hidden] tensor")
        check_like(name, table, "word", word, (table.shape[0], hidden))
    for name, table in (("word", word), ("position", position), ("token_type", token_type)):
        if table.shape[0] == 0:
            raise ValueError(f"the {name} table is empty")
    check_like("weight", weight, "word", word, (hidden,))
    check_like("bias", bias, "word", word, (hidden,))
    if not isinstance(eps, (int, float)) or not eps >= 0:
        raise ValueError(f"eps must be a non-negative float, got {eps!r}")


def check_embedding(input_ids, position_ids, token_type_ids, word, position, token_type, weight, bias, eps):
    """The op's contract, and what this kernel needs besides: each table's rows contiguous (it reads rows by stride)."""
    check_embedding_args(input_ids, position_ids, token_type_ids, word, position, token_type, weight, bias, eps)
    for name, table in (("word", word), ("position", position), ("token_type", token_type)):
        check_last_dim_contiguous(name, table)


def embedding_layer_norm(input_ids, position_ids, token_type_ids, word, position, token_type, weight, bias,
                         eps) -> torch.Tensor:
    """``LayerNorm(word[ids] + position[pos] + token_type[tt])`` in one pass of this Triton kernel, statistics in fp32
    (the launcher; the registered op, with fastbert._C's kernel beside it, is ``fastbert.ops.embedding``'s).

    input_ids, position_ids, token_type_ids: [tokens] int64 (or int32), any stride, on the tables' device; ids
    outside a table are clamped into it (no out-of-bounds read; range-check before, as fastbert.validation does).
    word [vocab, H], position [max_pos, H], token_type [type_vocab, H]: last dim contiguous; weight, bias: [H];
    all of one float dtype. Returns a new contiguous [tokens, H] tensor in that dtype. Same semantics as
    ``embedding_layer_norm_ref(..., upcast=True)`` on in-range ids.
    """
    check_embedding(input_ids, position_ids, token_type_ids, word, position, token_type, weight, bias, eps)
    n_tokens, hidden = input_ids.shape[0], word.shape[1]
    out = torch.empty((n_tokens, hidden), dtype=word.dtype, device=word.device)
    if out.numel() == 0:
        return out
    block_n, num_warps = calculate_settings(hidden)
    weight, bias = weight.contiguous(), bias.contiguous()  # no-ops for nn.Parameters
    for_device(_embedding_layer_norm_kernel, word.device)[(n_tokens,)](
        input_ids,
        position_ids,
        token_type_ids,
        word,
        position,
        token_type,
        weight,
        bias,
        out,
        input_ids.stride(0),
        position_ids.stride(0),
        token_type_ids.stride(0),
        word.stride(0),
        position.stride(0),
        token_type.stride(0),
        word.shape[0],
        position.shape[0],
        token_type.shape[0],
        hidden,
        float(eps),
        BLOCK_N=block_n,
        num_warps=num_warps,
    )
    return out
