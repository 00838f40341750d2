"""GLU act-and-mul: ``act(x_a + bias_a) * (x_b + bias_b)`` after the one GEMM that computes both halves.

The GLU encoders run a single GEMM for the up and gate projections and split its output into two halves of width I;
one half goes through the activation and multiplies the other. ``activated_half`` says which, per family:
  ModernBERT  ``input, gate = Wi(h).chunk(2); act(input) * gate``                  -> 0 (the first half)
  GTE         ``act(gate_proj(h)) * up_proj(h)``; the checkpoint's ``up_gate_proj``
              is [up; gate] (transformers' conversion mapping chunks it in that order) -> 1
  NomicBERT   ``act(gate_proj(h)) * up_proj(h)``; checkpoint ``fc11`` = up, ``fc12`` = gate,
              so [fc11; fc12] = [up; gate]                                         -> 1
x: [tokens, 2*I], bias: [2*I] (ModernBERT with ``mlp_bias``; the others have none) -> [tokens, I], x's dtype.
"""

import math

import torch
import torch.nn.functional as F

from ._common import check_float, check_last_dim_contiguous, check_like, for_device, launch_or_op, tl, triton
from .activation import ACTIVATIONS, _apply_activation, tile_grid

# The HF ``hidden_act`` names this kernel computes (activation.py's one map), by kind: the GELUs, and SiLU
# (NomicBERT's SwiGLU).
GLU_ACTIVATIONS = {name: kind for name, kind in ACTIVATIONS.items() if kind in ("gelu_erf", "gelu_tanh", "silu")}


def glu_activation_ref(x: torch.Tensor, activation: str) -> torch.Tensor:
    """The activation module transformers builds for ``activation`` (a key of ``GLU_ACTIVATIONS``), applied in x's
    dtype exactly as HF applies it. The two tanh GELUs differ in 16-bit: "gelu_new" rounds after every operation
    (NewGELUActivation, Python math), "gelu_pytorch_tanh" once (GELUTanh: F.gelu(approximate="tanh"))."""
    if activation == "gelu":
        return F.gelu(x)
    if activation == "gelu_new":
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))
    if activation == "gelu_pytorch_tanh":
        return F.gelu(x, approximate="tanh")
    return F.silu(x)


def glu_ref(
    x: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str,
    activated_half: int,
    upcast: bool = False,
) -> torch.Tensor:
    """``act(a) * b`` with ``a, b`` the halves of ``x + bias`` (a = half ``activated_half``), in x's dtype: HF's MLP
    math after its GEMM. ``upcast=True`` computes in fp32 (what the kernel does) and rounds once."""
    dtype = x.dtype
    if upcast:
        x, bias = x.float(), None if bias is None else bias.float()
    if bias is not None:
        x = x + bias
    halves = x.chunk(2, dim=-1)
    return (glu_activation_ref(halves[activated_half], activation) * halves[1 - activated_half]).to(dtype)


def glu_activation_kind(activation: str) -> str:
    """The kernel's name for HF's ``hidden_act`` (a key of ``GLU_ACTIVATIONS``); ValueError for one we don't fuse."""
    if not isinstance(activation, str) or activation not in GLU_ACTIVATIONS:
        raise ValueError(
            f"activation {activation!r} has no GLU kernel; supported: {', '.join(sorted(GLU_ACTIVATIONS))}"
        )
    return GLU_ACTIVATIONS[activation]


# ---------------------------------------------------------------------------------------------------------------
# Triton
#
# Per output element (row r, column c < I), all math in fp32, one rounding at the store:
#   a = x[r, col_act + c] + bias[col_act + c],  b = x[r, col_mul + c] + bias[col_mul + c]
#   y[r, c] = act(a) * b
# with (col_act, col_mul) = (0, I) or (I, 0) by activated_half. GELUs as in activation.py; SiLU = a * sigmoid(a),
# written like activation.py's tanh so that exp never overflows (torch's a / (1 + exp(-a)) reaches inf below -88):
#   silu(a) = a * (1 if a >= 0 else e) / (1 + e),  e = exp(-|a|)  in (0, 1]
# ---------------------------------------------------------------------------------------------------------------


@triton.jit
def _glu_activation(
    x,  # fp32 block
    ACTIVATION: tl.constexpr,  # a value of GLU_ACTIVATIONS: "gelu_erf", "gelu_tanh", "silu"
):
    if ACTIVATION == "silu":
        e = tl.exp(-tl.abs(x))
        x = x * tl.where(x >= 0, 1.0, e) / (1.0 + e)
    else:
        x = _apply_activation(x, ACTIVATION)
    return x


