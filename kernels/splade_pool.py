"""The SPLADE head after the MLM transform: each sequence's vocabulary-sized vector, pooled over its tokens, without
ever holding the [tokens, vocab] logits.

    logits[t, v] = x[t] . W[v] + b[v]                                   the MLM decoder         [N, V]
    act(z)       = log1p(relu(z))           ("relu", SPLADE)
                 = log1p(log1p(relu(z)))    ("log1p_relu", OpenSearch's variant)
    out[s, v]    = max_t act(logits[t, v])  ("max")   or  sum_t act(logits[t, v])  ("sum")   over the tokens t of
                                                                                    sequence s  -> [B, V]

x: [N, H], the packed states of every sequence's real tokens (sequence s is rows cu_seqlens[s]:cu_seqlens[s + 1]);
W: [V, H] (nn.Linear's layout); b: [V] or None. sentence-transformers' SpladePooling multiplies the logits by the
attention mask first, so a padding position contributes act(0) = 0, and a sequence without tokens gets zeros: with
only real tokens here, the same result is the pool over real tokens, clamped at 0 (act is >= 0). act is
non-decreasing, so max_t act(z_t) = act(max_t z_t), and max_t (z_t + b) = (max_t z_t) + b: "max" pools the raw dot
products and applies the bias and act once per vocabulary entry.
"""

import torch

from ._common import check_float, check_last_dim_contiguous, check_like, for_device, interpreting, launch_or_op, tl
from ._common import triton
from .attention_config import _input_precision

ACTIVATIONS = ("relu", "log1p_relu")  # SpladePooling's activation_function values
POOLINGS = ("max", "sum")  # its pooling_strategy values


def splade_act_ref(z: torch.Tensor, activation: str) -> torch.Tensor:
    """act(z) in z's dtype, rounded after each step as SpladePooling computes it."""
    z = z.relu().log1p()
    return z.log1p() if activation == "log1p_relu" else z


def splade_pool_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cu_seqlens: torch.Tensor,
                    activation: str, pooling: str) -> torch.Tensor:
    """The math above on the whole [N, V] logits, in x's dtype: the reference the kernel and the CPU path are
    checked against (it materializes what they avoid)."""
    logits = torch.nn.functional.linear(x, weight, bias)  # [N, V]
    ends = cu_seqlens.tolist()
    pooled = []
    for start, end in zip(ends[:-1], ends[1:]):
        transformed = splade_act_ref(logits[start:end], activation)
        if end == start:  # a sequence without tokens: SpladePooling's masked positions are all act(0) = 0
            pooled.append(logits.new_zeros(logits.shape[1]))
        else:
            pooled.append(transformed.amax(0) if pooling == "max" else transformed.sum(0))
    return torch.stack(pooled) if pooled else logits.new_zeros(0, weight.shape[0])


def check_modes(activation: str, pooling: str) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation {activation!r}: expected one of {', '.join(ACTIVATIONS)}")
    if pooling not in POOLINGS:
        raise ValueError(f"pooling {pooling!r}: expected one of {', '.join(POOLINGS)}")


# ---------------------------------------------------------------------------------------------------------------
# Triton
#
# One program per (sequence s, block of BLOCK_V vocabulary entries); program 0's axis is the sequence, so programs
# launched together share a block of W, which stays in L2 while the sequences read it. Per block of BLOCK_T tokens
# the program multiplies [BLOCK_T, H] by W's block transposed, [H, BLOCK_V], in fp32 over BLOCK_K columns of H at a
# time, and folds the [BLOCK_T, BLOCK_V] tile into a running [BLOCK_V] max (of the raw products) or sum (of act of
# the biased logits); rows past the sequence's end are left out. The tile lives in registers: nothing of size
# [N, V] is written.
# ---------------------------------------------------------------------------------------------------------------


@triton.jit
def _splade_act(z, ACTIVATION: tl.constexpr):
    z = tl.log(1.0 + tl.maximum(z, 0.0))  # log1p(relu(z)): for z >= 0, rounding 1 + z costs < 1e-7 absolute
    if ACTIVATION == "log1p_relu":
        z = tl.log(1.0 + z)
    return z


