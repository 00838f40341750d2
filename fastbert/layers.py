"""The fused post-LN encoder block, as mixins over transformers' own modules.

Each fastbert module class is ``class Ours(FusedX, hf.TheirX)``: transformers' class provides ``__init__``, the
children (``query``, ``dense``, ``LayerNorm``, ...), the parameter names and its own ``forward``; the mixin adds
``fused(...)``, the padding-free path on token-major [tokens, hidden] activations. fastbert's model forward calls
``fused``; whenever it runs transformers' implementation instead (an option it does not accelerate, a hooked
container), every module still has HF's exact ``forward``.

    embeddings = LayerNorm(word[ids] + position[pos] + token_type[tt])      FusedEmbeddings
    per layer:                                                               FusedLayer
        qkv = x @ Wqkv + bqkv ; ctx = attention(q, k, v | layout)            FusedSelfAttention
        x   = LayerNorm(ctx @ Wo + bo + x)                                   FusedDenseResidualLayerNorm
        h   = act(x @ Wi + bi)                                               FusedIntermediate
        x   = LayerNorm(h @ Wo2 + bo2 + x)                                   FusedDenseResidualLayerNorm

A family whose modules have other names maps them in its own mixins; these read BERT's names.
"""

import torch

from . import derived, ops, padding


class Fused:
    """Base of the mixins: derived caches are dropped when the module is converted (``.to()``, ``.half()``)."""

    def _apply(self, *args, **kwargs):
        derived.clear(self)
        return super()._apply(*args, **kwargs)


class FusedEmbeddings(Fused):
    def fused(self, indices: torch.Tensor, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """indices [3, N] (word, token type, position) -> [N, hidden]."""
        return ops.embedding(indices, self, inputs_embeds)


class FusedSelfAttention(Fused):
    def fused(self, x: torch.Tensor, layout: padding.TokenLayout) -> torch.Tensor:
        """[N, hidden] -> attention context [N, hidden]."""
        qkv = ops.qkv_projection(self.query, self.key, self.value, x)  # [N, 3 * hidden]
        p = self.dropout.p if self.training else 0.0
        return ops.attention(qkv, layout, self.num_attention_heads, p)


class FusedDenseResidualLayerNorm(Fused):
    """LayerNorm(dropout(dense(hidden)) + residual): the shape of both BertSelfOutput and BertOutput."""

    def fused(self, hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return ops.dense_residual_layer_norm(hidden, residual, self.dense, self.dropout, self.LayerNorm)


class FusedAttention(Fused):
    def fused(self, x: torch.Tensor, layout: padding.TokenLayout) -> torch.Tensor:
        return self.output.fused(self.self.fused(x, layout), x)


class FusedIntermediate(Fused):
    def fused(self, x: torch.Tensor) -> torch.Tensor:
        return ops.dense_act(x, self.dense, self.intermediate_act_fn)


class FusedLayer(Fused):
    def fused(self, x: torch.Tensor, layout: padding.TokenLayout) -> torch.Tensor:
        x = self.attention.fused(x, layout)
        return self.output.fused(self.intermediate.fused(x), x)


class FusedEncoder(Fused):
    def fused(self, x: torch.Tensor, layout: padding.TokenLayout, keep: set[int] | None):
        """x [N, hidden] -> (last [N, hidden], [B, S, hidden] inputs of the layers whose index is in ``keep``).

        ``keep``: layer indices (0 = the embeddings) whose input to return, None for none; the list has one entry
        per layer, None where not kept. A kept state is the tensor the layer reads (through a view or a gather), so
        gradients reach it as in HF.
        """
        states = []
        for i, layer in enumerate(self.layer):
            if keep is not None:
                states.append(padding.unpack(x, layout) if i in keep else None)  # [B, S, hidden]
                x = x if states[-1] is None else padding.pack(states[-1], layout)
            x = _checkpointed(self, layer)(x, layout)
        return x, states


def _checkpointed(encoder, layer):
    """``layer.fused``, under gradient checkpointing when HF's ``gradient_checkpointing_enable()`` asked for it
    (transformers 5 flags each layer, 4.x the encoder) and the model trains with gradients."""
    owner = layer if getattr(layer, "gradient_checkpointing", False) else encoder
    if getattr(owner, "gradient_checkpointing", False) and layer.training and torch.is_grad_enabled():
        return lambda x, layout: owner._gradient_checkpointing_func(layer.fused, x, layout)
    return layer.fused


class FusedPredictionHeadTransform(Fused):
    """The MLM head's dense -> act -> LayerNorm with act + LayerNorm fused. Its ``forward`` is the fused one: the
    head calls it with [..., hidden] like HF's."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        x = ops.dense_act_layer_norm(x, self.dense, self.transform_act_fn, self.LayerNorm)
        return x.view(hidden_states.shape)
