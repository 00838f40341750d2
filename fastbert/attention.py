"""Attention over a token layout: softmax(q k^T / sqrt(d)) v per head, over each sequence's real tokens, by the
backend ``dispatch`` picks: the Triton flash-attention kernel (``kernels/attention.py``; padded with a key mask and
key bounds, or varlen over packed tokens) or torch SDPA (dense with an additive mask; packed per sequence on CPU, or
scattered into one masked SDPA over the padded batch on a GPU).
"""

import torch
import torch.nn.functional as F

from . import announce, dispatch
from .kernels import attention as attention_kernels
from .padding import TokenLayout
from .plan import decided


def attention(qkv: torch.Tensor, layout: TokenLayout, num_heads: int, dropout_p: float = 0.0,
              window: int | None = None, relative_bias: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) + bias) v per head, over each sequence's real tokens.

    qkv: [rows, 3 * hidden] straight from the fused QKV GEMM -> [rows, hidden] (rows: the layout's tokens, then its
    spare rows, which come out zero). Distances below are between columns (places in the padded [B, S] batch; a
    packed layout then needs ``layout.columns``): window: None, or the largest distance between a query and a key it
    attends to (ModernBERT's local layers); relative_bias: None, or float32 [H, 2R + 1], the bias of the distance
    j - i clamped to [-R, R] (MPNet's relative positions).
    """
    tokens, hidden = layout.tokens, qkv.shape[1] // 3
    head_dim = hidden // num_heads
    # (the same decision for every layer with the same arguments)
    backend, warning = decided(None, ("attention", qkv.requires_grad, dropout_p, head_dim), _attention_backend,
                               qkv, dropout_p, head_dim)
    if warning is not None:
        announce.fallback(warning)
    real = qkv[:tokens] if layout.spare_rows else qkv
    out = _attention(real.view(tokens, 3, num_heads, head_dim), layout, dropout_p, backend, window, relative_bias)
    out = out.reshape(tokens, hidden)  # (SDPA's math backend, for dropout and float64, returns [B, H, S, D] memory)
    return torch.cat([out, out.new_zeros(layout.spare_rows, hidden)]) if layout.spare_rows else out


def _attention(heads: torch.Tensor, layout: TokenLayout, dropout_p: float, backend: str, window: int | None,
               relative_bias: torch.Tensor | None) -> torch.Tensor:
    """heads [N, 3, H, D] -> [N, H, D] (or [B, S, H, D]) by ``backend``, for the layout."""
    columns = layout.columns if window is not None or relative_bias is not None else None
    if backend == "triton":
        if layout.packed:
            return attention_kernels.attention_varlen(heads, layout.cu_seqlens, layout.max_seqlen, window, columns,
                                                      relative_bias)
        padded = heads.view(layout.batch, layout.seq_len, *heads.shape[1:])
        return attention_kernels.attention(padded, layout.key_padding_mask, layout.key_bounds, window, relative_bias)
    if layout.packed:
        if heads.device.type == "cuda":  # (a loop of small SDPA calls would be host-bound on a GPU)
            return _attention_packed_via_padded_sdpa(heads, layout, dropout_p, window, relative_bias)
        return _attention_varlen_sdpa(heads, layout.seqlens, dropout_p, window, columns, relative_bias)
    return _attention_sdpa(heads, layout, dropout_p, window, relative_bias)


def _band(columns: torch.Tensor, window: int) -> torch.Tensor:
    """columns [..., S] -> [..., S, S] bool: True where the query's and the key's columns are within ``window``."""
    return (columns[..., :, None] - columns[..., None, :]).abs() <= window


def _relative(relative_bias: torch.Tensor, columns: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """relative_bias [H, 2R + 1], columns [S] -> [H, S, S] in ``dtype``: the bias of each key's distance to each
    query, clamped to [-R, R]."""
    radius = (relative_bias.shape[1] - 1) // 2
    distance = columns[None, :] - columns[:, None]  # [S_q, S_k]: key column - query column
    return relative_bias[:, distance.clamp(-radius, radius) + radius].to(dtype)


def _attention_backend(qkv: torch.Tensor, dropout_p: float, head_dim: int) -> tuple[str, str | None]:
    why = dispatch.why_reference(qkv, dropout_p=dropout_p)
    if head_dim > attention_kernels.MAX_HEAD_DIM:
        # The Triton kernel refuses D > MAX_HEAD_DIM (ValueError): such a model must take SDPA on a GPU, not crash.
        why = why or f"head_dim {head_dim} exceeds the Triton attention kernel's {attention_kernels.MAX_HEAD_DIM}"
    return dispatch.resolve("attention", qkv, why)


def _additive(keep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bool keep mask -> additive float mask with the dtype's most negative finite value where False (as HF does): a
    fully masked row then averages its values instead of producing NaN, and cannot poison other rows."""
    return torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill_(~keep, torch.finfo(dtype).min)


def _attention_sdpa(heads: torch.Tensor, layout: TokenLayout, dropout_p: float, window: int | None = None,
                    relative_bias: torch.Tensor | None = None) -> torch.Tensor:
    """Dense layout through torch SDPA. heads: [B*S, 3, H, D] -> [B, S, H, D]."""
    q, k, v = heads.view(layout.batch, layout.seq_len, *heads.shape[1:]).permute(2, 0, 3, 1, 4)  # [B, H, S, D] each
    keep, keys = None, layout.key_mask()
    if keys is not None:
        keep = keys[:, None, None, :]  # [B, 1, 1, S]
    mask = None if keep is None else _additive(keep, q.dtype)
    if window is not None:
        # A bool mask: a padding query with no real key in its window gets zeros (SDPA's safe softmax), as with
        # transformers' masks and the Triton kernel; it is what a head reading position 0 of a left-padded row sees
        # with unpad=False.
        band = _band(torch.arange(layout.seq_len, device=q.device), window)  # [S, S]
        mask = band if keep is None else keep & band
    if relative_bias is not None:  # [1, H, S, S] added to the scores; a window, where also given, masks after it
        bias = _relative(relative_bias, torch.arange(layout.seq_len, device=q.device), q.dtype)[None]
        mask = bias if mask is None else (bias + mask if mask.dtype != torch.bool
                                          else bias.masked_fill(~mask, torch.finfo(q.dtype).min))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)  # [B, H, S, D]
    return out.transpose(1, 2)


def _attention_varlen_sdpa(heads: torch.Tensor, seqlens: tuple[int, ...], dropout_p: float,
                           window: int | None = None, columns: torch.Tensor | None = None,
                           relative_bias: torch.Tensor | None = None) -> torch.Tensor:
    """Packed layout on CPU: SDPA on each sequence's rows (views, no padding back to the max).

    heads: [T, 3, H, D] -> [T, H, D]. One SDPA per sequence: on CPU each call is large enough that the loop costs
    little, and no FLOP is spent on padding. With a window, each sequence gets a band mask from its tokens'
    ``columns`` [T] (or their offsets).
    """
    outputs = []
    chunks = columns.split(list(seqlens)) if columns is not None else [None] * len(seqlens)
    for chunk, cols in zip(heads.split(list(seqlens)), chunks):
        q, k, v = chunk.permute(1, 2, 0, 3)[:, None]  # [1, H, L, D] each
        mask = None
        if window is not None or relative_bias is not None:
            cols = torch.arange(chunk.shape[0], device=chunk.device) if cols is None else cols
        if window is not None:  # (every query sees itself: no row is fully masked)
            mask = _band(cols, window)  # [L, L] bool
        if relative_bias is not None:
            bias = _relative(relative_bias, cols, q.dtype)[None]  # [1, H, L, L]
            mask = bias if mask is None else bias.masked_fill(~mask, torch.finfo(q.dtype).min)
        outputs.append(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)[0]
                       .transpose(0, 1))
    return torch.cat(outputs) if outputs else heads.new_empty(0, *heads.shape[2:])


def _attention_packed_via_padded_sdpa(heads: torch.Tensor, layout: TokenLayout, dropout_p: float,
                                      window: int | None = None, relative_bias: torch.Tensor | None = None,
                                      ) -> torch.Tensor:
    """Packed layout through one masked SDPA over the padded batch (GPU training, or a head dim the Triton kernel
    does not take): heads [T, 3, H, D] -> [T, H, D]. Differentiable: the scatter into the padded buffer and the gather
    back are index ops; every other op of the layer still runs on the T real tokens only."""
    batch, seq_len = layout.batch, layout.seq_len
    padded = heads.new_zeros(batch * seq_len, *heads.shape[1:]).index_copy(0, layout.indices, heads)
    real = torch.zeros(batch * seq_len, dtype=torch.bool, device=heads.device).index_fill_(0, layout.indices, True)
    dense = TokenLayout(batch, seq_len, key_padding_mask=real.view(batch, seq_len))
    out = _attention_sdpa(padded, dense, dropout_p, window, relative_bias)  # [B, S, H, D] (by index: by column)
    return out.reshape(batch * seq_len, *out.shape[2:]).index_select(0, layout.indices)
