"""The ops of a BERT layer, each run by the backend ``dispatch.choose`` picks.

Every function takes the HF modules that own the weights (``nn.Linear``, ``nn.LayerNorm``), so the model reads like
the BERT diagram and the weights stay where HF keeps them. Activations are token-major: [tokens, features], where
tokens is batch * seq_len (dense) or the number of real tokens (packed, see ``padding.py``).
"""

import torch
import torch.nn.functional as F
from torch import nn

from . import _extension, dispatch
from .kernels import activation as activation_kernels
from .kernels import attention as attention_kernels
from .kernels import embedding as embedding_kernels
from .kernels import layer_norm as layer_norm_kernels
from .padding import TokenLayout


def _why_reference(*tensors, dropout_p: float = 0.0) -> str | None:
    """Why a call on ``tensors`` must run the torch reference ops instead of a fused kernel, or None."""
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        return "gradients are required and the fused kernels are forward-only (same math, differentiable)"
    if dropout_p > 0:
        return "dropout is active (train mode)"
    return None


def _why_no_kernel(activation: str | None) -> str | None:
    if activation in activation_kernels.ACTIVATIONS:
        return None
    return f"hidden_act {activation!r} has no fused kernel (HF's activation module runs)"


def embedding(indices: torch.Tensor, embeddings: nn.Module, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
    """LayerNorm(word[ids] + position[pos] + token_type[tt]) -> [tokens, hidden].

    indices: [3, tokens] int64 (word, token type, position), range-checked by ``validation.flat_indices``.
    inputs_embeds: [tokens, hidden] replaces the word lookup when given (then indices[0] is ignored).
    """
    word, position, token_type = (
        embeddings.word_embeddings.weight,
        embeddings.position_embeddings.weight,
        embeddings.token_type_embeddings.weight,
    )
    ln = embeddings.LayerNorm
    input_ids, token_type_ids, position_ids = indices.unbind(0)
    p = embeddings.dropout.p if embeddings.training else 0.0
    why = _why_reference(word, position, token_type, ln.weight, inputs_embeds, dropout_p=p)
    if inputs_embeds is not None:
        why = why or "inputs_embeds replaces the fused word-embedding lookup"
    backend = dispatch.choose("embedding", word, why)
    if backend == "torch":
        # Clamp like the kernels do, so that with range checks off a bad id never reads out of bounds.
        input_ids = input_ids.clamp(0, word.shape[0] - 1)
        token_type_ids = token_type_ids.clamp(0, token_type.shape[0] - 1)
        position_ids = position_ids.clamp(0, position.shape[0] - 1)
        # F.embedding with padding_idx, as HF's nn.Embedding: the pad token's row gets no gradient.
        pad = embeddings.word_embeddings.padding_idx
        words = F.embedding(input_ids, word, pad) if inputs_embeds is None else inputs_embeds
        x = words + token_type[token_type_ids] + position[position_ids]
        return F.dropout(F.layer_norm(x, x.shape[-1:], ln.weight, ln.bias, ln.eps), p, embeddings.training)
    fused = _extension.embedding_layer_norm if backend.endswith("-ext") else embedding_kernels.embedding_layer_norm
    return fused(input_ids, position_ids, token_type_ids, word, position, token_type, ln.weight, ln.bias, ln.eps)


def attention(qkv: torch.Tensor, layout: TokenLayout, num_heads: int, dropout_p: float = 0.0) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) v per head, over each sequence's real tokens.

    qkv: [tokens, 3 * hidden] straight from the fused QKV GEMM -> [tokens, hidden].
    """
    tokens, hidden = qkv.shape[0], qkv.shape[1] // 3
    head_dim = hidden // num_heads
    heads = qkv.view(tokens, 3, num_heads, head_dim)
    why = _why_reference(qkv, dropout_p=dropout_p)
    if head_dim > attention_kernels.MAX_HEAD_DIM:
        # The Triton kernel refuses D > MAX_HEAD_DIM (ValueError): such a model must take SDPA on a GPU, not crash.
        why = why or f"head_dim {head_dim} exceeds the Triton attention kernel's {attention_kernels.MAX_HEAD_DIM}"
    backend = dispatch.choose("attention", qkv, why)
    # Explicit [tokens, hidden] (not -1): tokens may be 0 (an empty batch, or every row fully padded).
    if backend == "triton":
        if layout.packed:
            return attention_kernels.attention_varlen(heads, layout.cu_seqlens, layout.max_seqlen).view(tokens, hidden)
        padded = heads.view(layout.batch, layout.seq_len, 3, num_heads, head_dim)
        return attention_kernels.attention(padded, layout.key_padding_mask).view(tokens, hidden)
    if layout.packed:
        return _attention_varlen_sdpa(heads, layout.seqlens, dropout_p).view(tokens, hidden)
    # reshape, not view: SDPA's math backend (dropout, float64) returns [B, H, S, D]-contiguous memory.
    return _attention_sdpa(heads, layout, dropout_p).reshape(tokens, hidden)


def _attention_sdpa(heads: torch.Tensor, layout: TokenLayout, dropout_p: float) -> torch.Tensor:
    """Dense layout through torch SDPA. heads: [B*S, 3, H, D] -> [B, S, H, D]."""
    q, k, v = heads.view(layout.batch, layout.seq_len, *heads.shape[1:]).permute(2, 0, 3, 1, 4)  # [B, H, S, D] each
    mask = None
    if layout.key_padding_mask is not None:
        # Additive mask with the dtype's most negative finite value (as HF does): a fully padded row then averages
        # its values instead of producing NaN, and cannot poison other rows.
        mask = torch.zeros(layout.key_padding_mask.shape, dtype=q.dtype, device=q.device)
        mask.masked_fill_(~layout.key_padding_mask, torch.finfo(q.dtype).min)
        mask = mask[:, None, None, :]  # [B, 1, 1, S]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)  # [B, H, S, D]
    return out.transpose(1, 2)


def _attention_varlen_sdpa(heads: torch.Tensor, seqlens: tuple[int, ...], dropout_p: float) -> torch.Tensor:
    """Packed layout on CPU: SDPA on each sequence's rows (views, no padding back to the max).

    heads: [T, 3, H, D] -> [T, H, D]. One SDPA per sequence: on CPU each call is large enough that the loop costs
    little, and no FLOP is spent on padding.
    """
    outputs = []
    for chunk in heads.split(list(seqlens)):
        q, k, v = chunk.permute(1, 2, 0, 3)[:, None]  # [1, H, L, D] each
        outputs.append(F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p)[0].transpose(0, 1))
    return torch.cat(outputs) if outputs else heads.new_empty(0, *heads.shape[2:])


def dense_residual_layer_norm(
    x: torch.Tensor, dense: nn.Linear, residual: torch.Tensor, layer_norm: nn.LayerNorm, dropout_p: float = 0.0
) -> torch.Tensor:
    """LayerNorm(dropout(x @ W^T + b) + residual): BertSelfOutput and BertOutput."""
    ln = layer_norm
    why = _why_reference(x, dense.weight, residual, ln.weight, dropout_p=dropout_p)
    if dispatch.choose("layer_norm", x, why) == "triton":
        # The GEMM runs without its bias; the kernel adds bias and residual and normalizes in one pass.
        return layer_norm_kernels.layer_norm(
            F.linear(x, dense.weight), ln.weight, ln.bias, ln.eps, bias=dense.bias, residual=residual
        )
    h = F.dropout(F.linear(x, dense.weight, dense.bias), dropout_p, training=dropout_p > 0)
    return F.layer_norm(h + residual, h.shape[-1:], ln.weight, ln.bias, ln.eps)


def dense_act(x: torch.Tensor, dense: nn.Linear, activation: str, act_fn: nn.Module) -> torch.Tensor:
    """act(x @ W^T + b): BertIntermediate. ``act_fn``, HF's module, is the torch path (and any activation we lack)."""
    why = _why_reference(x, dense.weight) or _why_no_kernel(activation)
    if dispatch.choose("bias_act", x, why) == "triton":
        return activation_kernels.bias_act(F.linear(x, dense.weight), dense.bias, activation)
    return act_fn(F.linear(x, dense.weight, dense.bias))


def dense_act_layer_norm(
    x: torch.Tensor, dense: nn.Linear, activation: str, act_fn: nn.Module, layer_norm: nn.LayerNorm
) -> torch.Tensor:
    """LayerNorm(act(x @ W^T + b)): the MLM head transform (BertPredictionHeadTransform)."""
    ln = layer_norm
    why = _why_reference(x, dense.weight, ln.weight) or _why_no_kernel(activation)
    if dispatch.choose("act_layer_norm", x, why) == "triton":
        return layer_norm_kernels.layer_norm(
            F.linear(x, dense.weight), ln.weight, ln.bias, ln.eps, bias=dense.bias, activation=activation
        )
    h = act_fn(F.linear(x, dense.weight, dense.bias))
    return F.layer_norm(h, h.shape[-1:], ln.weight, ln.bias, ln.eps)
