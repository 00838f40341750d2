"""LayerNorm with fused inputs: ``LayerNorm(x + bias + residual)`` and ``LayerNorm(act(x + bias))``.

The first follows the attention-output and FFN-output GEMMs (BertSelfOutput, BertOutput), the second is the MLM head
transform (BertPredictionHeadTransform: dense -> act -> LayerNorm). The GEMMs run without their bias; it is added here.
x, residual: [tokens, hidden]; bias, weight, ln_bias: [hidden]. Statistics in fp32 whatever the I/O dtype.
"""

import torch
import torch.nn.functional as F

from ._common import (calculate_settings, check_float, check_last_dim_contiguous, check_like, for_device,
                      launch_or_op, tl, triton)
from .activation import _apply_activation, activation_kind, activation_ref


def layer_norm_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    ln_bias: torch.Tensor,
    eps: float,
    *,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    activation: str | None = None,
    upcast: bool = False,
) -> torch.Tensor:
    """LayerNorm(act(x + bias) + residual); every input optional but x, weight, ln_bias."""
    dtype = x.dtype
    if upcast:
        x, weight, ln_bias = x.float(), weight.float(), ln_bias.float()
        bias = None if bias is None else bias.float()
        residual = None if residual is None else residual.float()
    if bias is not None:
        x = x + bias
    if activation is not None:
        x = activation_ref(x, activation)
    if residual is not None:
        x = x + residual
    return F.layer_norm(x, x.shape[-1:], weight, ln_bias, eps).to(dtype)


# ---------------------------------------------------------------------------------------------------------------
# Triton
#
# One program per row of H elements, all math in fp32:
#   z    = act(x + bias) + residual          (each step only if its flag is set)
#   mean = sum(z) / H
#   d    = z - mean;   d -= sum(d) / H        (corrected two-pass over registers, see _normalize_row)
#   var  = sum(d^2) / H                       (biased, as torch.nn.LayerNorm)
#   y    = d / sqrt(var + eps) * weight + ln_bias
# ---------------------------------------------------------------------------------------------------------------


@triton.jit
def _normalize_row(
    z,  # fp32 row [BLOCK_N], 0 past n_cols (the mean sums every column)
    W,  # pointer to the LayerNorm weight [H]
    B,  # pointer to the LayerNorm bias [H]
    cols,  # tl.arange(0, BLOCK_N)
    mask,  # cols < n_cols
    n_cols,  # H
    eps,  # added to the variance
):
    """The LayerNorm of one row, in fp32 (the math above); also the end of the embedding kernel.

    The centred row is corrected by its own mean (corrected two-pass). That removes the rounding of the first sum
    (rows with a large mean) and the common part of what contraction leaves in ``diff``: the product that ends an
    activation becomes ``fma(a, b, -mean)``, so each ``diff`` carries that product's rounding error, which the mean
    was computed without. Those errors are ~1 ulp of ``z`` and matter where the variance is tiny (a constant row, a
    single column), where rstd = 1/sqrt(eps) multiplies them by up to 1e6. The divisions round to nearest (Triton's
    ``/`` is approximate on GPUs): a constant row's mean is then its value exactly."""
    n = n_cols * 1.0
    mean = tl.div_rn(tl.sum(z, axis=0), n)
    diff = tl.where(mask, z - mean, 0.0)  # padding columns must not count in the variance
    diff = tl.where(mask, diff - tl.div_rn(tl.sum(diff, axis=0), n), 0.0)
    var = tl.div_rn(tl.sum(diff * diff, axis=0), n)
    rstd = 1.0 / tl.sqrt(var + eps)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
    return diff * rstd * w + b


