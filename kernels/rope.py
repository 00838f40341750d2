"""Rotary position embedding (RoPE, GPT-NeoX's "rotate half") on the q and k of the packed QKV GEMM output.

For each token t at position p_t, each head, and i < D/2 (D the head dim), with freq_i = inv_freq[i]:
    cos = cos(p_t * freq_i) * scaling,  sin = sin(p_t * freq_i) * scaling       (``rotary_tables``, fp32, [N, D/2])
    x1, x2 = x[i], x[i + D/2]
    x[i]       = x1 * cos - x2 * sin
    x[i + D/2] = x2 * cos + x1 * sin
which is transformers' ``q * cos + rotate_half(q) * sin`` with ``cos = cat(cos, cos)`` (``apply_rotary_pos_emb`` of
GTE, NomicBERT, ModernBERT). The tables are built once per forward from the tokens' positions and shared by every
layer; positions are per token, so packed (varlen) rows need nothing more.
qkv: [N, 3 * hidden] (q, k, v side by side, each [H, D] per token); v is left as it is.
"""

import torch

from ._common import check_float, check_last_dim_contiguous, for_device, launch_or_op, tl, triton


def rotary_tables(positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float = 1.0,
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [N] int, inv_freq [D/2] -> (cos, sin), each [N, D/2] float32: transformers' rotary embedding
    module's math (``position_ids.float() * inv_freq``, then cos/sin, times ``attention_scaling``), half width."""
    freqs = positions.float()[:, None] * inv_freq.float()[None, :]
    cos, sin = freqs.cos(), freqs.sin()
    if scaling != 1.0:
        cos, sin = cos * scaling, sin * scaling
    return cos, sin


def rotary_ref(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, upcast: bool = False,
               ) -> torch.Tensor:
    """A new [N, 3 * hidden] tensor with q and k rotated, as transformers does it: the tables cast to qkv's dtype
    and every operation in that dtype. ``upcast=True`` computes in fp32 (what the kernel does) and rounds once."""
    dtype = qkv.dtype
    tokens, hidden = qkv.shape[0], qkv.shape[1] // 3
    x = qkv.float() if upcast else qkv
    q, k, v = x.view(tokens, 3, num_heads, hidden // num_heads).unbind(1)  # [N, H, D] each
    cos = torch.cat([cos, cos], dim=-1)[:, None, :].to(x.dtype)  # [N, 1, D]
    sin = torch.cat([sin, sin], dim=-1)[:, None, :].to(x.dtype)

    def rotate_half(t):
        t1, t2 = t.chunk(2, dim=-1)
        return torch.cat([-t2, t1], dim=-1)

    q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
    return torch.stack([q, k, v], dim=1).reshape(tokens, 3 * hidden).to(dtype)


# ---------------------------------------------------------------------------------------------------------------
# Triton: in place, one program per block of tokens and one of the 2 * H q/k heads; the math in fp32, one rounding.
# ---------------------------------------------------------------------------------------------------------------


@triton.jit
def _rotary_kernel(
    QKV,  # pointer to [n_rows, 3 * H * D], last dim contiguous; q and k are rotated in place
    COS,  # pointer to [n_rows, D / 2] float32, contiguous
    SIN,  # pointer to [n_rows, D / 2] float32, contiguous
    n_rows,  # tokens
    stride_row,  # elements between consecutive rows of QKV
    half,  # D / 2
    head_dim,  # D
    BLOCK_M: tl.constexpr,  # tokens per program
    BLOCK_HALF: tl.constexpr,  # D / 2 rounded up to a power of two (loads masked past it)
):
    # program_id(1) = the head among q's H then k's H: its first column is head * D (k's heads follow q's).
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_HALF)
    mask = (rows < n_rows)[:, None] & (cols < half)[None, :]
    rows = rows.to(tl.int64)  # rows * stride can pass 2**31
    first = QKV + rows[:, None] * stride_row + tl.program_id(1) * head_dim + cols[None, :]
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + half, mask=mask, other=0.0).to(tl.float32)
    table = rows[:, None] * half + cols[None, :]
    cos = tl.load(COS + table, mask=mask, other=0.0)
    sin = tl.load(SIN + table, mask=mask, other=0.0)
    tl.store(first, (x1 * cos - x2 * sin).to(QKV.dtype.element_ty), mask=mask)
    tl.store(first + half, (x2 * cos + x1 * sin).to(QKV.dtype.element_ty), mask=mask)


def _check_rotary(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int) -> int:
    """-> the head dim D, after checking every argument (metadata only)."""
    check_float("qkv", qkv)
    if qkv.dim() != 2 or qkv.shape[1] % 3:
        raise ValueError(f"qkv must be [tokens, 3 * hidden], got shape {tuple(qkv.shape)}")
    check_last_dim_contiguous("qkv", qkv)
    hidden = qkv.shape[1] // 3
    if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads <= 0 or hidden % num_heads:
        raise ValueError(f"num_heads must be a positive int dividing hidden {hidden}, got {num_heads!r}")
    head_dim = hidden // num_heads
    if head_dim % 2:
        raise ValueError(f"rotary embeddings need an even head dim, got {head_dim}")
    for name, table in (("cos", cos), ("sin", sin)):
        if table.dtype != torch.float32 or table.shape != (qkv.shape[0], head_dim // 2):
            raise ValueError(f"{name} must be float32 [{qkv.shape[0]}, {head_dim // 2}] ([tokens, head_dim / 2]), "
                             f"got {table.dtype} {tuple(table.shape)}")
        if table.device != qkv.device or not table.is_contiguous():
            raise ValueError(f"{name} must be contiguous and on qkv's device {qkv.device}, got {table.device}")
    return head_dim


def _rotary_launch(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int) -> None:
    head_dim = _check_rotary(qkv, cos, sin, num_heads)
    if qkv.numel() == 0:
        return
    block_half = triton.next_power_of_2(head_dim // 2)
    block_m = max(1, min(64, 2048 // block_half))
    grid = (triton.cdiv(qkv.shape[0], block_m), 2 * num_heads)
    for_device(_rotary_kernel, qkv.device)[grid](
        qkv, cos, sin, qkv.shape[0], qkv.stride(0), head_dim // 2, head_dim,
        BLOCK_M=block_m, BLOCK_HALF=block_half, num_warps=4,
    )


@torch.library.custom_op("fastbert::rotary_", mutates_args=("qkv",))
def _rotary_op(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int) -> None:
    _rotary_launch(qkv, cos, sin, num_heads)


@_rotary_op.register_fake
def _(qkv, cos, sin, num_heads):
    _check_rotary(qkv, cos, sin, num_heads)


def rotary_(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Rotate q and k of ``qkv`` in place (same semantics as ``rotary_ref(..., upcast=True)``); returns ``qkv``.

    qkv: [tokens, 3 * hidden] float32/float16/bfloat16, last dim contiguous (any row stride); cos, sin: float32
    [tokens, head_dim / 2] from ``rotary_tables``, contiguous, on qkv's device; num_heads: H (head_dim = hidden / H,
    even). Forward-only (it overwrites its input): autograd runs ``rotary_ref``. CUDA tensors run the compiled
    kernel, CPU tensors Triton's interpreter (slow: for tests).
    """
    launch_or_op(_rotary_launch, _rotary_op, qkv, cos, sin, num_heads)
    return qkv
