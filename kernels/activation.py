"""Bias + activation: ``act(x + bias)`` after the intermediate GEMM (which runs without its bias).

x: [tokens, intermediate], bias: [intermediate] -> [tokens, intermediate], same dtype as x.
"""

import math

import torch
import torch.nn.functional as F

from ._common import check_float, check_last_dim_contiguous, check_like, for_device, launch_or_op, tl, triton

# HF ``hidden_act`` name -> the function fastbert computes for it (its kind): the one map of activations, read by this
# kernel, the GLU kernel (glu.py), oneDNN's GEMM epilogues (fastbert/cpu_gemm.py) and the ops (fastbert/ops). "gelu_new"
# and "gelu_pytorch_tanh" are the same tanh approximation written two ways; "gelu" is the exact erf form; "silu" and
# "swish" are both torch's SiLU in transformers.
ACTIVATIONS = {
    "gelu": "gelu_erf",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "relu": "relu",
    "silu": "silu",
    "swish": "silu",
}
# The kinds this module's bias + activation kernel computes, and the names it therefore takes.
BIAS_ACT_KINDS = ("gelu_erf", "gelu_tanh", "relu")
BIAS_ACT_NAMES = tuple(name for name, kind in ACTIVATIONS.items() if kind in BIAS_ACT_KINDS)


def activation_ref(x: torch.Tensor, activation: str) -> torch.Tensor:
    """The activation named ``activation`` (a key of ``ACTIVATIONS``), in x's dtype."""
    kind = ACTIVATIONS[activation]
    if kind == "gelu_erf":
        return F.gelu(x)
    if kind == "gelu_tanh":
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3))))
    return F.relu(x) if kind == "relu" else F.silu(x)


def bias_act_ref(x: torch.Tensor, bias: torch.Tensor | None, activation: str, upcast: bool = False) -> torch.Tensor:
    """act(x + bias) in x's dtype; ``upcast=True`` computes in fp32 (what the kernel does) and rounds once."""
    dtype = x.dtype
    if upcast:
        x, bias = x.float(), None if bias is None else bias.float()
    if bias is not None:
        x = x + bias
    return activation_ref(x, activation).to(dtype)


def activation_kind(activation: str) -> str:
    """The kernel's name for HF's ``hidden_act`` (a name of ``ACTIVATIONS`` of a kind in ``BIAS_ACT_KINDS``);
    ValueError for one it does not compute."""
    if not isinstance(activation, str) or ACTIVATIONS.get(activation) not in BIAS_ACT_KINDS:
        raise ValueError(f"activation {activation!r} is not fused; supported: {', '.join(sorted(BIAS_ACT_NAMES))}")
    return ACTIVATIONS[activation]


# ---------------------------------------------------------------------------------------------------------------
# Triton
#
# With z = x + bias, computed in fp32 whatever the I/O dtype:
#   gelu_erf(z)  = 0.5 z (1 + erf(z / sqrt(2)))                          (exact; HF "gelu", torch F.gelu)
#   gelu_tanh(z) = 0.5 z (1 + tanh(u)),  u = sqrt(2 / pi) (z + 0.044715 z^3)   ("gelu_new", "gelu_pytorch_tanh")
#   relu(z)      = max(z, 0)   (NaN stays NaN, as in torch)
# Triton has no tanh that runs under its interpreter (libdevice calls are extern), so
#   tanh(u) = sign(u) (1 - e) / (1 + e),  e = exp(-2 |u|)  in (0, 1]: no overflow for any u.
# ---------------------------------------------------------------------------------------------------------------


@triton.jit
def _apply_activation(
    x,  # fp32 block
    ACTIVATION: tl.constexpr,  # "none" or a value of ACTIVATIONS: "gelu_erf", "gelu_tanh", "relu"
):
    if ACTIVATION == "gelu_erf":
        x = 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))
    elif ACTIVATION == "gelu_tanh":
        u = 0.7978845608028654 * (x + 0.044715 * x * x * x)
        e = tl.exp(-2.0 * tl.abs(u))
        t = (1.0 - e) / (1.0 + e)
        x = 0.5 * x * (1.0 + tl.where(u >= 0, t, -t))
    elif ACTIVATION == "relu":
        x = tl.where(x < 0, 0.0, x)
    return x


