"""BERT: the family's reference shape, the mixins of ``layers.py`` over transformers' BERT modules.

To add a family with BERT's module names (``query``, ``dense``, ``LayerNorm``, ...), copy this file with its prefix:
one class per transformers module, ``FUSED_CLASSES`` mapping theirs to ours, and the model class stating what differs
from BERT (``roberta.py`` for positions, ``electra.py`` for a projection after the embeddings).
"""

from transformers.modeling_outputs import BaseModelOutputWithPoolingAndCrossAttentions
from transformers.models.bert import modeling_bert as hf

from .. import layers, modeling


class BertEmbeddings(layers.FusedEmbeddings, hf.BertEmbeddings):
    pass


class BertSelfAttention(layers.FusedSelfAttention, hf.BertSelfAttention):
    pass


class BertSelfOutput(layers.FusedDenseResidualLayerNorm, hf.BertSelfOutput):
    pass


class BertAttention(layers.FusedAttention, hf.BertAttention):
    pass


class BertIntermediate(layers.FusedIntermediate, hf.BertIntermediate):
    pass


class BertOutput(layers.FusedDenseResidualLayerNorm, hf.BertOutput):
    pass


class BertLayer(layers.FusedLayer, hf.BertLayer):
    pass


class BertEncoder(layers.FusedEncoder, hf.BertEncoder):
    pass


class BertPredictionHeadTransform(layers.FusedPredictionHeadTransform, hf.BertPredictionHeadTransform):
    """The MLM head's transform (dense -> act -> LayerNorm), fused wherever ``optimize`` finds one."""


FUSED_CLASSES = layers.fused_map(BertEmbeddings, BertSelfAttention, BertSelfOutput, BertAttention, BertIntermediate,
                                 BertOutput, BertLayer, BertEncoder)
FUSED_CLASSES |= layers.transformers4_variants(hf, ("BertSdpaSelfAttention", "BertFlashAttention2"),
                                               layers.FusedSelfAttention, globals())
HEAD_CLASSES = layers.fused_map(BertPredictionHeadTransform)


class BertModel(modeling.FusedModel, hf.BertModel):
    """Drop-in for ``transformers.BertModel``: ``BertModel(config, add_pooling_layer=True, unpad=True)``."""

    fused_classes = FUSED_CLASSES
    output_class = BaseModelOutputWithPoolingAndCrossAttentions
