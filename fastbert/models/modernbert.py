"""ModernBERT (answerdotai/ModernBERT-base/large, gte-modernbert, modernbert-embed, granite-embedding r2, mmBERT):
a pre-norm block with rotary positions, a GLU MLP and sliding-window attention in the local layers, on the shared
ops.

    embeddings = norm(tok_embeddings[ids])                       (no positions, no token types; LayerNorm may have
                                                                  no bias, as every one here)
    tables     = cos/sin(position * inv_freq), one per attention type (global and local theta)
    per layer (attention_type: full_attention, or sliding_attention with |i - j| <= config.sliding_window):
        h = attn_norm(x)                                          (layer 0: Identity)
        x = x + Wo(attention(rope(Wqkv h) | window))              ops/norm.py ``layer_norm``, ``dense_residual``
        h = mlp_norm(x)
        x = x + Wo(act(a) * b),  [a | b] = Wi h                   ops/glu.py ``linear_glu`` (the first half activated)
    out = final_norm(x)

The window is a distance between the tokens' places in the padded batch, as in transformers: a packed layout
carries each token's column (``TokenLayout.columns``). The heads' ``ModernBertPredictionHead`` (dense -> act -> norm)
is fused like BERT's MLM transform.
"""

import torch
from torch import nn
from transformers.modeling_outputs import BaseModelOutput
from transformers.models.modernbert import modeling_modernbert as hf

from .. import layers, padding
from ..ops import glu, norm, rotary
from ..ops.attention import attention
from ..ops.gemm import linear
from ..plain import is_plain
from ..positions import Positions
from . import rotary_glu

_SLIDING = "sliding_attention"


class ModernBertEmbeddings(layers.FusedEmbeddings, hf.ModernBertEmbeddings):
    module_names = dict(word="tok_embeddings", norm="norm", dropout="drop")


class ModernBertAttention(layers.Fused, hf.ModernBertAttention):
    def fused(self, h: torch.Tensor, layout: padding.TokenLayout, positions: Positions, attention_type: str,
              ) -> torch.Tensor:
        """h [N, hidden] (normalized) -> attention context [N, hidden], before ``Wo``."""
        num_heads = self.config.num_attention_heads
        owned = is_plain(self.Wqkv, nn.Linear, h.device)  # (a wrapped Wqkv's output may be held by its hooks)
        qkv = rotary.rotary(linear(h, self.Wqkv), *positions.rotary[attention_type], num_heads, owned)
        window = self.config.sliding_window if attention_type == _SLIDING else None
        return attention(qkv, layout, num_heads, self.attention_dropout if self.training else 0.0, window)


class ModernBertMLP(layers.Fused, hf.ModernBertMLP):
    """Wi / act / drop / Wo, read by the layer."""


class ModernBertEncoderLayer(layers.Fused, hf.ModernBertEncoderLayer):
    bypassed = ("attn", "mlp")

    def fused(self, x: torch.Tensor, layout: padding.TokenLayout, positions: Positions) -> torch.Tensor:
        attn, mlp = self.attn, self.mlp
        h = norm.layer_norm(x, self.attn_norm)
        x = norm.dense_residual(attn.fused(h, layout, positions, self.attention_type), x, attn.Wo, attn.out_drop)
        h = glu.linear_glu(norm.layer_norm(x, self.mlp_norm), mlp.Wi, mlp.act, 0)  # [N, intermediate]
        if mlp.training:
            h = mlp.drop(h)
        return norm.dense_residual(h, x, mlp.Wo, None)


class ModernBertPredictionHead(layers.FusedPredictionHeadTransform, hf.ModernBertPredictionHead):
    """dense -> act -> norm, under the heads (MLM, sequence classification on the pooled vector)."""

    activation_name = "act"
    layer_norm_name = "norm"


FUSED_CLASSES = layers.fused_map(ModernBertEmbeddings, ModernBertAttention, ModernBertMLP, ModernBertEncoderLayer)
HEAD_CLASSES = layers.fused_map(ModernBertPredictionHead)


class ModernBertModel(rotary_glu.RotaryGluModel, hf.ModernBertModel):
    """Drop-in for ``transformers.ModernBertModel``: ``ModernBertModel(config, unpad=True)``."""

    fused_classes = FUSED_CLASSES
    output_class = BaseModelOutput

    def positions(self, indices, layout):
        attention_types = set(self.config.layer_types)
        tables = {name: rotary.tables(self.rotary_emb, indices[2], name) for name in attention_types}
        return padding.with_columns(layout) if _SLIDING in attention_types else layout, Positions(rotary=tables)

    def encode(self, x, layout, positions, keep):
        x, states = layers.run_layers(self, self.layers, x, layout, positions, keep)
        return norm.layer_norm(x, self.final_norm), states