@triton.jit
def _splade_pool_kernel(
    X,  # pointer to the token states [N, hidden], last dim contiguous
    W,  # pointer to the decoder weight [vocab, hidden], last dim contiguous
    BIAS,  # pointer to the decoder bias [vocab] (read only if HAS_BIAS)
    CU_SEQLENS,  # pointer to [B + 1] int32: sequence s is rows CU_SEQLENS[s]:CU_SEQLENS[s + 1] of X
    OUT,  # pointer to the output [B, vocab], contiguous
    hidden,  # H
    vocab,  # V
    stride_x,  # elements between rows of X
    stride_w,  # elements between rows of W
    HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr,  # "relu" or "log1p_relu"
    POOLING: tl.constexpr,  # "max" or "sum"
    INPUT_PRECISION: tl.constexpr,  # tl.dot precision of fp32 operands (attention_config._input_precision)
    BLOCK_T: tl.constexpr,  # tokens per step
    BLOCK_V: tl.constexpr,  # vocabulary entries per program
    BLOCK_K: tl.constexpr,  # hidden columns per dot
):
    seq = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)  # [BLOCK_V] vocabulary entries
    col_ok = cols < vocab
    start = tl.load(CU_SEQLENS + seq)
    end = tl.load(CU_SEQLENS + seq + 1)
    if HAS_BIAS:
        bias = tl.load(BIAS + cols, mask=col_ok, other=0.0).to(tl.float32)
    else:
        bias = tl.zeros([BLOCK_V], dtype=tl.float32)
    if POOLING == "max":
        pooled = tl.full([BLOCK_V], float("-inf"), tl.float32)
    else:
        pooled = tl.zeros([BLOCK_V], dtype=tl.float32)
    w_rows = W + cols.to(tl.int64)[None, :] * stride_w  # [1, BLOCK_V]: W's rows, read as columns of W^T
    for t0 in range(start, end, BLOCK_T):
        rows = t0 + tl.arange(0, BLOCK_T)
        row_ok = rows < end
        x_rows = X + rows.to(tl.int64)[:, None] * stride_x  # [BLOCK_T, 1]
        acc = tl.zeros([BLOCK_T, BLOCK_V], dtype=tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < hidden
            x = tl.load(x_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_T, BLOCK_K]
            w_t = tl.load(w_rows + ks[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)  # [BLOCK_K, BLOCK_V]
            acc = tl.dot(x, w_t, acc, input_precision=INPUT_PRECISION)
        if POOLING == "max":
            pooled = tl.maximum(pooled, tl.max(tl.where(row_ok[:, None], acc, float("-inf")), axis=0))
        else:
            act = _splade_act(acc + bias[None, :], ACTIVATION)
            pooled += tl.sum(tl.where(row_ok[:, None], act, 0.0), axis=0)
    if POOLING == "max":
        pooled = _splade_act(pooled + bias, ACTIVATION)  # (-inf for a sequence without tokens: act gives 0)
    tl.store(OUT + seq.to(tl.int64) * vocab + cols, pooled.to(OUT.dtype.element_ty), mask=col_ok)


def _check_splade_pool(x, weight, bias, cu_seqlens, activation, pooling) -> None:
    check_modes(activation, pooling)
    check_float("x", x)
    if x.dim() != 2:
        raise ValueError(f"x must be [tokens, hidden], got shape {tuple(x.shape)}")
    check_last_dim_contiguous("x", x)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(f"weight must be a [vocab, hidden] tensor, got {getattr(weight, 'shape', weight)}")
    check_like("weight", weight, "x", x, (weight.shape[0], x.shape[1]))
    check_last_dim_contiguous("weight", weight)
    if bias is not None:
        check_like("bias", bias, "x", x, (weight.shape[0],))
    if cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError(f"cu_seqlens must be a 1-D int32 tensor [B + 1], got {cu_seqlens.dtype} "
                         f"{tuple(cu_seqlens.shape)}")
    if cu_seqlens.device != x.device:
        raise ValueError(f"cu_seqlens is on {cu_seqlens.device} but x is on {x.device}")


def _blocks(device: torch.device) -> tuple[int, int, int, int]:
    """(BLOCK_T, BLOCK_V, BLOCK_K, num_warps): GPU tiles for tensor cores; the interpreter's numpy prefers few,
    large steps."""
    if interpreting(device):
        return 16, 64, 32, 4
    return 32, 128, 32, 4


def _splade_pool_launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cu_seqlens: torch.Tensor,
                        activation: str, pooling: str) -> torch.Tensor:
    _check_splade_pool(x, weight, bias, cu_seqlens, activation, pooling)
    batch, vocab = cu_seqlens.numel() - 1, weight.shape[0]
    out = torch.empty((batch, vocab), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    block_t, block_v, block_k, num_warps = _blocks(x.device)
    for_device(_splade_pool_kernel, x.device)[(batch, triton.cdiv(vocab, block_v))](
        x,
        weight,
        weight if bias is None else bias,  # a dummy pointer when there is no bias: never read
        cu_seqlens,
        out,
        x.shape[1],
        vocab,
        x.stride(0),
        weight.stride(0),
        HAS_BIAS=bias is not None,
        ACTIVATION=activation,
        POOLING=pooling,
        INPUT_PRECISION=_input_precision(x.dtype, x.device),
        BLOCK_T=block_t,
        BLOCK_V=block_v,
        BLOCK_K=block_k,
        num_warps=num_warps,
    )
    return out


@torch.library.custom_op("fastbert::splade_pool", mutates_args=())
def _splade_pool_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cu_seqlens: torch.Tensor,
                    activation: str, pooling: str) -> torch.Tensor:
    return _splade_pool_launch(x, weight, bias, cu_seqlens, activation, pooling)


@_splade_pool_op.register_fake
def _(x, weight, bias, cu_seqlens, activation, pooling):
    _check_splade_pool(x, weight, bias, cu_seqlens, activation, pooling)
    return x.new_empty((cu_seqlens.shape[0] - 1, weight.shape[0]))


def splade_pool(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cu_seqlens: torch.Tensor,
                activation: str, pooling: str) -> torch.Tensor:
    """``splade_pool_ref``'s result in one kernel, the math in fp32 and rounded once at the store.

    x: [N, H] float32/float16/bfloat16, last dim contiguous; weight: [V, H] and bias: [V] (or None) in x's dtype and
    device; cu_seqlens: [B + 1] int32 on x's device; activation: "relu" or "log1p_relu"; pooling: "max" or "sum".
    Returns a new [B, V] tensor in x's dtype. CUDA tensors run the compiled kernel, CPU tensors Triton's interpreter
    (slow: for tests).
    """
    return launch_or_op(_splade_pool_launch, _splade_pool_op, x, weight, bias, cu_seqlens, activation, pooling)
