"""CamemBERT: RoBERTa under other class names."""

from transformers.models.camembert import modeling_camembert as hf

from .. import layers
from .roberta import FusedLMHead, RobertaShapedModel


class CamembertEmbeddings(layers.FusedEmbeddings, hf.CamembertEmbeddings):
    pass


class CamembertSelfAttention(layers.FusedSelfAttention, hf.CamembertSelfAttention):
    pass


class CamembertSelfOutput(layers.FusedDenseResidualLayerNorm, hf.CamembertSelfOutput):
    pass


class CamembertAttention(layers.FusedAttention, hf.CamembertAttention):
    pass


class CamembertIntermediate(layers.FusedIntermediate, hf.CamembertIntermediate):
    pass


class CamembertOutput(layers.FusedDenseResidualLayerNorm, hf.CamembertOutput):
    pass


class CamembertLayer(layers.FusedLayer, hf.CamembertLayer):
    pass


class CamembertEncoder(layers.FusedEncoder, hf.CamembertEncoder):
    pass


class CamembertLMHead(FusedLMHead, hf.CamembertLMHead):
    pass


FUSED_CLASSES = layers.fused_map(CamembertEmbeddings, CamembertSelfAttention, CamembertSelfOutput, CamembertAttention,
                                 CamembertIntermediate, CamembertOutput, CamembertLayer, CamembertEncoder)
FUSED_CLASSES |= layers.transformers4_variants(hf, ("CamembertSdpaSelfAttention", "CamembertFlashAttention2"),
                                               layers.FusedSelfAttention, globals())
HEAD_CLASSES = layers.fused_map(CamembertLMHead)


class CamembertModel(RobertaShapedModel, hf.CamembertModel):
    """Drop-in for ``transformers.CamembertModel``: ``CamembertModel(config, add_pooling_layer=True, unpad=True)``."""

    fused_classes = FUSED_CLASSES
