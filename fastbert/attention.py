"""Attention over a token layout: softmax(q k^T / sqrt(d)) v per head, over each sequence's real tokens, by the
backend ``dispatch`` picks: the Triton flash-attention kernel (``kernels/attention.py``; padded with a key mask and
key bounds, or varlen over packed tokens), the C++ CPU kernel (``csrc/attention_cpu.h``; float32 inference over
packed tokens or a batch without padding) or torch SDPA (dense with an additive mask; packed per sequence on CPU,
or scattered into one masked SDPA over the padded batch on a GPU).
"""

import torch
import torch.nn.functional as F

from . import _extension, announce, dispatch
from .kernels import attention as attention_kernels
from .padding import TokenLayout
from .plan import decided


def attention(qkv: torch.Tensor, layout: TokenLayout, num_heads: int, dropout_p: float = 0.0,
              window: int | None = None) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) + bias) v per head, over each sequence's real tokens.

    qkv: [rows, 3 * hidden] straight from the fused QKV GEMM -> [rows, hidden] (rows: the layout's tokens, then its
    spare rows, which come out zero). Distances below are between columns (places in the padded [B, S] batch; a
    packed layout whose mask has holes carries them in ``layout.columns``): window: None, or the largest distance between a query and a key it
    attends to (ModernBERT's local layers). The bias: ``layout.relative_bias``, None or float32 [H, 2R + 1], the
    bias of the distance j - i clamped to [-R, R] (MPNet's relative positions, shared by every layer).
    """
    tokens, hidden = layout.tokens, qkv.shape[1] // 3
    head_dim = hidden // num_heads
    # (the same decision for every layer with the same arguments)
    bias = layout.relative_bias  # (a trainable bias needs the differentiable path too)
    backend, warning = decided(None, ("attention", qkv.requires_grad, bias is not None and bias.requires_grad,
                                      dropout_p, head_dim), _attention_backend, qkv, bias, dropout_p, head_dim)
    if warning is not None:
        announce.fallback(warning)
    real = qkv[:tokens] if layout.spare_rows else qkv
    out = _attention(real.view(tokens, 3, num_heads, head_dim), layout, dropout_p, backend, window)
    out = out.reshape(tokens, hidden)  # (SDPA's math backend, for dropout and float64, returns [B, H, S, D] memory)
    return torch.cat([out, out.new_zeros(layout.spare_rows, hidden)]) if layout.spare_rows else out


def _attention(heads: torch.Tensor, layout: TokenLayout, dropout_p: float, backend: str,
               window: int | None) -> torch.Tensor:
    """heads [N, 3, H, D] -> [N, H, D] (or [B, S, H, D]) by ``backend``, for the layout."""
    relative_bias = layout.relative_bias
    columns = layout.columns if window is not None or relative_bias is not None else None
    if backend == "triton":
        if layout.packed:
            return attention_kernels.attention_varlen(heads, layout.cu_seqlens, layout.max_seqlen, window, columns,
                                                      relative_bias)
        padded = heads.view(layout.batch, layout.seq_len, *heads.shape[1:])
        return attention_kernels.attention(padded, layout.key_padding_mask, layout.key_bounds, window, relative_bias)
    if backend == "cpu-ext":
        if layout.packed:
            return _extension.attention_cpu(heads, layout.seqlens, relative_bias, window, columns)
        if _every_key_real(layout):  # dense with every token real: batch sequences of seq_len rows each
            return _extension.attention_cpu(heads, (layout.seq_len,) * layout.batch, relative_bias, window)
        # (a dense layout with padding, unpad=False, keeps its padded rows: torch's masked SDPA below)
    if layout.packed:
        if heads.device.type == "cuda":  # (a loop of small SDPA calls would be host-bound on a GPU)
            return _attention_packed_via_padded_sdpa(heads, layout, dropout_p, window)
        return _attention_varlen_sdpa(heads, layout, dropout_p, window)
    return _attention_sdpa(heads, layout, dropout_p, window)


def _every_key_real(layout: TokenLayout) -> bool:
    """Whether a dense CPU layout has no padding: no mask, or one of ones (unpad=False; a host read, so that it runs
    as without the mask, bit for bit). A compiled graph keeps the masked path rather than branch on the data."""
    mask = layout.key_mask()
    return mask is None or (not torch.compiler.is_compiling() and bool(mask.all()))


def _band(columns: torch.Tensor, window: int) -> torch.Tensor:
    """columns [..., S] -> [..., S, S] bool: True where the query's and the key's columns are within ``window``."""
    return (columns[..., :, None] - columns[..., None, :]).abs() <= window


def _relative(relative_bias: torch.Tensor, columns: torch.Tensor | None, length: int,
              dtype: torch.dtype) -> torch.Tensor:
    """relative_bias [H, 2R + 1] -> [H, L, L] in ``dtype``: the bias of each key's distance to each query, clamped to
    [-R, R]. columns: the L tokens' columns [L], or None for a run of consecutive columns (no hole in the mask)."""
    radius = (relative_bias.shape[1] - 1) // 2
    if columns is None:
        # Toeplitz: entry [i, j] depends on j - i only, so every row is a window onto one line of the 2L - 1
        # distances, line[k] = bias of distance (L - 1) - k; row i, column j is line[i + (L - 1 - j)]. Windows and a
        # flip copy [H, L, L] once, about 10x faster than gathering it by an [L, L] index (per layer, per sequence).
        distance = torch.arange(length - 1, -length, -1, device=relative_bias.device)
        line = relative_bias[:, distance.clamp(-radius, radius) + radius]  # [H, 2L - 1]
        return line.unfold(1, length, 1).flip(2).to(dtype)
    distance = columns[None, :] - columns[:, None]  # [L_q, L_k]: key column - query column
    return relative_bias[:, distance.clamp(-radius, radius) + radius].to(dtype)


def _attention_backend(qkv: torch.Tensor, relative_bias: torch.Tensor | None, dropout_p: float,
                       head_dim: int) -> tuple[str, str | None]:
    why = dispatch.why_reference(qkv, relative_bias, dropout_p=dropout_p)
    backend, warning = dispatch.resolve("attention", qkv, why)
    if backend == "triton" and head_dim > attention_kernels.MAX_HEAD_DIM:
        # The Triton kernel refuses D > MAX_HEAD_DIM (ValueError): such a model must take SDPA on a GPU, not crash.
        why = f"head_dim {head_dim} exceeds the Triton attention kernel's {attention_kernels.MAX_HEAD_DIM}"
        return dispatch.resolve("attention", qkv, why)
    return backend, warning


def _additive(keep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bool keep mask -> additive float mask with the dtype's most negative finite value where False (as HF does): a
    fully masked row then averages its values instead of producing NaN, and cannot poison other rows."""
    return torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill_(~keep, torch.finfo(dtype).min)


def _attention_sdpa(heads: torch.Tensor, layout: TokenLayout, dropout_p: float,
                    window: int | None = None) -> torch.Tensor:
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
    if layout.relative_bias is not None:  # [1, H, S, S] added to the scores; a window, where given, masks after it
        bias = _relative(layout.relative_bias, None, layout.seq_len, q.dtype)[None]
        mask = bias if mask is None else (bias + mask if mask.dtype != torch.bool
                                          else bias.masked_fill(~mask, torch.finfo(q.dtype).min))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)  # [B, H, S, D]
    return out.transpose(1, 2)


def _attention_varlen_sdpa(heads: torch.Tensor, layout: TokenLayout, dropout_p: float,
                           window: int | None = None) -> torch.Tensor:
    """Packed layout on CPU through torch: SDPA on each sequence's rows (views, no padding back to the max).

    heads: [T, 3, H, D] -> [T, H, D]. One SDPA per sequence: on CPU each call is large enough that the loop costs
    little, and no FLOP is spent on padding. With a window or a relative bias, each sequence gets a mask from its
    tokens' ``layout.columns`` [T] (or their offsets).
    """
    outputs, seqlens = [], list(layout.seqlens)
    columns = layout.columns if window is not None or layout.relative_bias is not None else None
    chunks = columns.split(seqlens) if columns is not None else [None] * len(seqlens)
    for chunk, cols in zip(heads.split(seqlens), chunks):
        q, k, v = chunk.permute(1, 2, 0, 3)[:, None]  # [1, H, L, D] each
        length, mask = chunk.shape[0], None
        if window is not None:  # (every query sees itself: no row is fully masked)
            mask = _band(torch.arange(length, device=chunk.device) if cols is None else cols, window)  # [L, L] bool
        if layout.relative_bias is not None:
            bias = _relative(layout.relative_bias, cols, length, q.dtype)[None]  # [1, H, L, L]
            mask = bias if mask is None else bias.masked_fill(~mask, torch.finfo(q.dtype).min)
        outputs.append(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)[0]
                       .transpose(0, 1))
    return torch.cat(outputs) if outputs else heads.new_empty(0, *heads.shape[2:])


def _attention_packed_via_padded_sdpa(heads: torch.Tensor, layout: TokenLayout, dropout_p: float,
                                      window: int | None = None) -> torch.Tensor:
    """Packed layout through one masked SDPA over the padded batch (GPU training, or a head dim the Triton kernel
    does not take): heads [T, 3, H, D] -> [T, H, D]. Differentiable: the scatter into the padded buffer and the gather
    back are index ops; every other op of the layer still runs on the T real tokens only."""
    batch, seq_len = layout.batch, layout.seq_len
    padded = heads.new_zeros(batch * seq_len, *heads.shape[1:]).index_copy(0, layout.indices, heads)
    real = torch.zeros(batch * seq_len, dtype=torch.bool, device=heads.device).index_fill_(0, layout.indices, True)
    dense = TokenLayout(batch, seq_len, key_padding_mask=real.view(batch, seq_len), relative_bias=layout.relative_bias)
    out = _attention_sdpa(padded, dense, dropout_p, window)  # [B, S, H, D] (by index: by column)
    return out.reshape(batch * seq_len, *out.shape[2:]).index_select(0, layout.indices)
