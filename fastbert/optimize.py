"""``fastbert.optimize(model)``: turn every HF BERT encoder inside a model into fastbert's, in place.

fastbert's classes are transformers' classes with a fused mixin (``layers.py``), so an HF module becomes ours by
setting its ``__class__`` (and ``_configure`` for the little state ours add). No parameter is copied or re-created:
optimizers, tied weights, device placement and PEFT wrappers stay valid, and the object the caller holds is the one
that gets faster. An encoder whose configuration fastbert does not accelerate (decoder, cross-attention, relative
positions) is left as transformers' and announced.
"""

import logging
import warnings

from torch import nn
from transformers import PreTrainedModel
from transformers.models.bert import modeling_bert as hf

from . import announce, modeling

logger = logging.getLogger("fastbert")


def optimize(model: nn.Module) -> nn.Module:
    """Accelerate every ``transformers.BertModel`` inside ``model`` (and MLM head transforms); returns ``model``.

    Works on BertFor* heads, sentence-transformers models, PEFT models, or a bare BertModel. Weights are shared,
    outputs unchanged (up to kernel rounding; zeros at padding positions, see the README). What was swapped is
    logged on the ``fastbert`` logger; finding nothing to accelerate is warned, naming the classes seen.
    """
    accelerated, left = [], []
    for name, module in model.named_modules():
        if not isinstance(module, hf.BertModel):
            continue
        label = name or type(model).__name__
        why = modeling.why_not_accelerated(module.config)
        if why or type(module) not in (hf.BertModel, modeling.BertModel):
            reason = why or f"{type(module).__name__} is a subclass of BertModel fastbert does not know"
            left.append(label)
            announce.fallback(f"optimize left {label} as transformers' BertModel: {reason} is not accelerated")
            continue
        if type(module) is hf.BertModel:
            module.__class__ = modeling.BertModel
            module._configure(module.config)
        modeling.fuse_children(module, modeling.FUSED_CLASSES)
        accelerated.append(label)
    transforms = [m for m in model.modules() if type(m) is hf.BertPredictionHeadTransform]
    for module in transforms:
        module.__class__ = modeling.BertPredictionHeadTransform
    if accelerated or transforms:
        logger.info("fastbert.optimize: accelerated %s%s", ", ".join(accelerated) or "no encoder",
                    f" and {len(transforms)} MLM head transform(s)" if transforms else "")
    elif not left:
        warnings.warn(
            f"fastbert.optimize found no BERT encoder to accelerate in {type(model).__name__} (it contains "
            f"{', '.join(_model_classes(model))}); the model is unchanged",
            RuntimeWarning,
            stacklevel=2,
        )
    return model


def _model_classes(model: nn.Module) -> list[str]:
    """The classes a user would recognize in ``model``: its transformers models, else its direct children."""
    named = sorted({type(m).__name__ for m in model.modules() if isinstance(m, PreTrainedModel)})
    return named or sorted({type(m).__name__ for m in model.children()}) or [type(model).__name__]