@triton.jit
def _glu_kernel(
    X,  # pointer to the input [n_rows, 2 * n_cols], last dim contiguous
    BIAS,  # pointer to the bias [2 * n_cols] (read only if HAS_BIAS)
    Y,  # pointer to the output [n_rows, n_cols], contiguous
    n_rows,  # number of rows (tokens)
    n_cols,  # I, the width of one half (the intermediate size)
    stride_x,  # elements between consecutive rows of X
    col_act,  # first column of the activated half: 0 or n_cols
    col_mul,  # first column of the other half: n_cols or 0
    HAS_BIAS: tl.constexpr,  # add BIAS to both halves before the activation
    ACTIVATION: tl.constexpr,  # see _glu_activation
    BLOCK_M: tl.constexpr,  # rows per program
    BLOCK_N: tl.constexpr,  # output columns per program
):
    # One BLOCK_M x BLOCK_N tile of the output per program; it reads the matching tile of each half.
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n_cols
    mask = (rows < n_rows)[:, None] & col_ok[None, :]
    rows = rows.to(tl.int64)  # rows * stride can pass 2**31 for large batches
    x_row = X + rows[:, None] * stride_x
    a = tl.load(x_row + (col_act + cols)[None, :], mask=mask, other=0.0).to(tl.float32)
    b = tl.load(x_row + (col_mul + cols)[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        a += tl.load(BIAS + col_act + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        b += tl.load(BIAS + col_mul + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    y = _glu_activation(a, ACTIVATION) * b
    tl.store(Y + rows[:, None] * n_cols + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


def _check_glu(x: torch.Tensor, bias: torch.Tensor | None, activation: str, activated_half: int) -> str:
    kind = glu_activation_kind(activation)
    if isinstance(activated_half, bool) or not isinstance(activated_half, int):
        raise TypeError(f"activated_half must be the int 0 or 1, got {type(activated_half).__name__}")
    if activated_half not in (0, 1):
        raise ValueError(
            f"activated_half must be 0 (act(first half) * second) or 1 (act(second half) * first), got {activated_half}"
        )
    check_float("x", x)
    if x.dim() != 2:
        raise ValueError(f"x must be [tokens, 2 * intermediate], got shape {tuple(x.shape)}")
    if x.shape[1] % 2:
        raise ValueError(f"x's last dimension must be even (two halves of the fused GEMM), got {x.shape[1]}")
    check_last_dim_contiguous("x", x)
    if bias is not None:
        check_like("bias", bias, "x", x, (x.shape[1],))
    return kind


def _glu_launch(x: torch.Tensor, bias: torch.Tensor | None, activation: str, activated_half: int) -> torch.Tensor:
    kind = _check_glu(x, bias, activation, activated_half)
    n_rows, n_cols = x.shape[0], x.shape[1] // 2
    out = torch.empty((n_rows, n_cols), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    bias = None if bias is None else bias.contiguous()  # [2 * I]: a no-op for an nn.Parameter
    block_m, block_n, grid = tile_grid(n_rows, n_cols)
    for_device(_glu_kernel, x.device)[grid](
        x,
        x if bias is None else bias,  # a dummy pointer when there is no bias: never read
        out,
        n_rows,
        n_cols,
        x.stride(0),
        activated_half * n_cols,
        (1 - activated_half) * n_cols,
        HAS_BIAS=bias is not None,
        ACTIVATION=kind,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        num_warps=4,
    )
    return out


@torch.library.custom_op("fastbert::glu", mutates_args=())
def _glu_op(x: torch.Tensor, bias: torch.Tensor | None, activation: str, activated_half: int) -> torch.Tensor:
    return _glu_launch(x, bias, activation, activated_half)


@_glu_op.register_fake
def _(x, bias, activation, activated_half):
    _check_glu(x, bias, activation, activated_half)
    return x.new_empty((x.shape[0], x.shape[1] // 2))


def glu(x: torch.Tensor, bias: torch.Tensor | None, activation: str, activated_half: int) -> torch.Tensor:
    """``act(a) * b`` for the halves ``a`` (number ``activated_half``) and ``b`` of ``x + bias``, in one pass with the
    math in fp32; same semantics as ``glu_ref(..., upcast=True)``.

    x: [tokens, 2 * I] float32/float16/bfloat16, last dim contiguous (any row stride: a slice of a wider buffer is
    read in place); bias: [2 * I] in x's dtype and device, or None; activation: a key of ``GLU_ACTIVATIONS``;
    activated_half: 0 (ModernBERT) or 1 (GTE, NomicBERT with [up; gate] stacked weights).
    Returns a new contiguous [tokens, I] tensor in x's dtype. CUDA tensors run the compiled kernel, CPU tensors
    Triton's interpreter (slow: for tests).
    """
    return launch_or_op(_glu_launch, _glu_op, x, bias, activation, activated_half)
