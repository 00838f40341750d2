"""Bidirectional multi-head self-attention, flash-attention style (online softmax, no S x S matrix in memory).

One kernel for two layouts, both reading Q, K, V straight out of the fused QKV projection through strides:
- padded (this module's op): qkv [B, S, 3, H, D] with key_padding_mask [B, S] bool (True = real token) or None, and
  optional key_bounds [B] int32 (keys at index >= key_bounds[b] are padding) -> out [B, S, H, D];
- varlen (``attention_varlen.py``'s op, on this kernel): qkv [total_tokens, 3, H, D] with cu_seqlens [B + 1] int32
  and max_seqlen -> out [total_tokens, H, D].
Scale 1/sqrt(D). A query whose keys are all masked gets zeros, never NaN.
Both take an optional window w (ModernBERT's local layers): query i attends only to keys j with |i - j| <= w, and an
optional relative bias [H, 2R + 1] (MPNet's): the score of key j for query i gains bias[h, clamp(j - i, -R, R) + R];
i and j are indices in [0, S) (padded), or the tokens' columns (varlen: ``columns``, else their offsets); and
optional DeBERTa position tables (``fastbert/ops/disentangled.py``): c2p and p2c [H, T, R] over the layout's tokens
and an int32 index [2C + 1] by distance, the score of query i and key j being
scale * (q_i . k_j + c2p[h, i, r] + p2c[h, j, r]) with r = index[column_i - column_j + C].
"""

import math

import torch

from ._common import for_device, launch_or_op, tl, triton
from .attention_args import MAX_HEAD_DIM, _check_attention  # noqa: F401  (MAX_HEAD_DIM: read through this module)
from .attention_config import _attention_config, _input_precision


