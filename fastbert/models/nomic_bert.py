"""NomicBERT (nomic-embed-text-v1/v1.5, arctic-embed-m-long): GTE's block without biases, SwiGLU, 2 token types.

transformers names its modules as GTE's (``self_attn.q_proj``, ``mlp.gate_proj``, ``post_mlp_layernorm``, ...): the
family is the rotary + GLU mixins (``rotary_glu.py``) under the NomicBert prefix. Dynamic NTK (frequencies that
follow the input's length) runs transformers' forward, said (``compat.why_not_accelerated``). The MLM head's
transform (SiLU by default, which has no fused head kernel) runs as transformers'.
"""

from transformers.models.nomic_bert import modeling_nomic_bert as hf

from .. import layers
from . import rotary_glu


class NomicBertEmbeddings(layers.FusedEmbeddings, hf.NomicBertEmbeddings):
    pass


class NomicBertAttention(rotary_glu.FusedSelfAttention, hf.NomicBertAttention):
    pass


class NomicBertMLP(rotary_glu.FusedMLP, hf.NomicBertMLP):
    pass


class NomicBertLayer(rotary_glu.FusedLayer, hf.NomicBertLayer):
    pass


FUSED_CLASSES = layers.fused_map(NomicBertEmbeddings, NomicBertAttention, NomicBertMLP, NomicBertLayer)
HEAD_CLASSES = {}


class NomicBertModel(rotary_glu.RotaryGluModel, hf.NomicBertModel):
    """Drop-in for ``transformers.NomicBertModel``: ``NomicBertModel(config, add_pooling_layer=False, unpad=True)``."""

    fused_classes = FUSED_CLASSES
