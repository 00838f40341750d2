"""DistilBERT: BERT's block under other names, without token types or pooler.

    x = sa_layer_norm(out_lin(attention(q_lin x, k_lin x, v_lin x)) + x)        (no dropout after out_lin)
    x = output_layer_norm(dropout(lin2(act(lin1 x))) + x)

Positions come from its position table (learned, or sinusoidal when ``config.sinusoidal_pos_embds``: the table is
filled at init, the lookup is the same). The embeddings, the encoder loop and every op are the shared ones; only the
block is written here.
"""

import torch
from transformers.modeling_outputs import BaseModelOutput
from transformers.models.distilbert import modeling_distilbert as hf

from .. import layers, modeling, padding
from ..int8 import choices as int8
from ..ops import activation, gemm, norm
from ..ops.attention import attention
from ..positions import Positions


class FusedSelfAttention(layers.Fused):
    quantizable_attention = True

    def fused(self, x: torch.Tensor, layout: padding.TokenLayout) -> torch.Tensor:
        """[N, dim] -> attention context [N, dim], before ``out_lin`` (the block fuses it with the LayerNorm)."""
        qkv = gemm.stacked(x, (self.q_lin, self.k_lin, self.v_lin))  # [N, 3 * dim]
        return attention(qkv, layout, self.n_heads, self.dropout.p if self.training else 0.0,
                         int8_attention=int8.attention_chosen(self), handoff=self)


class FusedTransformerBlock(layers.Fused):
    bypassed = ("attention", "ffn")

    def fused(self, x: torch.Tensor, layout: padding.TokenLayout, positions: Positions) -> torch.Tensor:
        attn, ffn = self.attention, self.ffn
        x = norm.dense_residual_layer_norm(attn.fused(x, layout), x, attn.out_lin, None, self.sa_layer_norm)
        h = activation.dense_act(x, ffn.lin1, ffn.activation)
        return norm.dense_residual_layer_norm(h, x, ffn.lin2, ffn.dropout, self.output_layer_norm)


class Embeddings(layers.FusedEmbeddings, hf.Embeddings):
    pass


class FFN(layers.Fused, hf.FFN):
    """lin1 / activation / lin2 / dropout, read by the block."""


class TransformerBlock(FusedTransformerBlock, hf.TransformerBlock):
    pass


class Transformer(layers.FusedEncoder, hf.Transformer):
    pass


FUSED_CLASSES = layers.fused_map(Embeddings, FFN, TransformerBlock, Transformer)
if hasattr(hf, "DistilBertSelfAttention"):  # transformers 5.x

    class DistilBertSelfAttention(FusedSelfAttention, hf.DistilBertSelfAttention):
        pass

    FUSED_CLASSES |= layers.fused_map(DistilBertSelfAttention)
# transformers 4.x: MultiHeadSelfAttention and one class per attention implementation
FUSED_CLASSES |= layers.transformers4_variants(
    hf, ("MultiHeadSelfAttention", "DistilBertSdpaAttention", "DistilBertFlashAttention2"), FusedSelfAttention,
    globals())
HEAD_CLASSES = {}


class DistilBertModel(modeling.FusedModel, hf.DistilBertModel):
    """Drop-in for ``transformers.DistilBertModel``: ``DistilBertModel(config, unpad=True)``."""

    fused_classes = FUSED_CLASSES
    output_class = BaseModelOutput
    encoder_name = "transformer"
