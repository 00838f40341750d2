"""ELECTRA: BERT's modules with embeddings of their own width (``embedding_size``), projected to ``hidden_size`` by
``embeddings_project`` before the encoder; no pooler."""

from transformers.modeling_outputs import BaseModelOutputWithPastAndCrossAttentions
from transformers.models.electra import modeling_electra as hf

from .. import layers, modeling, ops

FUSED_CLASSES = layers.fused_classes(hf, "Electra", layers.BERT_SHAPED, globals())


class ElectraGeneratorPredictions(layers.FusedPredictionHeadTransform, hf.ElectraGeneratorPredictions):
    """The generator's MLM transform: dense -> gelu -> LayerNorm, fused like BERT's."""

    activation_name = "activation"


HEAD_CLASSES = {hf.ElectraGeneratorPredictions: ElectraGeneratorPredictions}


class ElectraModel(modeling.FusedModel, hf.ElectraModel):
    """Drop-in for ``transformers.ElectraModel``: ``ElectraModel(config, unpad=True)``."""

    fused_classes = FUSED_CLASSES
    output_class = BaseModelOutputWithPastAndCrossAttentions

    def embed(self, indices, inputs_embeds):
        x = self.embeddings.fused(indices, inputs_embeds)  # [N, embedding_size]
        project = self._modules.get("embeddings_project")  # (only when embedding_size != hidden_size)
        return x if project is None else ops.linear(x, project)  # [N, hidden]
