"""GTE ("new" GTE: gte-base-en-v1.5, gte-multilingual-base, arctic-embed-m-v2.0): the rotary + GLU block
(``rotary_glu.py``) with biases, GeGLU, token types optional (``type_vocab_size`` 0: none), RoBERTa's MLM head.

    embeddings = LayerNorm(word[ids] + token_type[tt])           (no position table: positions are rotary)
"""

from transformers.models.gte import modeling_gte as hf

from .. import layers
from . import rotary_glu
from .roberta import FusedLMHead


class GteEmbeddings(layers.FusedEmbeddings, hf.GteEmbeddings):
    pass


class GteAttention(rotary_glu.FusedSelfAttention, hf.GteAttention):
    pass


class GteMLP(rotary_glu.FusedMLP, hf.GteMLP):
    pass


class GteLayer(rotary_glu.FusedLayer, hf.GteLayer):
    pass


class GteLMHead(FusedLMHead, hf.GteLMHead):
    """RoBERTa's MLM head (dense -> gelu -> layer_norm -> decoder), with the same fused forward."""


FUSED_CLASSES = layers.fused_map(GteEmbeddings, GteAttention, GteMLP, GteLayer)
HEAD_CLASSES = layers.fused_map(GteLMHead)


class GteModel(rotary_glu.RotaryGluModel, hf.GteModel):
    """Drop-in for ``transformers.GteModel``: ``GteModel(config, add_pooling_layer=False, unpad=True)``."""

    fused_classes = FUSED_CLASSES
