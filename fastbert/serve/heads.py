"""The head of a transformers ``*ForSequenceClassification`` model on packed sequences: the logits it computes from its
encoder's output, read from each sequence's rows instead of a padded [batch, seq_len] tensor.

transformers' heads read position 0 of the sequence output (or pool it, ModernBERT's ``mean``) and pass it through
modules of their own, some of them with a step written in the head's forward. Each head below calls those same
modules, in the same order, on ``first`` [B, hidden] (each sequence's first row) -- given as ``first[:, None]``, the
[B, 1, hidden] sequence output of one position, to the modules that take a sequence and read its position 0 -- so
the logits are the model's own, without padding, and PEFT, hooks or quantized modules inside the head run as
they do in transformers. ``CrossEncoder.predict`` is these logits and its activation (``engine.Scores``).
"""

import torch

from ..sentence import pool_packed


def _pooler(model, pooled: torch.Tensor) -> torch.Tensor:
    """BERT, GTE, NomicBERT: the encoder's pooler (tanh(dense(x[:, 0]))), dropout, a linear classifier."""
    return model.classifier(model.dropout(model.base_model.pooler(pooled[:, None])))


def _classification_head(model, pooled: torch.Tensor) -> torch.Tensor:
    """RoBERTa, XLM-RoBERTa, CamemBERT, ELECTRA, MPNet: one head module reading features[:, 0]."""
    return model.classifier(pooled[:, None])


def _context_pooler(model, pooled: torch.Tensor) -> torch.Tensor:
    """DeBERTa (v1, v2, v3): the head's ContextPooler (reading position 0), dropout, a linear classifier."""
    return model.classifier(model.dropout(model.pooler(pooled[:, None])))


def _distilbert(model, pooled: torch.Tensor) -> torch.Tensor:
    """DistilBERT: pre_classifier, ReLU (written in its forward, not a module), dropout, classifier."""
    return model.classifier(model.dropout(torch.relu(model.pre_classifier(pooled))))


def _modernbert(model, pooled: torch.Tensor) -> torch.Tensor:
    """ModernBERT: its prediction head (dense, activation, norm) on the first row or the mean, dropout,
    classifier."""
    return model.classifier(model.drop(model.head(pooled)))


# transformers' class name -> its head (by name: the same in every transformers version that has the class; a
# subclass of one of them may compute something else, and is not served)
HEADS = {
    "BertForSequenceClassification": _pooler, "GteForSequenceClassification": _pooler,
    "NomicBertForSequenceClassification": _pooler,
    "RobertaForSequenceClassification": _classification_head,
    "XLMRobertaForSequenceClassification": _classification_head,
    "CamembertForSequenceClassification": _classification_head,
    "ElectraForSequenceClassification": _classification_head, "MPNetForSequenceClassification": _classification_head,
    "DebertaForSequenceClassification": _context_pooler, "DebertaV2ForSequenceClassification": _context_pooler,
    "DistilBertForSequenceClassification": _distilbert,
    "ModernBertForSequenceClassification": _modernbert,
}


def why_not(model) -> str | None:
    """Why ``model``'s head cannot score packed sequences (None: it can)."""
    if type(model).__name__ not in HEADS:
        return (f"{type(model).__name__} is not a sequence-classification head fastbert serves packed (it serves "
                f"{', '.join(sorted(HEADS))})")
    if not hasattr(model.base_model, "forward_packed"):
        return (f"{type(model.base_model).__name__} is not a family fastbert accelerates, so it cannot be served "
                "padding-free")
    return None


def logits(model, hidden: torch.Tensor, seqlens: torch.Tensor) -> torch.Tensor:
    """hidden [N, hidden] (``forward_packed``), seqlens [B] int64 on its device -> the head's logits [B, labels]."""
    if getattr(model.config, "classifier_pooling", "cls") == "mean":  # (ModernBERT's other pooling)
        pooled = pool_packed(hidden, seqlens, ("mean",))
    else:
        pooled = hidden[torch.cumsum(seqlens, 0) - seqlens]  # [B, hidden]: each sequence's first row
    return HEADS[type(model).__name__](model, pooled)
