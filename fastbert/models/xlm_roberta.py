"""XLM-RoBERTa (bge-m3, multilingual-e5, the bge rerankers): RoBERTa under other class names."""

from transformers.models.xlm_roberta import modeling_xlm_roberta as hf

from .. import layers
from .roberta import FusedLMHead, RobertaShapedModel


class XLMRobertaEmbeddings(layers.FusedEmbeddings, hf.XLMRobertaEmbeddings):
    pass


class XLMRobertaSelfAttention(layers.FusedSelfAttention, hf.XLMRobertaSelfAttention):
    pass


class XLMRobertaSelfOutput(layers.FusedDenseResidualLayerNorm, hf.XLMRobertaSelfOutput):
    pass


class XLMRobertaAttention(layers.FusedAttention, hf.XLMRobertaAttention):
    pass


class XLMRobertaIntermediate(layers.FusedIntermediate, hf.XLMRobertaIntermediate):
    pass


class XLMRobertaOutput(layers.FusedDenseResidualLayerNorm, hf.XLMRobertaOutput):
    pass


class XLMRobertaLayer(layers.FusedLayer, hf.XLMRobertaLayer):
    pass


class XLMRobertaEncoder(layers.FusedEncoder, hf.XLMRobertaEncoder):
    pass


class XLMRobertaLMHead(FusedLMHead, hf.XLMRobertaLMHead):
    pass


FUSED_CLASSES = layers.fused_map(XLMRobertaEmbeddings, XLMRobertaSelfAttention, XLMRobertaSelfOutput,
                                 XLMRobertaAttention, XLMRobertaIntermediate, XLMRobertaOutput, XLMRobertaLayer,
                                 XLMRobertaEncoder)
FUSED_CLASSES |= layers.transformers4_variants(hf, ("XLMRobertaSdpaSelfAttention", "XLMRobertaFlashAttention2"),
                                               layers.FusedSelfAttention, globals())
HEAD_CLASSES = layers.fused_map(XLMRobertaLMHead)


class XLMRobertaModel(RobertaShapedModel, hf.XLMRobertaModel):
    """Drop-in for ``transformers.XLMRobertaModel``: ``XLMRobertaModel(config, add_pooling_layer=True, unpad=True)``."""

    fused_classes = FUSED_CLASSES
