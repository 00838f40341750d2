"""BERT: the family's reference shape. Every other family file maps its transformers classes onto the same mixins.

To add a BERT-shaped family (same module names as BERT's: ``query``, ``dense``, ``LayerNorm``, ...), copy this file:
``layers.fused_classes`` makes ``{Prefix}Embeddings``, ``{Prefix}SelfAttention``, ..., ``{Prefix}Encoder`` ours, and
the model class states what differs from BERT (see ``roberta.py`` for positions, ``electra.py`` for a projection).
"""

from transformers.models.bert import modeling_bert as hf
from transformers.modeling_outputs import BaseModelOutputWithPoolingAndCrossAttentions

from .. import layers, modeling

# BertEmbeddings, BertSelfAttention, BertSelfOutput, BertAttention, BertIntermediate, BertOutput, BertLayer,
# BertEncoder (+ transformers 4.x's per-implementation attention classes), defined in this module.
FUSED_CLASSES = layers.fused_classes(hf, "Bert", layers.BERT_SHAPED, globals())


class BertPredictionHeadTransform(layers.FusedPredictionHeadTransform, hf.BertPredictionHeadTransform):
    pass


# The MLM head's transform (dense -> act -> LayerNorm), fused wherever optimize() finds one.
HEAD_CLASSES = {hf.BertPredictionHeadTransform: BertPredictionHeadTransform}


class BertModel(modeling.FusedModel, hf.BertModel):
    """Drop-in for ``transformers.BertModel``: ``BertModel(config, add_pooling_layer=True, unpad=True)``."""

    fused_classes = FUSED_CLASSES
    output_class = BaseModelOutputWithPoolingAndCrossAttentions
