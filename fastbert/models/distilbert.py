"""DistilBERT: BERT's block under other names, without token types or pooler.

    x = sa_layer_norm(out_lin(attention(q_lin x, k_lin x, v_lin x)) + x)        (no dropout after out_lin)
    x = output_layer_norm(dropout(lin2(act(lin1 x))) + x)

Positions come from its position table (learned, or sinusoidal when ``config.sinusoidal_pos_embds``: the table is
filled at init, the lookup is the same). The embeddings, the encoder loop and every op are the shared ones; only the
block is mapped here.
"""

import torch
from transformers.modeling_outputs import BaseModelOutput
from transformers.models.distilbert import modeling_distilbert as hf

from .. import layers, modeling, ops, padding


class FusedSelfAttention(layers.Fused):
    def fused(self, x: torch.Tensor, layout: padding.TokenLayout) -> torch.Tensor:
        """[N, dim] -> attention context [N, dim], before ``out_lin`` (the block fuses it with the LayerNorm)."""
        qkv = ops.qkv_projection(self.q_lin, self.k_lin, self.v_lin, x)  # [N, 3 * dim]
        return ops.attention(qkv, layout, self.n_heads, self.dropout.p if self.training else 0.0)


class FusedFFN(layers.Fused):
    """lin1 / activation / lin2 / dropout, read by the block."""


class FusedTransformerBlock(layers.Fused):
    bypassed = ("attention", "ffn")

    def fused(self, x: torch.Tensor, layout: padding.TokenLayout) -> torch.Tensor:
        attention, ffn = self.attention, self.ffn
        x = ops.dense_residual_layer_norm(attention.fused(x, layout), x, attention.out_lin, None, self.sa_layer_norm)
        h = ops.dense_act(x, ffn.lin1, ffn.activation)
        return ops.dense_residual_layer_norm(h, x, ffn.lin2, ffn.dropout, self.output_layer_norm)


# transformers 5's names first, then 4.x's (MultiHeadSelfAttention and one class per attention implementation).
_MIXINS = {
    "Embeddings": layers.FusedEmbeddings,
    "DistilBertSelfAttention": FusedSelfAttention,
    "MultiHeadSelfAttention": FusedSelfAttention,
    "DistilBertSdpaAttention": FusedSelfAttention,
    "DistilBertFlashAttention2": FusedSelfAttention,
    "FFN": FusedFFN,
    "TransformerBlock": FusedTransformerBlock,
    "Transformer": layers.FusedEncoder,
}
FUSED_CLASSES = layers.fused_classes(hf, "", _MIXINS, globals())
HEAD_CLASSES = {}


class DistilBertModel(modeling.FusedModel, hf.DistilBertModel):
    """Drop-in for ``transformers.DistilBertModel``: ``DistilBertModel(config, unpad=True)``."""

    fused_classes = FUSED_CLASSES
    output_class = BaseModelOutput
    encoder_name = "transformer"
