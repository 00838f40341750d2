"""XLM-RoBERTa (bge-m3, multilingual-e5, the bge rerankers): RoBERTa under other class names."""

from transformers.models.xlm_roberta import modeling_xlm_roberta as hf

from .. import layers
from .roberta import HEAD_MIXINS, RobertaShapedModel

FUSED_CLASSES = layers.fused_classes(hf, "XLMRoberta", layers.BERT_SHAPED, globals())
HEAD_CLASSES = layers.fused_classes(hf, "XLMRoberta", HEAD_MIXINS, globals())


class XLMRobertaModel(RobertaShapedModel, hf.XLMRobertaModel):
    """Drop-in for ``transformers.XLMRobertaModel``: ``XLMRobertaModel(config, add_pooling_layer=True, unpad=True)``."""

    fused_classes = FUSED_CLASSES
