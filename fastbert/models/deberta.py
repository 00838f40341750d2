"""DeBERTa v1 (deberta-base/large, their MNLI classifiers): DeBERTa-v2's block and disentangled attention under v1's
names, on the same ops.

    qkv = x @ in_proj, per head [q | k | v] -> [q | k | v] of all heads, + [q_bias | 0 | v_bias]
    ctx = attention(q, k, v | c2p = q . pos_proj(rows)^T, p2c = k . pos_q_proj(rows)^T, index)     (ops/disentangled.py)
    the rest as v2 (models/deberta_v2.py): BERT's post-norm block; DebertaLayerNorm read as a LayerNorm

v1 measures distances without buckets and clamps them to ``max_relative_positions`` (its ``att_span`` slice of the
table and clamp come to the same rows), scales every term by 1 / sqrt(D * (1 + len(pos_att_type))), and has no
convolution nor LayerNorm on the relative embeddings. ``talking_head`` (mixing heads' scores) is not accelerated:
transformers' forward runs, said once (``compat.py``).
"""

import torch
from transformers.models.deberta import modeling_deberta as hf

from .. import layers, padding
from ..ops import LAYER_NORMS, disentangled, gemm
from ..ops.attention import attention
from ..positions import Positions
from .deberta_v2 import DebertaShapedModel, scale_of


# DebertaLayerNorm is nn.LayerNorm's math in float32 (eps inside the square root), its eps ``variance_epsilon``: the
# fused ops read an exact, hook-free instance as they read an nn.LayerNorm.
LAYER_NORMS[hf.DebertaLayerNorm] = "variance_epsilon"


class DebertaEmbeddings(layers.FusedEmbeddings, hf.DebertaEmbeddings):
    pass


class DisentangledSelfAttention(layers.Fused, hf.DisentangledSelfAttention):
    float32_linears = ("pos_proj", "pos_q_proj")  # (on the relative rows: int8 applies to tokens only)

    def fused(self, x: torch.Tensor, layout: padding.TokenLayout, positions: Positions) -> torch.Tensor:
        """[N, hidden] -> attention context [N, all_head_size], before the output dense."""
        heads, head_dim = self.num_attention_heads, self.attention_head_size
        qkv = gemm.linear(x, self.in_proj).view(-1, heads, 3, head_dim).transpose(1, 2)  # [N, 3, H, D]
        bias = torch.stack([self.q_bias, torch.zeros_like(self.q_bias), self.v_bias]).view(3, heads, head_dim)
        qkv = (qkv + bias).reshape(-1, 3 * heads * head_dim)  # [N, 3 * all_head_size], q | k | v
        p = self.dropout.p if self.training else 0.0
        return attention(qkv, layout, heads, p, disentangled=self.position_terms(positions))

    def position_terms(self, positions: Positions) -> disentangled.Disentangled:
        """pos_proj's and pos_q_proj's rows (called as modules: LoRA and hooks apply), transformers' scale."""
        types = self.pos_att_type
        scale = scale_of(self.attention_head_size, 1 + len(types))
        if not self.relative_attention or positions.relative_rows is None or not ("c2p" in types or "p2c" in types):
            return disentangled.Disentangled(None, None, None, scale)
        rows = self.pos_dropout(positions.relative_rows)  # [R, hidden]
        return disentangled.Disentangled(self.pos_proj(rows) if "c2p" in types else None,
                                         self.pos_q_proj(rows) if "p2c" in types else None,
                                         positions.relative_index, scale)


class DebertaSelfOutput(layers.FusedDenseResidualLayerNorm, hf.DebertaSelfOutput):
    pass


class DebertaAttention(layers.FusedAttention, hf.DebertaAttention):
    pass


class DebertaIntermediate(layers.FusedIntermediate, hf.DebertaIntermediate):
    pass


class DebertaOutput(layers.FusedDenseResidualLayerNorm, hf.DebertaOutput):
    pass


class DebertaLayer(layers.FusedLayer, hf.DebertaLayer):
    pass


class DebertaEncoder(layers.FusedEncoder, hf.DebertaEncoder):
    pass


class LegacyDebertaPredictionHeadTransform(layers.FusedPredictionHeadTransform,
                                           hf.LegacyDebertaPredictionHeadTransform):
    """The legacy MLM head's dense -> act -> LayerNorm (config.legacy, transformers' default), fused like BERT's."""


FUSED_CLASSES = layers.fused_map(DebertaEmbeddings, DisentangledSelfAttention, DebertaSelfOutput, DebertaAttention,
                                 DebertaIntermediate, DebertaOutput, DebertaLayer, DebertaEncoder)
HEAD_CLASSES = layers.fused_map(LegacyDebertaPredictionHeadTransform)


class DebertaModel(DebertaShapedModel, hf.DebertaModel):
    """Drop-in for ``transformers.DebertaModel``: ``DebertaModel(config, unpad=True)``."""

    fused_classes = FUSED_CLASSES
