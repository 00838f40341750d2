"""ModernBERT (answerdotai/ModernBERT-base/large, gte-modernbert, modernbert-embed, granite-embedding r2, mmBERT):
a pre-norm block with rotary positions, a GLU MLP and sliding-window attention in the local layers, on the shared
ops.

    embeddings = norm(tok_embeddings[ids])                       (no positions, no token types; LayerNorm may have
                                                                  no bias, as every one here)
    tables     = cos/sin(position * inv_freq), one per attention type (global and local theta)
    per layer (attention_type: full_attention, or sliding_attention with |i - j| <= config.sliding_window):
        h = attn_norm(x)                                          (layer 0: Identity)
        x = x + Wo(attention(rope(Wqkv h) | window))              prenorm.layer_norm / dense_residual
        h = mlp_norm(x)
        x = x + Wo(act(a) * b),  [a | b] = Wi h                   gated_mlp.linear_glu (the first half activated)
    out = final_norm(x)

The window is a distance between the tokens' places in the padded batch, as in transformers: a packed layout
carries each token's column (``TokenLayout.columns``). The heads' ``ModernBertPredictionHead`` (dense -> act -> norm)
is fused like BERT's MLM transform.
"""

import dataclasses

import torch
from torch import nn
from transformers.modeling_outputs import BaseModelOutput
from transformers.models.modernbert import modeling_modernbert as hf

from .. import gated_mlp, layers, ops, padding, prenorm, rotary
from ..plain import is_plain
from . import rotary_glu

_SLIDING = "sliding_attention"


class FusedEmbeddings(layers.FusedEmbeddings):
    module_names = dict(word="tok_embeddings", norm="norm", dropout="drop")


class FusedAttention(layers.Fused):
    def fused(self, h: torch.Tensor, layout: padding.TokenLayout, attention_type: str) -> torch.Tensor:
        """h [N, hidden] (normalized) -> attention context [N, hidden], before ``Wo``."""
        num_heads = self.config.num_attention_heads
        owned = is_plain(self.Wqkv, nn.Linear, h.device)  # (a wrapped Wqkv's output may be held by its hooks)
        qkv = rotary.rotary(ops.linear(h, self.Wqkv), layout, num_heads, attention_type, owned)  # [N, 3 * hidden]
        window = self.config.sliding_window if attention_type == _SLIDING else None
        return ops.attention(qkv, layout, num_heads, self.attention_dropout if self.training else 0.0, window)


class FusedMLP(layers.Fused):
    """Wi / act / drop / Wo, read by the layer."""


class FusedEncoderLayer(layers.Fused):
    bypassed = ("attn", "mlp")

    def fused(self, x: torch.Tensor, layout: padding.TokenLayout) -> torch.Tensor:
        attn, mlp = self.attn, self.mlp
        h = prenorm.layer_norm(x, self.attn_norm)
        x = prenorm.dense_residual(attn.fused(h, layout, self.attention_type), x, attn.Wo, attn.out_drop)
        h = gated_mlp.linear_glu(prenorm.layer_norm(x, self.mlp_norm), mlp.Wi, mlp.act, 0)  # [N, intermediate]
        if mlp.training:
            h = mlp.drop(h)
        return prenorm.dense_residual(h, x, mlp.Wo, None)


FUSED_CLASSES = layers.fused_classes(hf, "ModernBert", {
    "Embeddings": FusedEmbeddings,
    "Attention": FusedAttention,
    "MLP": FusedMLP,
    "EncoderLayer": FusedEncoderLayer,
}, globals())


class FusedPredictionHead(layers.FusedPredictionHeadTransform):
    """dense -> act -> norm, under the heads (MLM, sequence classification on the pooled vector)."""

    activation_name = "act"
    layer_norm_name = "norm"


HEAD_CLASSES = layers.fused_classes(hf, "ModernBert", {"PredictionHead": FusedPredictionHead}, globals())


class ModernBertModel(rotary_glu.RotaryGluModel, hf.ModernBertModel):
    """Drop-in for ``transformers.ModernBertModel``: ``ModernBertModel(config, unpad=True)``."""

    fused_classes = FUSED_CLASSES
    output_class = BaseModelOutput

    def encode(self, x, indices, layout, keep):
        attention_types = set(self.config.layer_types)
        tables = {name: rotary.tables(self.rotary_emb, indices[2], name) for name in attention_types}
        layout = dataclasses.replace(layout, rotary=tables)
        if _SLIDING in attention_types:
            layout = padding.with_columns(layout)
        x, states = layers.run_layers(self, self.layers, x, layout, keep)
        return prenorm.layer_norm(x, self.final_norm), states