def attention_ref(
    qkv: torch.Tensor,
    key_padding_mask: torch.Tensor | None = None,
    key_bounds: torch.Tensor | None = None,
    upcast: bool = True,
    window: int | None = None,
    columns: torch.Tensor | None = None,
    relative_bias: torch.Tensor | None = None,
    c2p: torch.Tensor | None = None,
    p2c: torch.Tensor | None = None,
    rel_index: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Padded layout, written out: softmax(q k^T / sqrt(D) + bias + mask) v. A key at index >= key_bounds[b] is masked
    exactly like a False in key_padding_mask; given both, both apply. ``window``: query i sees key j only where
    |column_i - column_j| <= window, columns being [B, S] ``columns`` or the indices 0 .. S - 1. ``relative_bias``
    [H, 2R + 1]: bias[h, clamp(column_j - column_i, -R, R) + R] added to the scaled score. ``c2p``, ``p2c``
    [H, B * S, R] with ``rel_index`` [2C + 1]: DeBERTa's terms added to q k^T, all times ``scale`` (the module's
    docstring)."""
    dtype = qkv.dtype
    if upcast:
        qkv = qkv.float()
    q, k, v = qkv.unbind(dim=2)  # each [B, S, H, D]
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k)
    if c2p is not None or p2c is not None:  # [B, H, S, S] gathered from the tables, as ops/disentangled.py's bias
        batch, seq = qkv.shape[:2]
        cols = torch.arange(seq, device=qkv.device)
        rows = rel_index.long()[cols[:, None] - cols[None, :] + (rel_index.shape[0] - 1) // 2]  # [S_q, S_k]
        for name, table in (("c2p", c2p), ("p2c", p2c)):
            if table is not None:
                table = table.to(scores.dtype).view(table.shape[0], batch, seq, -1).transpose(0, 1)  # [B, H, S, R]
                picked = rows if name == "c2p" else rows.t()
                term = table.gather(3, picked.expand(batch, table.shape[1], -1, -1))
                scores = scores + (term if name == "c2p" else term.transpose(2, 3))
    scores = scores / math.sqrt(q.shape[-1]) if scale is None else scores * scale
    keep = key_padding_mask  # [B, S_k] or None
    if key_bounds is not None:
        in_bound = torch.arange(qkv.shape[1], device=qkv.device)[None, :] < key_bounds[:, None]  # [B, S_k]
        keep = in_bound if keep is None else keep & in_bound
    if keep is not None:
        scores = scores.masked_fill(~keep[:, None, None, :], float("-inf"))  # keep as [B, 1, 1, S_k]
    if columns is None:
        columns = torch.arange(qkv.shape[1], device=qkv.device)[None, :]
    distance = columns[:, None, :] - columns[:, :, None]  # [B or 1, S_q, S_k]: key column - query column
    if relative_bias is not None:  # (in the scores' dtype, as transformers adds it)
        radius = (relative_bias.shape[1] - 1) // 2
        scores = scores + relative_bias.to(scores.dtype)[:, distance.clamp(-radius, radius) + radius].transpose(0, 1)
    if window is not None:
        scores = scores.masked_fill(~(distance.abs() <= window)[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # all-masked rows: NaN -> 0
    return torch.einsum("bhqk,bkhd->bqhd", probs, v).to(dtype)


# ---------------------------------------------------------------------------------------------------------------
# Triton: flash-attention forward (one kernel for both layouts; VARLEN is a constexpr flag)
#
# Program (b * H + h, m) computes query rows [m * BLOCK_M, (m + 1) * BLOCK_M) of head h of sequence b against all
# keys of that sequence (batch x heads on grid axis 0, which has no 65535 limit), walking the keys in blocks of
# BLOCK_N with the online softmax (fp32 statistics, exp2 with log2(e) folded into the scale c = log2(e) / sqrt(D)):
#   s_j   = q . k_j                                      for real keys (others: -inf); unscaled
#   m'    = max(m, max_j s_j);   p_j = 2^((s_j - m') c);   alpha = 2^((m - m') c)
# The scale multiplies the difference, not the score: a product s_j = (q . k_j) c feeding s_j - m' would be contracted
# into one FMA where no tl.where stands between them (EVEN_N) and not elsewhere, and the two loops would differ.
#   l'    = l * alpha + sum_j p_j;   acc' = acc * alpha + sum_j p_j v_j
#   out   = acc / l
# Until a row has seen a real key, m = -inf; the exponents then use 0 instead of m' (so -inf - -inf never makes a
# NaN), and a row with no real key at all ends with acc = 0, l = 0 and is written as zeros (l guarded to 1).
# Loading and masking are separate. K and V rows are loaded for every key below kv_len (seq_len, or key_bounds[b]
# with HAS_BOUND), padding or not: those rows are real memory of this sequence (a padding token's QKV projection),
# so the loads need the bound check only. The padding mask (HAS_MASK) is loaded once per key block and applied once,
# to the scores (s_j = -inf). A masked key then contributes exactly nothing: s_j = -inf whatever k_j holds (the
# column q k_j of the dot depends on k_j alone, and tl.where replaces even a NaN), so it never raises m,
# p_j = 2^(-inf - m') = 0 exactly, and it adds nothing to l or acc (0 * v_j = +-0 for a finite v_j: padding rows
# come from the same projection as real ones; an inf or NaN there would reach acc, as it does in attention_ref).
# An earlier version loaded masked k_j and v_j as 0 instead: the same s_j and p_j, the same sums.
# A block whose keys are all masked changes nothing (p = 0 and alpha = 2^0 = 1 exactly, or acc = l = 0 still): so
# stopping the loop at key_bounds[b] (HAS_BOUND) instead of loading trailing padding blocks and masking them gives
# bit-identical results whenever every key at or past the bound is masked anyway; key_bounds alone (no mask) is a
# right-padded prefix mask without any mask load. With EVEN_N (padded layout, 16-bit, S a multiple of BLOCK_N, no
# bound) every block is full: K and V loads drop the per-key `keys < S` check, and without a mask the scores need
# no tl.where at all.
# The head dim D is padded to BLOCK_D (a power of two, >= 16 for tl.dot) with masked loads: padded lanes are 0 in
# q, k and v, so they add nothing to q.k and are never stored.
# ---------------------------------------------------------------------------------------------------------------


@triton.jit
def _attention_fwd_kernel(
    Q,  # pointer to q of token 0, head 0: qkv's first element; K, V are the same buffer one/two "3" strides on
    K,  # pointer to k of token 0, head 0
    V,  # pointer to v of token 0, head 0
    OUT,  # pointer to the output: [B, S, H, D] (padded) or [T, H, D] (varlen), contiguous
    MASK,  # pointer to key_padding_mask [B, S], nonzero = real token (read only if HAS_MASK)
    KEY_BOUNDS,  # pointer to key_bounds [B] int32: keys >= key_bounds[b] are padding (read only if HAS_BOUND)
    CU_SEQLENS,  # pointer to cu_seqlens [B + 1] int32, contiguous (read only if VARLEN)
    COLUMNS,  # pointer to columns [T] int32, contiguous: each token's column (read only if HAS_COLUMNS)
    REL_BIAS,  # pointer to the relative bias [H, 2R + 1] float32, contiguous (read only if HAS_REL_BIAS)
    C2P,  # pointer to DeBERTa's c2p table [H, T, R], contiguous (read only if HAS_C2P)
    P2C,  # pointer to DeBERTa's p2c table [H, T, R], contiguous (read only if HAS_P2C)
    REL_INDEX,  # pointer to the tables' row by distance [2C + 1] int32 (read with HAS_C2P or HAS_P2C)
    stride_qkv_b,  # elements between batches of qkv (padded layout; unused when VARLEN)
    stride_qkv_s,  # elements between tokens of qkv
    stride_qkv_h,  # elements between heads of qkv (the head dim itself has stride 1)
    stride_out_s,  # elements between tokens of OUT (batches are seq_len tokens apart in the padded layout)
    stride_out_h,  # elements between heads of OUT
    stride_mask_b,  # elements between rows of MASK
    stride_mask_s,  # elements between tokens of MASK
    stride_bound,  # elements between entries of KEY_BOUNDS
    seq_len,  # S of the padded layout (unused when VARLEN: lengths come from CU_SEQLENS)
    num_heads,  # H
    head_dim,  # D, the real head dim
    qk_scale,  # log2(e) / sqrt(D), or log2(e) times DeBERTa's scale
    window,  # HAS_WINDOW: a query sees the keys within this distance (in columns) only
    rel_radius,  # HAS_REL_BIAS: R; key j of query i gets REL_BIAS[h, clamp(j - i, -R, R) + R] (columns)
    table_tokens,  # T: the tables' rows per head (the layout's tokens: B * S padded)
    table_rows,  # R: the tables' entries per token
    rel_center,  # C: REL_INDEX[column_i - column_j + C] is the row of that distance
    HAS_MASK: tl.constexpr,  # read MASK (padded layout only)
    HAS_BOUND: tl.constexpr,  # read KEY_BOUNDS and stop each sequence's key loop there (padded layout only)
    EVEN_N: tl.constexpr,  # every key block is full: padded, seq_len % BLOCK_N == 0, no HAS_BOUND (see launcher)
    VARLEN: tl.constexpr,  # packed layout with CU_SEQLENS instead of [B, S]
    HAS_WINDOW: tl.constexpr,  # banded attention: skip the key blocks out of reach, mask the keys past ``window``
    HAS_COLUMNS: tl.constexpr,  # (VARLEN) distances between COLUMNS entries, not between offsets
    HAS_REL_BIAS: tl.constexpr,  # add a per-head bias of the distance j - i to the scores (MPNet)
    HAS_C2P: tl.constexpr,  # add c2p[h, i, index[i - j]] to the unscaled scores (DeBERTa)
    HAS_P2C: tl.constexpr,  # add p2c[h, j, index[i - j]] to the unscaled scores (DeBERTa)
    MASK_QUERIES: tl.constexpr,  # (HAS_MASK, no HAS_BOUND) a padding query scores every key 0: it averages them all,
    # as transformers' DeBERTa does with its [B, 1, S, S] mask (the launcher's mask_queries)
    INPUT_PRECISION: tl.constexpr,  # tl.dot precision for fp32 operands: "ieee" or "tf32"
    BLOCK_M: tl.constexpr,  # query rows per program
    BLOCK_N: tl.constexpr,  # keys per inner step
    BLOCK_D: tl.constexpr,  # head dim padded to a power of two >= 16
):
    pid_bh = tl.program_id(0)
    pid_m = tl.program_id(1)
    batch = pid_bh // num_heads
    head = pid_bh % num_heads
    if VARLEN:
        start = tl.load(CU_SEQLENS + batch)
        seq_len = tl.load(CU_SEQLENS + batch + 1) - start
        qkv_offset = start.to(tl.int64) * stride_qkv_s
        out_offset = start.to(tl.int64) * stride_out_s
    else:
        qkv_offset = batch.to(tl.int64) * stride_qkv_b
        out_offset = batch.to(tl.int64) * seq_len * stride_out_s
    if pid_m * BLOCK_M >= seq_len:  # the grid covers the longest sequence; shorter ones stop here
        return
    qkv_offset += head.to(tl.int64) * stride_qkv_h
    out_offset += head.to(tl.int64) * stride_out_h

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < head_dim
    q = tl.load(
        Q + qkv_offset + offs_m[:, None] * stride_qkv_s + offs_d[None, :],
        mask=(offs_m < seq_len)[:, None] & d_ok[None, :],
        other=0.0,
    )  # [BLOCK_M, BLOCK_D]

    mask_row = MASK + batch.to(tl.int64) * stride_mask_b  # this sequence's key_padding_mask (if HAS_MASK)
    if MASK_QUERIES:
        q_real = tl.load(mask_row + offs_m * stride_mask_s, mask=offs_m < seq_len, other=0) != 0  # [BLOCK_M]
    kv_len = seq_len  # keys [0, kv_len) are visited; blocks past it are never loaded
    if HAS_BOUND:
        kv_len = tl.minimum(seq_len, tl.load(KEY_BOUNDS + batch * stride_bound))
    kv_start = 0
    if HAS_WINDOW:  # only the key blocks within `window` of this query block (columns grow at least as fast as
        # offsets, so a key out of reach by offset is out of reach by column too)
        kv_start = (tl.maximum(pid_m * BLOCK_M - window, 0) // BLOCK_N) * BLOCK_N
        kv_len = tl.minimum(kv_len, (pid_m + 1) * BLOCK_M + window)
    POSITIONAL: tl.constexpr = HAS_WINDOW or HAS_REL_BIAS or HAS_C2P or HAS_P2C
    if POSITIONAL:  # the queries' columns: their places in the padded batch
        if HAS_COLUMNS:
            columns = COLUMNS + (start if VARLEN else 0)
            q_col = tl.load(columns + offs_m, mask=offs_m < seq_len, other=0)
        else:
            q_col = offs_m
    rel_row = REL_BIAS + head.to(tl.int64) * (2 * rel_radius + 1)  # this head's bias by distance (if HAS_REL_BIAS)
    # DeBERTa's tables of this head, at this sequence's first token (token b * S + i padded, start + i varlen)
    if VARLEN:
        first_token = start
    else:
        first_token = batch * seq_len
    table_offset = (head.to(tl.int64) * table_tokens + first_token) * table_rows
    q_ok = offs_m < seq_len
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max of the (unscaled) scores
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of 2^((s - m_i) c)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)  # running sum of 2^((s - m_i) c) v
    for start_n in range(kv_start, kv_len, BLOCK_N):
        keys = start_n + offs_n
        if EVEN_N:  # a constant: the compiler folds it out of the load masks
            in_bound = tl.full([BLOCK_N], 1, tl.int1)
        else:
            in_bound = keys < kv_len
        k_t = tl.load(
            K + qkv_offset + keys[None, :] * stride_qkv_s + offs_d[:, None],
            mask=in_bound[None, :] & d_ok[:, None],
            other=0.0,
        )  # [BLOCK_D, BLOCK_N]
        s = tl.dot(q, k_t, input_precision=INPUT_PRECISION)  # [BLOCK_M, BLOCK_N], unscaled
        if HAS_MASK:  # other=0: a key past kv_len is padding too
            real = tl.load(mask_row + keys * stride_mask_s, mask=in_bound, other=0) != 0  # [BLOCK_N]
            s = tl.where(real[None, :], s, float("-inf"))
        elif not EVEN_N:  # keys past kv_len were loaded as 0, scoring 0: mask them
            s = tl.where(in_bound[None, :], s, float("-inf"))
        if POSITIONAL:
            k_col = keys
            if HAS_COLUMNS:
                k_col = tl.load(columns + keys, mask=in_bound, other=0)
            distance = k_col[None, :] - q_col[:, None]  # [BLOCK_M, BLOCK_N]
            if HAS_REL_BIAS:  # (in the unscaled scores' units: bias * sqrt(D), as c multiplies both)
                nearest = tl.minimum(tl.maximum(distance, -rel_radius), rel_radius) + rel_radius
                s += tl.load(rel_row + nearest) * (1.4426950408889634 / qk_scale)
            if HAS_C2P or HAS_P2C:  # gathers from the two tables, by the row of each distance (in q . k units)
                pair_ok = q_ok[:, None] & in_bound[None, :]
                row = tl.load(REL_INDEX + rel_center - distance, mask=pair_ok, other=0)  # [BLOCK_M, BLOCK_N]
                if HAS_C2P:
                    s += tl.load(C2P + table_offset + offs_m[:, None].to(tl.int64) * table_rows + row, mask=pair_ok,
                                 other=0.0).to(tl.float32)
                if HAS_P2C:
                    s += tl.load(P2C + table_offset + keys[None, :].to(tl.int64) * table_rows + row, mask=pair_ok,
                                 other=0.0).to(tl.float32)
            if HAS_WINDOW:
                s = tl.where(tl.abs(distance) <= window, s, float("-inf"))
        if MASK_QUERIES:
            s = tl.where(q_real[:, None], s, tl.where(in_bound[None, :], 0.0, float("-inf")))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2((s - m_use[:, None]) * qk_scale)
        alpha = tl.exp2((m_i - m_use) * qk_scale)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(
            V + qkv_offset + keys[:, None] * stride_qkv_s + offs_d[None, :],
            mask=in_bound[:, None] & d_ok[None, :],
            other=0.0,
        )  # [BLOCK_N, BLOCK_D]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=INPUT_PRECISION)
        m_i = m_new

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(
        OUT + out_offset + offs_m[:, None] * stride_out_s + offs_d[None, :],
        out.to(OUT.dtype.element_ty),
        mask=(offs_m < seq_len)[:, None] & d_ok[None, :],
    )


def _attention_launch(qkv, out, key_padding_mask, key_bounds, cu_seqlens, max_seqlen, batch, seq_len, window=None,
                      columns=None, relative_bias=None, c2p=None, p2c=None, rel_index=None, scale=None,
                      mask_queries=False):
    """The launch both layouts share; their launchers (``_attention_padded_launch`` below, ``attention_varlen.py``'s)
    have checked the arguments and allocated ``out``."""
    varlen = cu_seqlens is not None
    heads, head_dim = qkv.shape[-2], qkv.shape[-1]
    if out.numel() == 0 or batch == 0 or max_seqlen == 0:
        return out
    tables = c2p is not None or p2c is not None
    config = _attention_config(head_dim, qkv.dtype, qkv.device,
                               window is not None or relative_bias is not None or tables, tables)
    table = c2p if c2p is not None else p2c
    q, k, v = qkv.unbind(-3)  # views: same strides, pointers one "3" stride apart
    mask, bounds = key_padding_mask, key_bounds
    mask_queries = mask_queries and mask is not None
    if mask_queries:  # (a padding query averages every key: the loop runs to seq_len)
        bounds = None
    # Full key blocks need no bound check. 16-bit only: fp32 is the exact path, not the fast one, and its EVEN_N
    # builds spill on sm_90 (ptxas 13.4: 32 bytes per thread at D = 128 "ieee" with a mask; the checked loop: none).
    even_n = qkv.dtype != torch.float32 and not varlen and bounds is None and seq_len % config["BLOCK_N"] == 0
    grid = (batch * heads, triton.cdiv(max_seqlen, config["BLOCK_M"]))
    for_device(_attention_fwd_kernel, qkv.device)[grid](
        q,
        k,
        v,
        out,
        qkv if mask is None else mask,  # dummy pointers when absent: never read
        qkv if bounds is None else bounds,
        qkv if cu_seqlens is None else cu_seqlens,
        qkv if columns is None else columns,
        qkv if relative_bias is None else relative_bias,
        qkv if c2p is None else c2p,
        qkv if p2c is None else p2c,
        qkv if rel_index is None else rel_index,
        0 if varlen else qkv.stride(0),
        qkv.stride(-4),
        qkv.stride(-2),
        out.stride(-3),
        out.stride(-2),
        0 if mask is None else mask.stride(0),
        0 if mask is None else mask.stride(1),
        0 if bounds is None else bounds.stride(0),
        seq_len,
        heads,
        head_dim,
        math.log2(math.e) * (1 / math.sqrt(head_dim) if scale is None else scale),
        0 if window is None else window,
        0 if relative_bias is None else (relative_bias.shape[1] - 1) // 2,
        0 if table is None else table.shape[1],
        0 if table is None else table.shape[2],
        0 if rel_index is None else (rel_index.shape[0] - 1) // 2,
        HAS_MASK=mask is not None,
        HAS_BOUND=bounds is not None,
        EVEN_N=even_n,
        VARLEN=varlen,
        HAS_WINDOW=window is not None,
        HAS_COLUMNS=columns is not None,
        HAS_REL_BIAS=relative_bias is not None,
        HAS_C2P=c2p is not None,
        HAS_P2C=p2c is not None,
        MASK_QUERIES=mask_queries,
        INPUT_PRECISION=_input_precision(qkv.dtype, qkv.device),
        **config,
    )
    return out


def _attention_padded_launch(qkv, key_padding_mask, key_bounds, window=None, relative_bias=None, c2p=None, p2c=None,
                             rel_index=None, scale=None, mask_queries=False) -> torch.Tensor:
    _check_attention(qkv, key_padding_mask, key_bounds, window, relative_bias, c2p, p2c, rel_index, scale)
    batch, seq_len, _, heads, head_dim = qkv.shape
    out = torch.empty((batch, seq_len, heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    return _attention_launch(qkv, out, key_padding_mask, key_bounds, None, seq_len, batch, seq_len, window,
                             relative_bias=relative_bias, c2p=c2p, p2c=p2c, rel_index=rel_index, scale=scale,
                             mask_queries=mask_queries)


@torch.library.custom_op("fastbert::attention", mutates_args=())
def _attention_op(
    qkv: torch.Tensor, key_padding_mask: torch.Tensor | None, key_bounds: torch.Tensor | None, window: int | None,
    relative_bias: torch.Tensor | None, c2p: torch.Tensor | None = None, p2c: torch.Tensor | None = None,
    rel_index: torch.Tensor | None = None, scale: float | None = None, mask_queries: bool = False,
) -> torch.Tensor:
    return _attention_padded_launch(qkv, key_padding_mask, key_bounds, window, relative_bias, c2p, p2c, rel_index,
                                    scale, mask_queries)


@_attention_op.register_fake
def _(qkv, key_padding_mask, key_bounds, window, relative_bias, c2p=None, p2c=None, rel_index=None, scale=None,
      mask_queries=False):
    _check_attention(qkv, key_padding_mask, key_bounds, window, relative_bias, c2p, p2c, rel_index, scale)
    batch, seq_len, _, heads, head_dim = qkv.shape
    return qkv.new_empty((batch, seq_len, heads, head_dim))


def attention(
    qkv: torch.Tensor, key_padding_mask: torch.Tensor | None = None, key_bounds: torch.Tensor | None = None,
    window: int | None = None, relative_bias: torch.Tensor | None = None, c2p: torch.Tensor | None = None,
    p2c: torch.Tensor | None = None, rel_index: torch.Tensor | None = None, scale: float | None = None,
    mask_queries: bool = False,
) -> torch.Tensor:
    """Padded layout: qkv [B, S, 3, H, D], key_padding_mask [B, S] bool (True = real token) or None, key_bounds [B]
    int32 or None -> out [B, S, H, D], contiguous, qkv's dtype. Same semantics as ``attention_ref``.

    key_bounds[b]: every key at index >= key_bounds[b] is padding (any int: clamped to [0, S] by the kernel, which
    then never loads those key blocks). With key_bounds = index of the last real token + 1, computed from the mask,
    the output is bit-identical to the mask alone, and trailing padding costs no key-loop work. Given without a mask,
    key_bounds stand for a right-padded prefix mask (keys 0 .. key_bounds[b] - 1 real): the same output, bit for bit,
    and no mask is read at all.
    window: None, or an int >= 0: query i attends only to keys j with |i - j| <= window; the key blocks out of reach
    are never loaded. relative_bias: None, or float32 [H, 2R + 1], contiguous: bias[h, clamp(j - i, -R, R) + R] is
    added to the scaled score of key j for query i (a per-head table of the distance, read as a gather; no [H, S, S]
    tensor is formed). c2p, p2c [H, B * S, R], rel_index [2C + 1] int32 and scale: DeBERTa's terms (the module's
    docstring), gathered per score. mask_queries: a padding query (False in key_padding_mask) averages every value
    of its row instead of attending to the real keys, as transformers' DeBERTa's [B, 1, S, S] mask makes it.

    qkv is read through its strides (typically ``gemm_out.view(B, S, 3, H, D)`` of the fused QKV projection
    [B*S, 3*H*D]; only the head dim must have stride 1): no transpose copy. D <= 128, any value. Padded query rows
    are computed too (they attend to the real keys); a row whose keys are all masked is zeros.
    fp32 on CUDA multiplies in TF32 only where torch allows it for fp32 matmuls (``allow_tf32``/``fp32_precision``).
    """
    return launch_or_op(_attention_padded_launch, _attention_op, qkv, key_padding_mask, key_bounds, window,
                        relative_bias, c2p, p2c, rel_index, scale, mask_queries)
