"""The SPLADE head's vocabulary-sized GEMM with what follows it: pool over each sequence's tokens of act(decoder(x)).

    splade_pool(x, cu_seqlens, decoder, activation, pooling)    x [N, hidden] -> [B, vocab]

x holds the packed MLM-transformed states of every sequence's real tokens (sequence b: rows cu_seqlens[b] to
cu_seqlens[b + 1]); act is log1p(relu) ("relu") or log1p(log1p(relu)) ("log1p_relu"), the pool a max or a sum, as in
sentence-transformers' SpladePooling. The decoder GEMM is the heaviest of a SPLADE forward (vocab x hidden per token),
and its [tokens, vocab] output is never held in full: SpladePooling after transformers' MLM head holds [batch,
seq_len, vocab] twice (the logits and their masked copy), padding included. Reference: ``kernels/splade_pool.py``'s
``splade_pool_ref``. Backends, as the op ``splade_pool``:

  triton  one kernel (``kernels/splade_pool.py``): each [tokens, vocab] tile of the GEMM lives in registers and is
          folded into the sequence's running max or sum
  onednn  a plain decoder on the CPU where oneDNN runs this dtype's GEMMs (measured faster than torch's, as for
          every Linear: ``ops/gemm.py``): torch's blocked fold below, each block's GEMM on the decoder's weight
          prepacked in blocks of ``PACKED_COLUMNS`` vocabulary entries (a derived cache)
  torch   the GEMM over blocks of at most TOKEN_BLOCK tokens x VOCAB_BLOCK-ish vocabulary entries into one scratch
          of SCRATCH_ELEMENTS values (4 MiB in float32: it stays in cache), each block folded into [B, vocab] with
          ``index_reduce_`` (amax) or ``index_add_``; for "max" the bias and act run once on [B, vocab] (act is
          non-decreasing, see the kernel's notes). A decoder that is not plain (hooks, PEFT, offload) is called on
          blocks of tokens, its whole vocabulary at once (its weights are not read). Always applies; the fast path on
          the CPU (tiling costs a few percent of CPU time over one [N, vocab] GEMM, and none of its memory).

Forward only: the callers run sentence-transformers' own modules where gradients are needed.
"""

import dataclasses
import warnings

import torch
from torch import nn

from .. import cpu_gemm, derived, dispatch
from ..dispatch import Backend
# (fastbert.kernels: the repository's top-level kernels/ folder, installed under that name by setup.py)
from ..kernels import splade_pool as splade_kernels
from ..plain import is_plain
from ..plan import decided
from . import gemm

SCRATCH_ELEMENTS = 1 << 20  # the torch backend's [tokens, vocab] block: at most this many values
TOKEN_BLOCK = 1024  # tokens per block (with 1024 vocabulary entries a block: 1 GFLOP GEMMs at hidden 512)
PACKED_COLUMNS = 1024  # vocabulary entries per prepacked block of the onednn backend

# index_reduce_ says once that its API is in beta. It is the fold this backend needs (7x faster than scatter_reduce_
# with an expanded index on a [1000, 1024] block, the same result), behind fastbert's own API: not the user's concern.
warnings.filterwarnings("ignore", message=r"index_reduce\(\) is in beta", category=UserWarning)


@dataclasses.dataclass(frozen=True)
class Call:
    decoder: nn.Module  # the MLM head's Linear from hidden to vocab
    activation: str  # "relu" or "log1p_relu"
    pooling: str  # "max" or "sum"
    plain: bool  # the decoder is a plain nn.Linear (a kernel may read its weights)
    device: torch.device
    dtype: torch.dtype


def _act_(z: torch.Tensor, activation: str) -> torch.Tensor:
    """act(z) in place."""
    z.relu_().log1p_()
    return z.log1p_() if activation == "log1p_relu" else z


def _fold(call: Call, x: torch.Tensor, cu_seqlens: torch.Tensor, vocab: int, rows: int, columns: int, logits,
          bias: torch.Tensor | None) -> torch.Tensor:
    """[B, vocab]: the logits of blocks of ``rows`` tokens x ``columns`` vocabulary entries (``logits(r0, r1, c0,
    c1)`` -> [r1 - r0, c1 - c0], without ``bias``), each folded into its sequences' max or sum as it comes."""
    tokens, batch = x.shape[0], cu_seqlens.numel() - 1
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    sequence = torch.repeat_interleave(torch.arange(batch, device=x.device), lengths, output_size=tokens)  # [N]
    fold_max = call.pooling == "max"
    out = x.new_full((batch, vocab), float("-inf")) if fold_max else x.new_zeros((batch, vocab))
    for r0 in range(0, tokens, rows):
        r1 = min(tokens, r0 + rows)
        for c0 in range(0, vocab, columns):
            c1 = min(vocab, c0 + columns)
            block = logits(r0, r1, c0, c1)
            if fold_max:
                out[:, c0:c1].index_reduce_(0, sequence[r0:r1], block, "amax")
            else:
                if bias is not None:
                    block += bias[c0:c1]
                out[:, c0:c1].index_add_(0, sequence[r0:r1], _act_(block, call.activation))
    if fold_max:  # (a sequence without tokens keeps -inf, and act makes it 0, as SpladePooling's all-masked row)
        _act_(out if bias is None else out.add_(bias), call.activation)
    return out


