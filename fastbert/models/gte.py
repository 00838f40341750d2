"""GTE ("new" GTE: gte-base-en-v1.5, gte-multilingual-base, arctic-embed-m-v2.0): the rotary + GLU block
(``rotary_glu.py``) with biases, GeGLU, token types optional (``type_vocab_size`` 0: none), RoBERTa's MLM head.

    embeddings = LayerNorm(word[ids] + token_type[tt])           (no position table: positions are rotary)
"""

from transformers.models.gte import modeling_gte as hf

from .. import layers
from . import roberta, rotary_glu

FUSED_CLASSES = layers.fused_classes(hf, "Gte", rotary_glu.MIXINS, globals())
# The MLM head is RoBERTa's (dense -> gelu -> layer_norm -> decoder): GteLMHead gets the same fused forward.
HEAD_CLASSES = layers.fused_classes(hf, "Gte", roberta.HEAD_MIXINS, globals())


class GteModel(rotary_glu.RotaryGluModel, hf.GteModel):
    """Drop-in for ``transformers.GteModel``: ``GteModel(config, add_pooling_layer=False, unpad=True)``."""

    fused_classes = FUSED_CLASSES
