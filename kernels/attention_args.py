"""The attention kernels' argument contract (``attention.py``'s padded op and ``attention_varlen.py``'s): what each
launcher and registered op (fake tensors too) checks before a kernel runs, metadata only (no device read)."""

import math

import torch

from ._common import check_float, check_last_dim_contiguous

MAX_HEAD_DIM = 128


_QKV_LAYOUTS = {"padded": (5, "[batch, seq_len, 3, heads, head_dim]"), "varlen": (4, "[tokens, 3, heads, head_dim]")}


def _check_qkv(qkv: torch.Tensor, layout: str) -> None:
    ndim, shape = _QKV_LAYOUTS[layout]
    check_float("qkv", qkv)
    if qkv.dim() != ndim or qkv.shape[-3] != 3:
        raise ValueError(f"qkv must be {shape}, got shape {tuple(qkv.shape)}")
    if not 1 <= qkv.shape[-1] <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be in [1, {MAX_HEAD_DIM}], got {qkv.shape[-1]}")
    check_last_dim_contiguous("qkv", qkv)


def _check_window(window: int | None) -> None:
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 0):
        raise ValueError(f"window must be None or a non-negative int (the largest distance attended), got {window!r}")


def _check_relative_bias(relative_bias: torch.Tensor | None, qkv: torch.Tensor) -> None:
    if relative_bias is None:
        return
    if not isinstance(relative_bias, torch.Tensor) or relative_bias.dtype != torch.float32:
        raise TypeError(f"relative_bias must be a float32 tensor, got "
                        f"{getattr(relative_bias, 'dtype', type(relative_bias).__name__)}")
    heads = qkv.shape[-2]
    if relative_bias.dim() != 2 or relative_bias.shape[0] != heads or relative_bias.shape[1] % 2 == 0:
        raise ValueError(f"relative_bias must be [heads, 2 * radius + 1] = [{heads}, odd], got "
                         f"{tuple(relative_bias.shape)}")
    if not relative_bias.is_contiguous() or relative_bias.device != qkv.device:
        raise ValueError(f"relative_bias must be contiguous and on qkv's device {qkv.device}, got "
                         f"{relative_bias.device}")


def _check_tables(qkv: torch.Tensor, tokens: int, longest: int, c2p, p2c, rel_index, scale) -> None:
    """DeBERTa's tables: [H, tokens, R] each in qkv's dtype or float32, contiguous, on qkv's device, an int32 index
    [2C + 1] with C >= longest - 1; a scale (None: 1 / sqrt(D)). (The index's values, rows in [0, R), are not read here: that would
    be a device sync; ``fastbert/ops/disentangled.py`` builds them.)"""
    if scale is not None and (not isinstance(scale, float) or not 0 < scale < math.inf):
        raise ValueError(f"scale must be None or a positive float, got {scale!r}")
    if c2p is None and p2c is None:
        if rel_index is not None:
            raise ValueError("rel_index comes with c2p or p2c")
        return
    heads, first = qkv.shape[-2], c2p if c2p is not None else p2c
    rows = first.shape[-1] if isinstance(first, torch.Tensor) else None
    for name, table in (("c2p", c2p), ("p2c", p2c)):
        if table is None:
            continue
        if not isinstance(table, torch.Tensor) or table.dtype not in (qkv.dtype, torch.float32):
            raise TypeError(f"{name} must be a {qkv.dtype} or float32 tensor, got "
                            f"{getattr(table, 'dtype', type(table).__name__)}")
        if tuple(table.shape) != (heads, tokens, rows) or not table.is_contiguous() or table.device != qkv.device:
            raise ValueError(f"{name} must be contiguous [heads, tokens, rows] = [{heads}, {tokens}, {rows}] on "
                             f"{qkv.device}, got {tuple(table.shape)} on {table.device}")
    if not isinstance(rel_index, torch.Tensor) or rel_index.dtype != torch.int32 or rel_index.dim() != 1:
        raise TypeError("rel_index must be an int32 tensor [2 * center + 1] with c2p or p2c")
    if rel_index.shape[0] % 2 == 0 or (rel_index.shape[0] - 1) // 2 < longest - 1 or rel_index.device != qkv.device:
        raise ValueError(f"rel_index must be [2 * center + 1] with center >= {longest - 1} (the longest distance) "
                         f"on {qkv.device}, got {tuple(rel_index.shape)} on {rel_index.device}")


def _check_attention(qkv: torch.Tensor, key_padding_mask: torch.Tensor | None, key_bounds: torch.Tensor | None,
                     window: int | None = None, relative_bias: torch.Tensor | None = None, c2p=None, p2c=None,
                     rel_index=None, scale=None):
    _check_qkv(qkv, "padded")
    _check_window(window)
    _check_relative_bias(relative_bias, qkv)
    _check_tables(qkv, qkv.shape[0] * qkv.shape[1], qkv.shape[1], c2p, p2c, rel_index, scale)
    if key_bounds is not None:
        if not isinstance(key_bounds, torch.Tensor) or key_bounds.dtype != torch.int32:
            raise TypeError(f"key_bounds must be an int32 tensor, got "
                            f"{getattr(key_bounds, 'dtype', type(key_bounds).__name__)}")
        if tuple(key_bounds.shape) != tuple(qkv.shape[:1]):
            raise ValueError(f"key_bounds has shape {tuple(key_bounds.shape)}, expected [batch] = ({qkv.shape[0]},)")
        if key_bounds.device != qkv.device:
            raise ValueError(f"key_bounds is on {key_bounds.device} but qkv is on {qkv.device}")
    if key_padding_mask is not None:
        if not isinstance(key_padding_mask, torch.Tensor) or key_padding_mask.dtype != torch.bool:
            raise TypeError(f"key_padding_mask must be a bool tensor (True = real token), got "
                            f"{getattr(key_padding_mask, 'dtype', type(key_padding_mask).__name__)}")
        if tuple(key_padding_mask.shape) != tuple(qkv.shape[:2]):
            raise ValueError(f"key_padding_mask has shape {tuple(key_padding_mask.shape)}, expected "
                             f"[batch, seq_len] = {tuple(qkv.shape[:2])}")
        if key_padding_mask.device != qkv.device:
            raise ValueError(f"key_padding_mask is on {key_padding_mask.device} but qkv is on {qkv.device}")