def _torch_run(call: Call, x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    decoder, tokens = call.decoder, x.shape[0]
    if call.plain:  # blocks of [rows, columns] of the logits, without the bias, in one scratch
        weight, vocab = decoder.weight, decoder.weight.shape[0]
        rows = min(tokens, TOKEN_BLOCK)
        columns = min(vocab, max(128, SCRATCH_ELEMENTS // max(rows, 1)))
        bias = decoder.bias
    else:  # the module, on blocks of tokens: whole rows of biased logits
        vocab = decoder.out_features
        rows, columns, bias = max(1, SCRATCH_ELEMENTS // vocab), vocab, None
    scratch = x.new_empty(rows * columns)

    def logits(r0, r1, c0, c1):
        block = scratch[: (r1 - r0) * (c1 - c0)].view(r1 - r0, c1 - c0)  # [rows, columns]
        if not call.plain:
            return block.copy_(decoder(x[r0:r1]))
        return torch.mm(x[r0:r1], weight[c0:c1].t(), out=block)

    return _fold(call, x, cu_seqlens, vocab, rows, columns, logits, bias)


def _pack_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The decoder's weight [vocab, hidden] -> oneDNN's layout, ``PACKED_COLUMNS`` vocabulary entries a block."""
    return tuple(cpu_gemm.pack(weight[c0: c0 + PACKED_COLUMNS]) for c0 in range(0, weight.shape[0], PACKED_COLUMNS))


def _onednn_run(call: Call, x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    decoder = call.decoder
    blocks = derived.cached(decoder, "splade_onednn_blocks", (decoder.weight,), _pack_blocks)
    x = x.contiguous()
    return _fold(call, x, cu_seqlens, decoder.weight.shape[0], min(x.shape[0], TOKEN_BLOCK), PACKED_COLUMNS,
                 lambda r0, r1, c0, c1: cpu_gemm.linear(x[r0:r1], blocks[c0 // PACKED_COLUMNS], None), decoder.bias)


def _triton_run(call: Call, x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    return splade_kernels.splade_pool(x, call.decoder.weight, call.decoder.bias, cu_seqlens.to(torch.int32),
                                      call.activation, call.pooling)


def _plain_why_not(call: Call) -> list[str]:
    return [] if call.plain else ["a wrapped or hooked decoder Linear is called as a module"]


BACKENDS = dispatch.register("splade_pool", [
    Backend("triton", run=_triton_run, unavailable=dispatch.triton_unavailable, why_not=_plain_why_not),
    Backend("onednn", run=_onednn_run, unavailable=gemm.onednn_unavailable, why_not=_plain_why_not,
            devices=("cpu",)),
    Backend("torch", run=_torch_run),
])


def _decide(x: torch.Tensor, decoder: nn.Module, activation: str, pooling: str):
    splade_kernels.check_modes(activation, pooling)
    plain = is_plain(decoder, nn.Linear, x.device)
    reasons = dispatch.needs_reference(x, getattr(decoder, "weight", None), getattr(decoder, "bias", None))
    if reasons:  # (no backend is differentiable: a silent result without gradients would be wrong)
        raise RuntimeError(f"splade_pool is forward-only, and {reasons[0]}")
    return dispatch.decide("splade_pool", BACKENDS, Call(decoder, activation, pooling, plain, x.device,
                                                         x.dtype))


def splade_pool(x: torch.Tensor, cu_seqlens: torch.Tensor, decoder: nn.Module, activation: str,
                pooling: str) -> torch.Tensor:
    """x [N, hidden], cu_seqlens [B + 1] (int32 or int64, on x's device) -> [B, vocab] in x's dtype: for each
    sequence, ``pooling`` ("max" or "sum") over its tokens of ``activation`` ("relu": log1p(relu(z)), "log1p_relu":
    log1p(log1p(relu(z)))) of ``decoder``'s logits z. Inference only."""
    return decided(decoder, ("splade_pool", activation, pooling), _decide, x, decoder, activation, pooling)(
        x, cu_seqlens)
