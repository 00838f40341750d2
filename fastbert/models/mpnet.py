"""MPNet (all-mpnet-base-v2, multi-qa-mpnet): BERT's post-norm block under MPNet's names, RoBERTa's positions, and a
relative-position bias shared by all layers, on the shared ops.

    embeddings = LayerNorm(word[ids] + position[pos])            positions from input_ids != padding_idx (RoBERTa's)
    bias       = relative_attention_bias[bucket(j - i)]          [H, 2R + 1] by distance, once per forward
    per layer:
        qkv = x @ [Wq; Wk; Wv] + b ; ctx = attention(q, k, v | bias)        (attn.q/k/v)
        x   = LayerNorm(ctx @ Wo + bo + x)                                   (attn.o, attention.LayerNorm)
        h   = gelu(x @ Wi + bi) ; x = LayerNorm(h @ Wo2 + bo2 + x)           (intermediate, output: BERT's)

transformers buckets the distance j - i (T5's scheme, 32 buckets, exact up to 8, logarithmic up to 128, then the
last bucket): every distance past R = 128 shares its bucket, so a table of 2R + 1 distances holds the whole bias,
computed with transformers' own bucket function. Distances are between the tokens' places in the padded batch, as
transformers measures them, also when the batch runs packed (``TokenLayout.columns``).
"""

import dataclasses

import torch
from transformers.modeling_outputs import BaseModelOutputWithPooling
from transformers.models.mpnet import modeling_mpnet as hf

from .. import layers, ops, padding
from . import roberta

# transformers' bucket function: 32 buckets (MPNetEncoder passes its default, whatever the config says), and every
# distance of 128 or more in the last one.
_BUCKETS, _RADIUS = 32, 128


class FusedSelfAttention(layers.Fused):
    def fused(self, x: torch.Tensor, layout: padding.TokenLayout) -> torch.Tensor:
        """[N, hidden] -> attention context [N, hidden], before ``o``."""
        qkv = ops.qkv_projection(self.q, self.k, self.v, x)  # [N, 3 * hidden]
        p = self.dropout.p if self.training else 0.0
        return ops.attention(qkv, layout, self.num_attention_heads, p)  # (the bias: layout.relative_bias)


class FusedAttention(layers.Fused):
    bypassed = ("attn",)

    def fused(self, x: torch.Tensor, layout: padding.TokenLayout) -> torch.Tensor:
        return ops.dense_residual_layer_norm(self.attn.fused(x, layout), x, self.attn.o, self.dropout, self.LayerNorm)


FUSED_CLASSES = layers.fused_classes(hf, "MPNet", {
    "Embeddings": layers.FusedEmbeddings,
    "SelfAttention": FusedSelfAttention,
    "Attention": FusedAttention,
    "Intermediate": layers.FusedIntermediate,
    "Output": layers.FusedDenseResidualLayerNorm,
    "Layer": layers.FusedLayer,
    "Encoder": layers.FusedEncoder,
}, globals())
# The MLM head is RoBERTa's (dense -> gelu -> layer_norm -> decoder): MPNetLMHead gets the same fused forward.
HEAD_CLASSES = layers.fused_classes(hf, "MPNet", roberta.HEAD_MIXINS, globals())


def relative_bias(encoder: torch.nn.Module) -> torch.Tensor:
    """The encoder's relative-position bias by distance: float32 [H, 2R + 1], entry d + R for j - i = d. Through the
    bias module itself (an Embedding, or whatever wraps it), so gradients and hooks reach it as in transformers."""
    table = encoder.relative_attention_bias
    distance = torch.arange(-_RADIUS, _RADIUS + 1, device=table.weight.device)
    buckets = hf.MPNetEncoder.relative_position_bucket(distance, num_buckets=_BUCKETS, max_distance=_RADIUS)
    return table(buckets).t().float().contiguous()


class MPNetModel(roberta.RobertaShapedModel, hf.MPNetModel):
    """Drop-in for ``transformers.MPNetModel``: ``MPNetModel(config, add_pooling_layer=True, unpad=True)``."""

    fused_classes = FUSED_CLASSES
    output_class = BaseModelOutputWithPooling

    def encode(self, x, indices, layout, keep):
        layout = padding.with_columns(dataclasses.replace(layout, relative_bias=relative_bias(self.encoder)))
        return self.encoder.fused(x, layout, keep)
