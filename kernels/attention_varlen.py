"""Attention over packed sequences (varlen): each sequence attends only to itself, no padding anywhere.

    qkv [T, 3, H, D] (the fused QKV GEMM's output of T packed tokens), cu_seqlens [B + 1] int32 -> out [T, H, D]

The kernel is ``attention.py``'s (its VARLEN flag): this module holds the layout's reference, its argument contract,
launcher and registered op. A window and MPNet's relative bias measure distances between the tokens' ``columns`` in
the padded batch (holes in a mask make them differ from offsets), or between offsets without them.
"""

import torch

from ._common import check_last_dim_contiguous, launch_or_op
from .attention import _attention_launch, attention_ref
from .attention_args import _check_qkv, _check_relative_bias, _check_tables, _check_window


def attention_varlen_ref(
    qkv: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, upcast: bool = True, window: int | None = None,
    columns: torch.Tensor | None = None, relative_bias: torch.Tensor | None = None, c2p: torch.Tensor | None = None,
    p2c: torch.Tensor | None = None, rel_index: torch.Tensor | None = None, scale: float | None = None,
) -> torch.Tensor:
    """Varlen layout: each sequence cu_seqlens[i]:cu_seqlens[i+1] attends only to itself (with ``window`` and
    ``relative_bias`` as ``attention_ref``'s, measured between ``columns`` [T] entries, else offsets; DeBERTa's
    tables [H, T, R] by offsets: ``fastbert/ops/disentangled.py``'s ``attention_ref`` measures between columns)."""
    out = torch.empty_like(qkv[:, 0])
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end > start:
            cols = None if columns is None else columns[None, start:end].long()
            rows = slice(start, end)
            out[start:end] = attention_ref(qkv[None, start:end], upcast=upcast, window=window, columns=cols,
                                           relative_bias=relative_bias, c2p=None if c2p is None else c2p[:, rows],
                                           p2c=None if p2c is None else p2c[:, rows], rel_index=rel_index,
                                           scale=scale)[0]
    return out


def _check_attention_varlen(qkv: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
                            window: int | None = None, columns: torch.Tensor | None = None,
                            relative_bias: torch.Tensor | None = None, c2p=None, p2c=None, rel_index=None,
                            scale=None) -> None:
    _check_qkv(qkv, "varlen")
    _check_window(window)
    _check_relative_bias(relative_bias, qkv)
    _check_tables(qkv, qkv.shape[0], max_seqlen if isinstance(max_seqlen, int) else 0, c2p, p2c, rel_index, scale)
    if columns is not None:
        if window is None and relative_bias is None and c2p is None and p2c is None:
            raise ValueError("columns are the tokens' positions for a window or a relative bias: pass one of them")
        if not isinstance(columns, torch.Tensor) or columns.dtype != torch.int32:
            raise TypeError(f"columns must be an int32 tensor, got {getattr(columns, 'dtype', type(columns).__name__)}")
        if tuple(columns.shape) != (qkv.shape[0],) or not columns.is_contiguous():
            raise ValueError(f"columns must be contiguous [tokens] = ({qkv.shape[0]},), got {tuple(columns.shape)}")
        if columns.device != qkv.device:
            raise ValueError(f"columns is on {columns.device} but qkv is on {qkv.device}")
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype != torch.int32:
        raise TypeError(f"cu_seqlens must be an int32 tensor, got "
                        f"{getattr(cu_seqlens, 'dtype', type(cu_seqlens).__name__)}")
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 1:
        raise ValueError(f"cu_seqlens must be [batch + 1], got shape {tuple(cu_seqlens.shape)}")
    check_last_dim_contiguous("cu_seqlens", cu_seqlens)  # the kernel reads CU_SEQLENS + batch: no stride
    if cu_seqlens.device != qkv.device:
        raise ValueError(f"cu_seqlens is on {cu_seqlens.device} but qkv is on {qkv.device}")
    if not isinstance(max_seqlen, int) or max_seqlen < 0:
        raise ValueError(f"max_seqlen must be a non-negative int, got {max_seqlen!r}")


def _attention_varlen_launch(qkv: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, window=None,
                             columns=None, relative_bias=None, c2p=None, p2c=None, rel_index=None,
                             scale=None) -> torch.Tensor:
    _check_attention_varlen(qkv, cu_seqlens, max_seqlen, window, columns, relative_bias, c2p, p2c, rel_index, scale)
    tokens, _, heads, head_dim = qkv.shape
    out = torch.empty((tokens, heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    return _attention_launch(qkv, out, None, None, cu_seqlens, max_seqlen, cu_seqlens.shape[0] - 1, 0, window,
                             columns, relative_bias, c2p, p2c, rel_index, scale)


@torch.library.custom_op("fastbert::attention_varlen", mutates_args=())
def _attention_varlen_op(qkv: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, window: int | None,
                         columns: torch.Tensor | None, relative_bias: torch.Tensor | None,
                         c2p: torch.Tensor | None = None, p2c: torch.Tensor | None = None,
                         rel_index: torch.Tensor | None = None, scale: float | None = None) -> torch.Tensor:
    return _attention_varlen_launch(qkv, cu_seqlens, max_seqlen, window, columns, relative_bias, c2p, p2c, rel_index,
                                    scale)


@_attention_varlen_op.register_fake
def _(qkv, cu_seqlens, max_seqlen, window, columns, relative_bias, c2p=None, p2c=None, rel_index=None, scale=None):
    _check_attention_varlen(qkv, cu_seqlens, max_seqlen, window, columns, relative_bias, c2p, p2c, rel_index, scale)
    tokens, _, heads, head_dim = qkv.shape
    return qkv.new_empty((tokens, heads, head_dim))


def attention_varlen(qkv: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, window: int | None = None,
                     columns: torch.Tensor | None = None, relative_bias: torch.Tensor | None = None,
                     c2p: torch.Tensor | None = None, p2c: torch.Tensor | None = None,
                     rel_index: torch.Tensor | None = None, scale: float | None = None) -> torch.Tensor:
    """Packed layout: qkv [T, 3, H, D] (strided like ``attention``), cu_seqlens [B + 1] int32, contiguous, with
    cu_seqlens[0] = 0, cu_seqlens[-1] = T, non-decreasing (empty sequences allowed), max_seqlen >= the longest
    sequence (not checked: that would need a device sync; rows past max_seqlen would be left unwritten)
    -> out [T, H, D], contiguous. Same semantics as ``attention_varlen_ref``.
    window, relative_bias: as ``attention``'s, the distance measured between ``columns`` (int32 [T], contiguous,
    non-decreasing within each sequence: the tokens' columns in the padded batch, which holes in a mask make differ
    from their offsets) or, without them, between offsets in the sequence. c2p, p2c, rel_index, scale: DeBERTa's
    tables over the T tokens (``attention``'s), the distances measured the same way.
    """
    return launch_or_op(_attention_varlen_launch, _attention_varlen_op, qkv, cu_seqlens, max_seqlen, window, columns,
                        relative_bias, c2p, p2c, rel_index, scale)
