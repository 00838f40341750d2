"""ELECTRA: BERT's modules with embeddings of their own width (``embedding_size``), projected to ``hidden_size`` by
``embeddings_project`` before the encoder; no pooler."""

from transformers.modeling_outputs import BaseModelOutputWithPastAndCrossAttentions
from transformers.models.electra import modeling_electra as hf

from .. import layers, modeling
from ..ops import gemm


class ElectraEmbeddings(layers.FusedEmbeddings, hf.ElectraEmbeddings):
    pass


class ElectraSelfAttention(layers.FusedSelfAttention, hf.ElectraSelfAttention):
    pass


class ElectraSelfOutput(layers.FusedDenseResidualLayerNorm, hf.ElectraSelfOutput):
    pass


class ElectraAttention(layers.FusedAttention, hf.ElectraAttention):
    pass


class ElectraIntermediate(layers.FusedIntermediate, hf.ElectraIntermediate):
    pass


class ElectraOutput(layers.FusedDenseResidualLayerNorm, hf.ElectraOutput):
    pass


class ElectraLayer(layers.FusedLayer, hf.ElectraLayer):
    pass


class ElectraEncoder(layers.FusedEncoder, hf.ElectraEncoder):
    pass


class ElectraGeneratorPredictions(layers.FusedPredictionHeadTransform, hf.ElectraGeneratorPredictions):
    """The generator's MLM transform: dense -> gelu -> LayerNorm, fused like BERT's."""

    activation_name = "activation"


FUSED_CLASSES = layers.fused_map(ElectraEmbeddings, ElectraSelfAttention, ElectraSelfOutput, ElectraAttention,
                                 ElectraIntermediate, ElectraOutput, ElectraLayer, ElectraEncoder)
FUSED_CLASSES |= layers.transformers4_variants(hf, ("ElectraSdpaSelfAttention", "ElectraFlashAttention2"),
                                               layers.FusedSelfAttention, globals())
HEAD_CLASSES = layers.fused_map(ElectraGeneratorPredictions)


class ElectraModel(modeling.FusedModel, hf.ElectraModel):
    """Drop-in for ``transformers.ElectraModel``: ``ElectraModel(config, unpad=True)``."""

    fused_classes = FUSED_CLASSES
    output_class = BaseModelOutputWithPastAndCrossAttentions

    def embed(self, indices, inputs_embeds):
        x = self.embeddings.fused(indices, inputs_embeds)  # [N, embedding_size]
        project = self._modules.get("embeddings_project")  # (only when embedding_size != hidden_size)
        return x if project is None else gemm.linear(x, project)  # [N, hidden]
