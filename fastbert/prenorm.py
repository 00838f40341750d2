"""The ops of a pre-norm block (ModernBERT): the residual stream is added to, and each sub-block reads its own
LayerNorm of it.

    h = norm(x)                        ``layer_norm``     (ModernBERT's layer 0: Identity, no op)
    x = x + dropout(dense(f(h)))       ``dense_residual`` (the residual added in the GEMM's epilogue where the backend
                                                          has one: oneDNN on CPU; the sum is written once)

The sum and its normalization are two outputs the block needs (the next sub-block reads both); the GEMM writes the
sum and the LayerNorm reads it once, so a kernel storing both from one pass would move the same bytes.
"""

import torch
from torch import nn

from . import dispatch, ops
from .kernels import layer_norm as layer_norm_kernels
from .plain import has_hooks
from .plan import decided


def layer_norm(x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    """norm(x) for x [tokens, hidden]: a plain LayerNorm (with or without bias) fused, nn.Identity passed through,
    anything else called."""
    return decided(norm, "layer_norm", _how_layer_norm, x, norm)(x)


def _how_layer_norm(x: torch.Tensor, norm: nn.Module):
    if type(norm) is nn.Identity and not has_hooks(norm):
        return lambda x: x
    why = dispatch.why_reference(x, getattr(norm, "weight", None), getattr(norm, "bias", None))
    why = why or ops.why_not_plain(x.device, norm=(norm, nn.LayerNorm))
    backend, warning = dispatch.resolve("layer_norm", x, why)
    if backend == "triton":
        return ops.counted(lambda x: layer_norm_kernels.layer_norm(x, norm.weight, ops.ln_bias(norm), norm.eps),
                           warning)
    return ops.counted(ops.layer_norm_call(norm, x.device), warning)


def dense_residual(x: torch.Tensor, residual: torch.Tensor, dense: nn.Module, dropout: nn.Module | None,
                   ) -> torch.Tensor:
    """residual + dropout(dense(x)): x [tokens, in], residual [tokens, out]. ``dropout``: nn.Dropout, nn.Identity or
    None."""
    return decided(dense, "dense_residual", _how_dense_residual, x, residual, dense, dropout)(x, residual)


def _how_dense_residual(x, residual, dense, dropout):
    p = getattr(dropout, "p", 0.0) if dropout is not None and dropout.training else 0.0
    trivial = dropout is None or (p == 0 and not has_hooks(dropout))
    why = dispatch.why_reference(x, getattr(dense, "weight", None), getattr(dense, "bias", None), residual,
                                 dropout_p=p)
    fused = ops.onednn_gemm(x, dense, why) if trivial else None
    if fused is not None:
        return fused  # (x, residual) -> dense(x) + residual, the add in oneDNN's epilogue
    if trivial:
        return lambda x, residual: ops.linear(x, dense) + residual
    return lambda x, residual: dropout(ops.linear(x, dense)) + residual
