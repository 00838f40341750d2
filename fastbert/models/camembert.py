"""CamemBERT: RoBERTa under other class names."""

from transformers.models.camembert import modeling_camembert as hf

from .. import layers
from .roberta import FusedLMHead, RobertaShapedModel

FUSED_CLASSES = layers.fused_classes(hf, "Camembert", layers.BERT_SHAPED, globals())


class CamembertLMHead(FusedLMHead, hf.CamembertLMHead):
    pass


HEAD_CLASSES = {hf.CamembertLMHead: CamembertLMHead}


class CamembertModel(RobertaShapedModel, hf.CamembertModel):
    """Drop-in for ``transformers.CamembertModel``: ``CamembertModel(config, add_pooling_layer=True, unpad=True)``."""

    fused_classes = FUSED_CLASSES
