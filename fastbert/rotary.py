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


# The name of a model's only table (GTE, NomicBERT); ModernBERT names its tables by attention type.
DEFAULT = "default"


def why_not_static(rope_type: str | None) -> str | None:
    """Why a rotary embedding of ``rope_type`` (config ``rope_parameters["rope_type"]``) is not accelerated, or None
    when its frequencies are fixed at init (default, linear, yarn, llama3, ...: read from the module's buffers)."""
    if rope_type and any(kind in rope_type for kind in _LENGTH_DEPENDENT):
        return f"rope_type {rope_type!r} (frequencies that depend on the sequence length)"
    return None


def tables(rotary_embedding: nn.Module, positions: torch.Tensor, name: str = DEFAULT,
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' rotary module and positions [N] -> (cos, sin), float32 [N, D/2] each: the module's own values,
    half width. It holds ``inv_freq`` [D/2] and ``attention_scaling``, or, with one table per attention type
    (ModernBERT), ``{name}_inv_freq`` and ``{name}_attention_scaling``."""
    prefix = "" if name == DEFAULT else f"{name}_"
    return rope_kernels.rotary_tables(positions, getattr(rotary_embedding, f"{prefix}inv_freq"),
                                      getattr(rotary_embedding, f"{prefix}attention_scaling"))


def why_not_accelerated(rope_parameters) -> str | None:
    """Why a config's ``rope_parameters`` (one dict, or one per attention type) is not accelerated, or None."""
    if not isinstance(rope_parameters, dict):
        return None
    per_type = [v for v in rope_parameters.values() if isinstance(v, dict)] or [rope_parameters]
    return next((why for why in (why_not_static(p.get("rope_type")) for p in per_type) if why), None)


def rotary(qkv: torch.Tensor, layout: TokenLayout, num_heads: int, table: str = DEFAULT, owned: bool = True,
           ) -> torch.Tensor:
    """qkv [rows, 3 * hidden] with q and k rotated by the layout's tables (``layout.rotary[table]``), in fp32. The
    Triton kernel rotates in place when qkv is ``owned`` (the fused GEMM's fresh output), a copy otherwise (a
    module's output, which a hook may hold); the torch path returns a new tensor."""
    backend, warning = decided(None, ("rotary", qkv.requires_grad), _rotary_backend, qkv)
    if warning is not None:
        announce.fallback(warning)
    cos, sin = layout.rotary[table]
    if backend == "triton":
        return rope_kernels.rotary_(qkv if owned else qkv.clone(), cos, sin, num_heads)
    # fp32 math and one rounding, as the kernel: ModernBERT rotates in fp32 too, GTE and NomicBERT in the activations'
    # dtype (in fp32 the same values; in 16-bit ours round once where theirs round per operation)
    if qkv.requires_grad and torch.is_grad_enabled():
        return rope_kernels.rotary_ref(qkv, cos, sin, num_heads, upcast=True)
    return _rotary_into_new(qkv, cos, sin, num_heads)


def _rotary_into_new(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int) -> torch.Tensor:
    """``rotary_ref(..., upcast=True)`` without autograd, written into one new [N, 3 * hidden] tensor: four passes
    over q and k and a copy of v (the reference's temporaries cost 3.5x: 2.27 vs 0.64 ms for 1024 tokens of
    bert-base width, Zen 4, 2 threads)."""
    tokens = qkv.shape[0]
    x = qkv.view(tokens, 3, num_heads, -1)  # [N, 3, H, D]
    half = x.shape[-1] // 2
    out = torch.empty_like(x)
    out[:, 2] = x[:, 2]  # v
    qk = x[:, :2].float()  # [N, 2, H, D] (a copy only in 16-bit)
    x1, x2 = qk[..., :half], qk[..., half:]
    c, s = cos[:, None, None, :], sin[:, None, None, :]  # [N, 1, 1, D/2]
    rotated = torch.empty_like(qk) if qkv.dtype != torch.float32 else None
    o = out[:, :2] if rotated is None else rotated
    o1, o2 = o[..., :half], o[..., half:]
    torch.mul(x1, c, out=o1).addcmul_(x2, s, value=-1)
    torch.mul(x2, c, out=o2).addcmul_(x1, s)
    if rotated is not None:
        out[:, :2] = rotated  # the one rounding
    return out.view(tokens, -1)


def _rotary_backend(qkv: torch.Tensor) -> tuple[str, str | None]:
    return dispatch.resolve("rotary", qkv, dispatch.why_reference(qkv))