@triton.jit
def _bias_act_kernel(
    X,  # pointer to the input [n_rows, n_cols], last dim contiguous
    BIAS,  # pointer to the bias [n_cols] (read only if HAS_BIAS)
    Y,  # pointer to the output [n_rows, n_cols], contiguous
    n_rows,  # number of rows (tokens)
    n_cols,  # number of columns (intermediate size)
    stride_x,  # elements between consecutive rows of X
    HAS_BIAS: tl.constexpr,  # add BIAS before the activation
    ACTIVATION: tl.constexpr,  # see _apply_activation
    BLOCK_M: tl.constexpr,  # rows per program
    BLOCK_N: tl.constexpr,  # columns per program
):
    # One BLOCK_M x BLOCK_N tile per program.
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n_cols
    mask = (rows < n_rows)[:, None] & col_ok[None, :]
    rows = rows.to(tl.int64)  # rows * stride can pass 2**31 for large batches
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        x += tl.load(BIAS + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    y = _apply_activation(x, ACTIVATION)
    tl.store(Y + rows[:, None] * n_cols + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


# Elements per program of the elementwise kernel: enough work per program to hide memory latency on a GPU,
# few enough programs to keep the interpreter fast.
_TILE = 4096


def tile_grid(n_rows: int, n_cols: int) -> tuple[int, int, tuple[int, int]]:
    """(BLOCK_M, BLOCK_N, grid) of an elementwise kernel over [n_rows, n_cols] in tiles of about ``_TILE`` elements:
    up to 1024 columns per program, as many rows as fill the tile."""
    block_n = min(triton.next_power_of_2(n_cols), 1024)
    block_m = max(1, _TILE // block_n)
    return block_m, block_n, (triton.cdiv(n_rows, block_m), triton.cdiv(n_cols, block_n))


def _check_bias_act(x: torch.Tensor, bias: torch.Tensor | None, activation: str) -> str:
    kind = activation_kind(activation)
    check_float("x", x)
    if x.dim() != 2:
        raise ValueError(f"x must be [tokens, features], got shape {tuple(x.shape)}")
    check_last_dim_contiguous("x", x)
    if bias is not None:
        check_like("bias", bias, "x", x, (x.shape[1],))
    return kind


def _bias_act_launch(x: torch.Tensor, bias: torch.Tensor | None, activation: str) -> torch.Tensor:
    kind = _check_bias_act(x, bias, activation)
    n_rows, n_cols = x.shape
    out = torch.empty((n_rows, n_cols), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    bias = None if bias is None else bias.contiguous()  # [features]: a no-op for an nn.Parameter
    block_m, block_n, grid = tile_grid(n_rows, n_cols)
    for_device(_bias_act_kernel, x.device)[grid](
        x,
        x if bias is None else bias,  # a dummy pointer when there is no bias: never read
        out,
        n_rows,
        n_cols,
        x.stride(0),
        HAS_BIAS=bias is not None,
        ACTIVATION=kind,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        num_warps=4,
    )
    return out


@torch.library.custom_op("fastbert::bias_act", mutates_args=())
def _bias_act_op(x: torch.Tensor, bias: torch.Tensor | None, activation: str) -> torch.Tensor:
    return _bias_act_launch(x, bias, activation)


@_bias_act_op.register_fake
def _(x, bias, activation):
    _check_bias_act(x, bias, activation)
    return x.new_empty(x.shape)


def bias_act(x: torch.Tensor, bias: torch.Tensor | None, activation: str) -> torch.Tensor:
    """``act(x + bias)`` in one pass, math in fp32; same semantics as ``bias_act_ref(..., upcast=True)``.

    x: [tokens, features] float32/float16/bfloat16, last dim contiguous (any row stride);
    bias: [features] in x's dtype, or None; activation: a key of ``ACTIVATIONS``.
    Returns a new contiguous [tokens, features] tensor in x's dtype. CUDA tensors run the compiled kernel, CPU
    tensors Triton's interpreter (slow: for tests).
    """
    return launch_or_op(_bias_act_launch, _bias_act_op, x, bias, activation)
