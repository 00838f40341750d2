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

import torch
from transformers.modeling_outputs import BaseModelOutputWithPooling
from transformers.models.mpnet import modeling_mpnet as hf

from .. import layers, padding
from ..ops import norm
from ..ops.attention import attention
from ..ops.gemm import stacked
from ..positions import Positions
from .roberta import FusedLMHead, RobertaShapedModel

# transformers' bucket function: 32 buckets (MPNetEncoder passes its default, whatever the config says), and every
# distance of 128 or more in the last one.
_BUCKETS, _RADIUS = 32, 128


class MPNetEmbeddings(layers.FusedEmbeddings, hf.MPNetEmbeddings):
    pass


class MPNetSelfAttention(layers.Fused, hf.MPNetSelfAttention):
    def fused(self, x: torch.Tensor, layout: padding.TokenLayout, positions: Positions) -> torch.Tensor:
        """[N, hidden] -> attention context [N, hidden], before ``o``."""
        qkv = stacked(x, (self.q, self.k, self.v))  # [N, 3 * hidden]
        p = self.dropout.p if self.training else 0.0
        return attention(qkv, layout, self.num_attention_heads, p, relative_bias=positions.relative_bias)


class MPNetAttention(layers.Fused, hf.MPNetAttention):
    bypassed = ("attn",)

    def fused(self, x: torch.Tensor, layout: padding.TokenLayout, positions: Positions) -> torch.Tensor:
        return norm.dense_residual_layer_norm(self.attn.fused(x, layout, positions), x, self.attn.o, self.dropout,
                                              self.LayerNorm)


class MPNetIntermediate(layers.FusedIntermediate, hf.MPNetIntermediate):
    pass


class MPNetOutput(layers.FusedDenseResidualLayerNorm, hf.MPNetOutput):
    pass


class MPNetLayer(layers.FusedLayer, hf.MPNetLayer):
    pass


class MPNetEncoder(layers.FusedEncoder, hf.MPNetEncoder):
    pass


class MPNetLMHead(FusedLMHead, hf.MPNetLMHead):
    """RoBERTa's MLM head (dense -> gelu -> layer_norm -> decoder), with the same fused forward."""


FUSED_CLASSES = layers.fused_map(MPNetEmbeddings, MPNetSelfAttention, MPNetAttention, MPNetIntermediate, MPNetOutput,
                                 MPNetLayer, MPNetEncoder)
HEAD_CLASSES = layers.fused_map(MPNetLMHead)


def relative_bias(encoder: torch.nn.Module) -> torch.Tensor:
    """The encoder's relative-position bias by distance: float32 [H, 2R + 1], entry d + R for j - i = d. Through the
    bias module itself (an Embedding, or whatever wraps it), so gradients and hooks reach it as in transformers."""
    table = encoder.relative_attention_bias
    distance = torch.arange(-_RADIUS, _RADIUS + 1, device=table.weight.device)
    buckets = hf.MPNetEncoder.relative_position_bucket(distance, num_buckets=_BUCKETS, max_distance=_RADIUS)
    return table(buckets).t().float().contiguous()


class MPNetModel(RobertaShapedModel, hf.MPNetModel):
    """Drop-in for ``transformers.MPNetModel``: ``MPNetModel(config, add_pooling_layer=True, unpad=True)``."""

    fused_classes = FUSED_CLASSES
    output_class = BaseModelOutputWithPooling

    def positions(self, indices, layout):
        return padding.with_columns(layout), Positions(relative_bias=relative_bias(self.encoder))