@triton.jit
def _layer_norm_kernel(
    X,  # pointer to the input [n_rows, H], last dim contiguous
    RESIDUAL,  # pointer to the residual [n_rows, H], last dim contiguous (read only if HAS_RESIDUAL)
    BIAS,  # pointer to the bias added to x [H] (read only if HAS_BIAS)
    W,  # pointer to the LayerNorm weight [H]
    B,  # pointer to the LayerNorm bias [H]
    Y,  # pointer to the output [n_rows, H], contiguous
    stride_x,  # elements between consecutive rows of X
    stride_res,  # elements between consecutive rows of RESIDUAL
    n_cols,  # H, the normalized size
    eps,  # added to the variance
    HAS_BIAS: tl.constexpr,  # z = x + bias
    HAS_RESIDUAL: tl.constexpr,  # z += residual (after the activation)
    ACTIVATION: tl.constexpr,  # "none" or a value of activation.ACTIVATIONS, applied to x + bias
    BLOCK_N: tl.constexpr,  # H rounded up to a power of two
):
    row = tl.program_id(0).to(tl.int64)  # row * stride can pass 2**31 for large batches
    cols = tl.arange(0, BLOCK_N)
    mask = cols < n_cols
    z = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        z += tl.load(BIAS + cols, mask=mask, other=0.0).to(tl.float32)
    z = _apply_activation(z, ACTIVATION)
    if HAS_RESIDUAL:
        z += tl.load(RESIDUAL + row * stride_res + cols, mask=mask, other=0.0).to(tl.float32)
    y = _normalize_row(z, W, B, cols, mask, n_cols, eps)
    tl.store(Y + row * n_cols + cols, y.to(Y.dtype.element_ty), mask=mask)


def _check_layer_norm(x, weight, ln_bias, eps, bias, residual, activation) -> str:
    kind = "none" if activation is None else activation_kind(activation)
    check_float("x", x)
    if x.dim() != 2:
        raise ValueError(f"x must be [tokens, hidden], got shape {tuple(x.shape)}")
    check_last_dim_contiguous("x", x)
    hidden = x.shape[1]
    check_like("weight", weight, "x", x, (hidden,))
    check_like("ln_bias", ln_bias, "x", x, (hidden,))
    if bias is not None:
        check_like("bias", bias, "x", x, (hidden,))
    if residual is not None:
        check_like("residual", residual, "x", x, tuple(x.shape))
        check_last_dim_contiguous("residual", residual)
    if not isinstance(eps, (int, float)) or not eps >= 0:
        raise ValueError(f"eps must be a non-negative float, got {eps!r}")
    return kind


def _layer_norm_launch(x, weight, ln_bias, eps, bias, residual, activation) -> torch.Tensor:
    kind = _check_layer_norm(x, weight, ln_bias, eps, bias, residual, activation)
    n_rows, hidden = x.shape
    out = torch.empty((n_rows, hidden), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    block_n, num_warps = calculate_settings(hidden)
    # [hidden] vectors: make them unit-stride (a no-op for nn.Parameters, a negligible copy otherwise).
    weight, ln_bias = weight.contiguous(), ln_bias.contiguous()
    bias = None if bias is None else bias.contiguous()
    for_device(_layer_norm_kernel, x.device)[(n_rows,)](
        x,
        x if residual is None else residual,  # dummy pointers when absent: never read
        x if bias is None else bias,
        weight,
        ln_bias,
        out,
        x.stride(0),
        0 if residual is None else residual.stride(0),
        hidden,
        float(eps),
        HAS_BIAS=bias is not None,
        HAS_RESIDUAL=residual is not None,
        ACTIVATION=kind,
        BLOCK_N=block_n,
        num_warps=num_warps,
    )
    return out


@torch.library.custom_op("fastbert::layer_norm", mutates_args=())
def _layer_norm_op(
    x: torch.Tensor,
    weight: torch.Tensor,
    ln_bias: torch.Tensor,
    eps: float,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    activation: str | None,
) -> torch.Tensor:
    return _layer_norm_launch(x, weight, ln_bias, eps, bias, residual, activation)


@_layer_norm_op.register_fake
def _(x, weight, ln_bias, eps, bias, residual, activation):
    _check_layer_norm(x, weight, ln_bias, eps, bias, residual, activation)
    return x.new_empty(x.shape)


def layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    ln_bias: torch.Tensor,
    eps: float,
    *,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    activation: str | None = None,
) -> torch.Tensor:
    """``LayerNorm(act(x + bias) + residual)`` in one pass; same semantics as ``layer_norm_ref(..., upcast=True)``.

    x, residual: [tokens, hidden], last dim contiguous (any row stride); weight, ln_bias, bias: [hidden];
    all of x's dtype (float32/float16/bfloat16) and device. activation: None or a key of ``ACTIVATIONS``.
    Returns a new contiguous [tokens, hidden] tensor in x's dtype; mean and variance are computed in fp32.
    CUDA tensors run the compiled kernel, CPU tensors Triton's interpreter (slow: for tests).
    """
    return launch_or_op(_layer_norm_launch, _layer_norm_op, x, weight, ln_bias, eps, bias, residual, activation)
