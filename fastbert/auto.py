"""``fastbert.AutoModel`` and friends: transformers' Auto classes, with fastbert inside what they return.

    model = fastbert.AutoModelForSequenceClassification.from_pretrained("BAAI/bge-reranker-base")

loads exactly what ``transformers.AutoModelForSequenceClassification`` loads (same arguments, same class, same
weights) and runs ``fastbert.optimize`` on it. An architecture fastbert does not accelerate comes back as
transformers' model, with a one-time note saying so (and listed in ``fastbert.info()["fallbacks"]``).
"""

import transformers

from . import announce
from .optimize import accelerate, model_classes


class _FastAuto:
    """Base of the Auto classes below: ``hf_auto`` is the transformers Auto class they load through."""

    hf_auto: type

    def __init__(self, *args, **kwargs):
        raise EnvironmentError(f"{type(self).__name__} is built with from_pretrained(...) or from_config(...)")

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        """``transformers.<Auto>.from_pretrained(*args, **kwargs)``, accelerated."""
        return _accelerated(cls.hf_auto.from_pretrained(*args, **kwargs))

    @classmethod
    def from_config(cls, config, **kwargs):
        """``transformers.<Auto>.from_config(config, **kwargs)``, accelerated."""
        return _accelerated(cls.hf_auto.from_config(config, **kwargs))


def _accelerated(model):
    accelerated, left = accelerate(model)
    if not accelerated and not left:
        announce.fallback(f"{', '.join(model_classes(model))} is not a family fastbert accelerates (BERT, RoBERTa, "
                          "XLM-RoBERTa, CamemBERT, ELECTRA, DistilBERT, GTE, NomicBERT, ModernBERT, MPNet, "
                          "DeBERTa, DeBERTa-v2): transformers' model is returned unchanged")
    return model


def _auto(hf_auto: type) -> type:
    """fastbert's counterpart of the transformers Auto class ``hf_auto`` (same name, in this module)."""
    return type(hf_auto.__name__, (_FastAuto,), {
        "hf_auto": hf_auto, "__module__": __name__,
        "__doc__": f"``transformers.{hf_auto.__name__}``, with fastbert inside the models it returns.",
    })


AutoModel = _auto(transformers.AutoModel)
AutoModelForMaskedLM = _auto(transformers.AutoModelForMaskedLM)
AutoModelForSequenceClassification = _auto(transformers.AutoModelForSequenceClassification)
AutoModelForTokenClassification = _auto(transformers.AutoModelForTokenClassification)
AutoModelForQuestionAnswering = _auto(transformers.AutoModelForQuestionAnswering)
AutoModelForMultipleChoice = _auto(transformers.AutoModelForMultipleChoice)
AutoModelForPreTraining = _auto(transformers.AutoModelForPreTraining)
