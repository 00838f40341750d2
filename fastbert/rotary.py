"""Rotary position embeddings (RoPE) of the q and k heads in the packed QKV, by the backend ``dispatch`` picks: the
in-place Triton kernel (``kernels/rope.py``) or the torch reference (transformers' math, differentiable).

The (cos, sin) tables are built once per forward from the tokens' positions (``tables``) and travel with the
layout (``TokenLayout.rotary``): every layer reads the same ones, and packed rows carry their own positions.
"""

import torch
from torch import nn

from . import announce, dispatch
from .kernels import rope as rope_kernels
from .padding import TokenLayout
from .plan import decided

# transformers' RoPE types whose frequencies change with the input's length (``dynamic_rope_update``): the tables
# would have to follow that rule per call; such models run transformers' forward.
_LENGTH_DEPENDENT = ("dynamic", "longrope")


def why_not_static(rope_type: str | None) -> str | None:
    """Why a rotary embedding of ``rope_type`` (config ``rope_parameters["rope_type"]``) is not accelerated, or None
    when its frequencies are fixed at init (default, linear, yarn, llama3, ...: read from the module's buffers)."""
    if rope_type and any(kind in rope_type for kind in _LENGTH_DEPENDENT):
        return f"rope_type {rope_type!r} (frequencies that depend on the sequence length)"
    return None


def tables(rotary_embedding: nn.Module, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' rotary module (``inv_freq`` [D/2] buffer, ``attention_scaling``) and positions [N] -> (cos, sin),
    float32 [N, D/2] each: the module's own values, half width."""
    return rope_kernels.rotary_tables(positions, rotary_embedding.inv_freq, rotary_embedding.attention_scaling)


def rotary(qkv: torch.Tensor, layout: TokenLayout, num_heads: int) -> torch.Tensor:
    """qkv [rows, 3 * hidden] with q and k rotated by the layout's tables (``layout.rotary``). The Triton kernel
    rotates in place (qkv is the QKV GEMM's fresh output); the torch path returns a new tensor."""
    backend, warning = decided(None, ("rotary", qkv.requires_grad), _rotary_backend, qkv)
    if warning is not None:
        announce.fallback(warning)
    cos, sin = layout.rotary
    if backend == "triton":
        return rope_kernels.rotary_(qkv, cos, sin, num_heads)
    return rope_kernels.rotary_ref(qkv, cos, sin, num_heads)


def _rotary_backend(qkv: torch.Tensor) -> tuple[str, str | None]:
    return dispatch.resolve("rotary", qkv, dispatch.why_reference(qkv))
