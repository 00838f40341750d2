"""Rotary position embeddings (RoPE) of the q and k heads in the packed QKV.

    qkv [rows, 3 * hidden], cos and sin [rows, head_dim / 2] (each row's own) -> qkv with q and k rotated

Reference: ``kernels/rope.py``'s ``rotary_ref`` (transformers' math, NeoX ``rotate_half``). The (cos, sin) tables are
built once per forward from the tokens' positions (``tables``) and travel beside the layout (``positions.Positions``):
every layer reads the same ones, and packed rows carry their own positions. Backends: triton (the in-place kernel,
``kernels/rope.py``), torch (the reference's math in fp32, differentiable). Both compute in fp32 and round once:
ModernBERT rotates in fp32 too; GTE and NomicBERT in the activations' dtype (the same values in fp32; in 16-bit ours
round once where theirs round per operation).
"""

import dataclasses

import torch
from torch import nn

from .. import dispatch
from ..dispatch import Backend
# (fastbert.kernels: the repository's top-level kernels/ folder, installed under that name by setup.py)
from ..kernels import rope as rope_kernels
from ..plan import decided

# The name of a model's only table (GTE, NomicBERT); ModernBERT names its tables by attention type.
DEFAULT = "default"


def tables(rotary_embedding: nn.Module, positions: torch.Tensor, name: str = DEFAULT,
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' rotary module and positions [N] -> (cos, sin), float32 [N, D/2] each: the module's own values,
    half width. It holds ``inv_freq`` [D/2] and ``attention_scaling``, or, with one table per attention type
    (ModernBERT), ``{name}_inv_freq`` and ``{name}_attention_scaling``."""
    prefix = "" if name == DEFAULT else f"{name}_"
    return rope_kernels.rotary_tables(positions, getattr(rotary_embedding, f"{prefix}inv_freq"),
                                      getattr(rotary_embedding, f"{prefix}attention_scaling"))


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


@dataclasses.dataclass(frozen=True)
class Call:
    reasons: tuple[str, ...]  # gradients: the differentiable reference
    device: torch.device
    dtype: torch.dtype


def _triton_run(call, qkv, cos, sin, num_heads, owned):
    return rope_kernels.rotary_(qkv if owned else qkv.clone(), cos, sin, num_heads)


def _torch_run(call, qkv, cos, sin, num_heads, owned):
    if qkv.requires_grad and torch.is_grad_enabled():
        return rope_kernels.rotary_ref(qkv, cos, sin, num_heads, upcast=True)
    return _rotary_into_new(qkv, cos, sin, num_heads)


BACKENDS = dispatch.register("rotary", [
    Backend("triton", run=_triton_run, unavailable=dispatch.triton_unavailable, why_not=lambda c: list(c.reasons)),
    Backend("torch", run=_torch_run),
])


def _decide(qkv: torch.Tensor):
    return dispatch.decide("rotary", BACKENDS, Call(tuple(dispatch.needs_reference(qkv)), qkv.device, qkv.dtype))


def rotary(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, owned: bool = True,
           ) -> torch.Tensor:
    """qkv [rows, 3 * hidden] with q and k rotated by (cos, sin) [rows, D/2], in fp32. The Triton kernel rotates in
    place when qkv is ``owned`` (the fused GEMM's fresh output), a copy otherwise (a module's output, which a hook may
    hold); the torch path returns a new tensor."""
    decision = decided(None, ("rotary", qkv.requires_grad), _decide, qkv)
    return decision(qkv, cos, sin, num_heads, owned)
