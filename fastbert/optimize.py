"""``fastbert.optimize(model)``: turn every BERT-family encoder inside a model into fastbert's, in place.

fastbert's classes are transformers' classes with a fused mixin (``layers.py``, ``models/``), so an HF module becomes
ours by setting its ``__class__`` (and ``_configure`` for the little state ours add). No parameter is copied or
re-created: optimizers, tied weights, device placement and PEFT wrappers stay valid, and the object the caller holds
is the one that gets faster. An encoder whose configuration fastbert does not accelerate (decoder, cross-attention,
relative positions) is left as transformers' and announced.
"""

import collections
import logging
import sys
import threading
import warnings

from torch import nn
from transformers import PreTrainedModel

from . import announce, compat, modeling
from .int8 import decisions as int8_decisions
from .models import HEAD_CLASSES, MODEL_CLASSES

logger = logging.getLogger("fastbert")

_lock = threading.Lock()
_reports = collections.deque(maxlen=32)  # the latest optimize() calls that changed something, for fastbert.info()


def optimize(model: nn.Module) -> nn.Module:
    """Accelerate every BERT, RoBERTa, XLM-RoBERTa, CamemBERT, ELECTRA and DistilBERT encoder inside ``model`` (and
    the MLM head transforms of those families); returns ``model``.

    Works on the ``*For...`` heads, sentence-transformers ``SentenceTransformer`` and ``CrossEncoder`` models, PEFT
    models, or a bare ``*Model``; sentence-transformers' ``SparseEncoder`` (SPLADE) and ``MultiVectorEncoder`` get
    their heads fused as well (``st_retrieval.py``). Weights are shared, outputs unchanged (up to kernel rounding; zeros at padding
    positions, see docs/usage.md). What was swapped is logged on the ``fastbert`` logger (INFO) and listed in
    ``fastbert.info()["optimized"]``; an encoder left as transformers' is announced with the reason; finding no
    encoder at all is warned, naming the classes seen.
    """
    # (sentence-transformers before 4.0: a CrossEncoder is no module, it holds transformers' model as ``.model``)
    modules = model if isinstance(model, nn.Module) else getattr(model, "model", None)
    if not isinstance(modules, nn.Module):
        raise TypeError(f"fastbert.optimize takes a torch.nn.Module (a transformers, sentence-transformers or PEFT "
                        f"model), not {type(model).__name__}")
    accelerated, left = accelerate(modules)
    if not accelerated and not left:
        warnings.warn(
            f"fastbert.optimize found no BERT-family encoder to accelerate in {type(model).__name__} (it contains "
            f"{', '.join(model_classes(modules))}); the model is unchanged",
            RuntimeWarning,
            stacklevel=2,
        )
    return model


def accelerate(model: nn.Module, apply_saved_int8: bool = True) -> tuple[list[str], list[str]]:
    """``optimize``'s work, reported: (the encoders accelerated, those left as transformers'). An int8 decision
    saved with the checkpoint by ``fastbert.quantize`` is applied (``apply_saved_int8``)."""
    accelerated, left, heads = _swap(model)
    retrieval = _retrieval_heads(model) if accelerated else []
    if apply_saved_int8 and accelerated:
        saved = [m for m in model.modules() if isinstance(m, modeling.FusedModel) and int8_decisions.has_saved(m)]
        if saved:
            int8_decisions.apply_saved(model, saved)
    if accelerated or heads:
        report = (f"{type(model).__name__}: accelerated {', '.join(accelerated) or 'no encoder'}"
                  + (f" and {heads} MLM head transform(s)" if heads else "")
                  + (f"; fused heads: {', '.join(retrieval)}" if retrieval else ""))
        with _lock:
            _reports.append(report)
        logger.info("fastbert.optimize: %s", report)
    return accelerated, left


def _swap(model: nn.Module) -> tuple[list[str], list[str], int]:
    """Set fastbert's classes in place: (labels of the encoders accelerated, of those left as transformers',
    number of head modules fused)."""
    accelerated, left = [], []
    hf_models = tuple(MODEL_CLASSES)
    for name, module in model.named_modules():
        if not isinstance(module, hf_models):
            continue
        label = f"{name or type(model).__name__} ({type(module).__name__})"
        ours = MODEL_CLASSES.get(type(module), type(module) if isinstance(module, modeling.FusedModel) else None)
        why = compat.why_not_accelerated(module.config)
        if why or ours is None:
            reason = why or f"{type(module).__name__} is a subclass fastbert does not know"
            left.append(label)
            announce.fallback(f"optimize left {label} as transformers' model: {reason} is not accelerated")
            continue
        if type(module) is not ours:
            module.__class__ = ours
            module._configure()
        modeling.fuse_children(module, ours.fused_classes)
        accelerated.append(label)
    heads = [m for m in model.modules() if type(m) in HEAD_CLASSES]
    for module in heads:
        module.__class__ = HEAD_CLASSES[type(module)]
    _mark_first_token_readers(model)
    return accelerated, left, len(heads)


def _retrieval_heads(model: nn.Module) -> list[str]:
    """sentence-transformers' SparseEncoder and MultiVectorEncoder models under ``model`` get their heads fused
    (``st_retrieval.py``): what was changed. Nothing to do where sentence-transformers (>= 5 for SparseEncoder, 6.3
    for MultiVectorEncoder) was never imported: no model of it can be here."""
    if "sentence_transformers" not in sys.modules:
        return []
    try:
        from . import st_retrieval
    except ImportError:  # a sentence-transformers without these classes
        return []
    return st_retrieval.fuse_heads(model)


# transformers' heads that classify a sequence from its position 0 (every family's; BERT's through the pooler).
_FIRST_TOKEN_HEADS = ("ForSequenceClassification", "ForMultipleChoice")


def _mark_first_token_readers(model: nn.Module) -> None:
    """Tell each encoder inside a head that reads position 0 which head it is: a left-padded batch is then said
    once (its position 0 is zeros in the padding-free path, see ``FusedModel._note_first_token``)."""
    for head in model.modules():
        if getattr(getattr(head, "config", None), "classifier_pooling", "cls") == "mean":
            continue  # (ModernBERT's mean pooling: the zeros at padding are left out of the mean anyway)
        if type(head).__name__.endswith(_FIRST_TOKEN_HEADS):
            for encoder in head.modules():
                if isinstance(encoder, modeling.FusedModel):
                    encoder._read_by_head = f"its {type(head).__name__} head"


def reports() -> list[str]:
    """What each ``optimize`` call in this process accelerated."""
    with _lock:
        return list(_reports)


def model_classes(model: nn.Module) -> list[str]:
    """The classes a user would recognize in ``model``: its transformers models, else its direct children."""
    named = sorted({type(m).__name__ for m in model.modules() if isinstance(m, PreTrainedModel)})
    return named or sorted({type(m).__name__ for m in model.children()}) or [type(model).__name__]
