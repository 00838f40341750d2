"""RoBERTa: BERT's modules, positions numbered from ``padding_idx + 1`` over the non-padding tokens.

XLM-RoBERTa and CamemBERT are RoBERTa under other class names: their files write the same classes over their
transformers modules and share ``RobertaShapedModel`` and ``FusedLMHead``.
"""

import torch
from transformers.activations import gelu
from transformers.modeling_outputs import BaseModelOutputWithPoolingAndCrossAttentions
from transformers.models.roberta import modeling_roberta as hf

from .. import layers, modeling
from ..ops import norm


class FusedLMHead(layers.Fused):
    """RoBERTa's MLM head: decoder(LayerNorm(gelu(dense(x)))) with gelu + LayerNorm fused (HF calls the exact-erf
    ``transformers.activations.gelu``)."""

    def forward(self, features: torch.Tensor, **kwargs) -> torch.Tensor:
        x = features.reshape(-1, features.shape[-1])
        x = norm.dense_act_layer_norm(x, self.dense, gelu, self.layer_norm).view(features.shape)
        return self.decoder(x)


class RobertaShapedModel(modeling.FusedModel):
    """RoBERTa's numbering: without ``position_ids``, a token's position is ``padding_idx`` + its rank among the
    row's non-padding tokens (padding tokens get ``padding_idx``), whatever the attention mask says; with
    ``inputs_embeds``, positions run ``padding_idx + 1 ..`` in order."""

    output_class = BaseModelOutputWithPoolingAndCrossAttentions

    def max_seq_len(self, input_ids):
        # From input_ids the largest position depends on how many tokens are padding: the range check tells.
        return None if input_ids is not None else self.config.max_position_embeddings - self.embeddings.padding_idx - 1

    def position_numbering(self):
        return "rank", self.embeddings.padding_idx


class RobertaEmbeddings(layers.FusedEmbeddings, hf.RobertaEmbeddings):
    pass


class RobertaSelfAttention(layers.FusedSelfAttention, hf.RobertaSelfAttention):
    pass


class RobertaSelfOutput(layers.FusedDenseResidualLayerNorm, hf.RobertaSelfOutput):
    pass


class RobertaAttention(layers.FusedAttention, hf.RobertaAttention):
    pass


class RobertaIntermediate(layers.FusedIntermediate, hf.RobertaIntermediate):
    pass


class RobertaOutput(layers.FusedDenseResidualLayerNorm, hf.RobertaOutput):
    pass


class RobertaLayer(layers.FusedLayer, hf.RobertaLayer):
    pass


class RobertaEncoder(layers.FusedEncoder, hf.RobertaEncoder):
    pass


class RobertaLMHead(FusedLMHead, hf.RobertaLMHead):
    pass


FUSED_CLASSES = layers.fused_map(RobertaEmbeddings, RobertaSelfAttention, RobertaSelfOutput, RobertaAttention,
                                 RobertaIntermediate, RobertaOutput, RobertaLayer, RobertaEncoder)
FUSED_CLASSES |= layers.transformers4_variants(hf, ("RobertaSdpaSelfAttention", "RobertaFlashAttention2"),
                                               layers.FusedSelfAttention, globals())
HEAD_CLASSES = layers.fused_map(RobertaLMHead)


class RobertaModel(RobertaShapedModel, hf.RobertaModel):
    """Drop-in for ``transformers.RobertaModel``: ``RobertaModel(config, add_pooling_layer=True, unpad=True)``."""

    fused_classes = FUSED_CLASSES
