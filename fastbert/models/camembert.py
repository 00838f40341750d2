"""CamemBERT: RoBERTa under other class names."""

from transformers.models.camembert import modeling_camembert as hf

from .. import layers
from .roberta import HEAD_MIXINS, RobertaShapedModel

FUSED_CLASSES = layers.fused_classes(hf, "Camembert", layers.BERT_SHAPED, globals())
HEAD_CLASSES = layers.fused_classes(hf, "Camembert", HEAD_MIXINS, globals())


class CamembertModel(RobertaShapedModel, hf.CamembertModel):
    """Drop-in for ``transformers.CamembertModel``: ``CamembertModel(config, add_pooling_layer=True, unpad=True)``."""

    fused_classes = FUSED_CLASSES
