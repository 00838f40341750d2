"""``fastbert.optimize(model)``: turn every HF BERT encoder inside a model into fastbert's, in place.

The swap is by class: fastbert's modules keep HF's children and parameter names, so each HF module becomes ours by
setting its ``__class__`` and calling ``_configure(config)`` for the little state ours derive from the config. No
parameter is copied or re-created: optimizers, tied weights and device placement stay valid, and the object the
caller holds is the one that gets faster.
"""

from torch import nn
from transformers.models.bert import modeling_bert as hf

from . import modeling

# HF class -> ours. HF's own subclasses (e.g. attention-implementation variants in older transformers) match too.
_SWAPS = [
    (hf.BertModel, modeling.BertModel),
    (hf.BertEmbeddings, modeling.BertEmbeddings),
    (hf.BertEncoder, modeling.BertEncoder),
    (hf.BertLayer, modeling.BertLayer),
    (hf.BertAttention, modeling.BertAttention),
    (hf.BertSelfAttention, modeling.BertSelfAttention),
    (hf.BertSelfOutput, modeling.BertSelfOutput),
    (hf.BertIntermediate, modeling.BertIntermediate),
    (hf.BertOutput, modeling.BertOutput),
    (hf.BertPooler, modeling.BertPooler),
]


def optimize(model: nn.Module) -> nn.Module:
    """Swap every ``transformers.BertModel`` in ``model`` (and MLM head transforms) for fastbert's; returns ``model``.

    Works on BertForSequenceClassification, BertForMaskedLM, BertForTokenClassification, sentence-transformers
    models, or a bare BertModel. Weights are shared, outputs unchanged (up to kernel rounding). Raises
    NotImplementedError, before changing anything, for configurations fastbert does not support (decoders,
    cross-attention, relative position embeddings).
    """
    encoders = [m for m in model.modules() if isinstance(m, hf.BertModel)]
    for encoder in encoders:
        modeling.check_supported(encoder.config)
    for encoder in encoders:
        for module in list(encoder.modules()):
            _swap(module, encoder.config)
    config = getattr(model, "config", encoders[0].config if encoders else None)
    if config is not None:
        for module in model.modules():
            if type(module) is hf.BertPredictionHeadTransform:
                _become(module, modeling.BertPredictionHeadTransform, config)
    return model


def _swap(module: nn.Module, config) -> None:
    for hf_class, ours in _SWAPS:
        if isinstance(module, hf_class) and not isinstance(module, ours):
            _become(module, ours, config)
            return


def _become(module: nn.Module, ours: type, config) -> None:
    module.__class__ = ours
    module._configure(config)
