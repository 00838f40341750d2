"""SPLADE on a fastbert encoder: a masked-LM model's sparse vector per sequence, padding-free from the embedding to
the pooled vector.

    input_ids, attention_mask, token_type_ids [B, S]
      -> encoder.token_states: the real tokens' last hidden states               [N, hidden]   (modeling.py)
      -> the MLM head's transform: dense -> act -> LayerNorm                    [N, hidden]   (ops/norm.py)
      -> splade_pool: pool over each sequence of act(decoder(x))                [B, vocab]    (ops/splade_pool.py)

what sentence-transformers' SparseEncoder computes with a Transformer (``fill-mask``) and SpladePooling, where
transformers' MLM head writes [B, S, vocab] logits, padding included, and SpladePooling a masked copy of them.
``splade_packed`` takes sequences back to back instead (``forward_packed``: the server's batches).

``MLMHead.of(model)`` takes the masked-LM classes whose head is "a transform, then one Linear to the vocabulary":
BERT, RoBERTa, XLM-RoBERTa, CamemBERT and DistilBERT. The modules whose ``forward`` this path does not call (the
model, its head) must be transformers' own classes (or fastbert's fused ones for them) without hooks; the transform
and the decoder are called or fused as the ops decide (a decoder wrapped by PEFT is called block by block).
"""

import dataclasses
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.bert import modeling_bert
from transformers.models.camembert import modeling_camembert
from transformers.models.distilbert import modeling_distilbert
from transformers.models.roberta import modeling_roberta
from transformers.models.xlm_roberta import modeling_xlm_roberta

from . import compat, modeling, padding
from .models import HEAD_CLASSES
from .ops import norm
from .ops.splade_pool import splade_pool
from .plain import has_hooks


@dataclasses.dataclass(frozen=True, repr=False)
class MLMHead:
    """A masked-LM model seen as encoder -> transform -> decoder."""

    encoder: modeling.FusedModel
    transform: Callable[[torch.Tensor], torch.Tensor]  # [N, hidden] -> [N, hidden]
    decoder: nn.Module  # hidden -> vocab: a Linear, called where it is not plain

    @classmethod
    def of(cls, model: nn.Module) -> "MLMHead | str":
        """The head of ``model``, or why this path cannot run it (it then runs as transformers runs it)."""
        parts = _PARTS.get(type(model))
        if parts is None:
            return (f"{type(model).__name__} is not a masked-LM class whose head fastbert fuses "
                    f"({', '.join(sorted(c.__name__ for c in _PARTS))})")
        encoder_name, bypassed, split = parts
        if has_hooks(model):
            return f"{type(model).__name__} has hooks (or a forward of its own)"
        for path, expected in bypassed:
            module = model.get_submodule(path)
            if type(module) not in (expected, HEAD_CLASSES.get(expected)) or has_hooks(module):
                return f"{path} is a {type(module).__name__} with hooks or not transformers' {expected.__name__}"
        encoder = getattr(model, encoder_name)
        if not isinstance(encoder, modeling.FusedModel):
            return f"{encoder_name} is transformers' {type(encoder).__name__}, not accelerated"
        why = compat.why_transformers(encoder, {})
        if why is not None:
            return why
        return cls(encoder, *split(model))

    def splade(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
               token_type_ids: torch.Tensor | None, activation: str, pooling: str) -> torch.Tensor:
        """[B, S] inputs (any padding side) -> [B, vocab]: SpladePooling's ``sentence_embedding`` for the model's
        logits, each sequence pooled over its real tokens (a sequence without any: zeros). Inference only."""
        x, layout = self.encoder.token_states(input_ids, attention_mask, token_type_ids)
        keep = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        x, cu_seqlens = padding.rows_where(x, layout, keep.to(x.device))  # [N, hidden], [B + 1]
        return splade_pool(self.transform(x), cu_seqlens, self.decoder, activation, pooling)

    def splade_packed(self, input_ids: torch.Tensor, seqlens: list[int], activation: str,
                      pooling: str) -> torch.Tensor:
        """Sequences back to back (``FusedModel.forward_packed``'s input_ids [N], seqlens [B]) -> [B, vocab]: each
        sequence's ``splade`` as it gives that sequence alone, with no [batch, seq_len] tensor at any step (what the
        server runs). Inference only."""
        x = self.encoder.forward_packed(input_ids, seqlens)  # [N, hidden]
        cu_seqlens = F.pad(torch.tensor(seqlens, dtype=torch.int32, device=x.device).cumsum(0, dtype=torch.int32),
                           (1, 0))  # [B + 1]
        return splade_pool(self.transform(x), cu_seqlens, self.decoder, activation, pooling)


def _roberta_shaped(module):  # RobertaLMHead and its copies: decoder(layer_norm(gelu(dense(x))))
    def split(model) -> tuple:
        head = model.lm_head
        return (lambda x: norm.dense_act_layer_norm(x, head.dense, module.gelu, head.layer_norm)), head.decoder
    return split


def _roberta_parts(module, model_class, head_class) -> dict:
    return {model_class: ("roberta", (("lm_head", head_class),), _roberta_shaped(module))}


# masked-LM class -> (its encoder's attribute, the modules whose forward is not called (path, transformers' class),
# model -> (transform, decoder))
_PARTS = {
    modeling_bert.BertForMaskedLM: (
        "bert", (("cls", modeling_bert.BertOnlyMLMHead), ("cls.predictions", modeling_bert.BertLMPredictionHead)),
        lambda model: (model.cls.predictions.transform, model.cls.predictions.decoder)),
    **_roberta_parts(modeling_roberta, modeling_roberta.RobertaForMaskedLM, modeling_roberta.RobertaLMHead),
    **_roberta_parts(modeling_xlm_roberta, modeling_xlm_roberta.XLMRobertaForMaskedLM,
                     modeling_xlm_roberta.XLMRobertaLMHead),
    **_roberta_parts(modeling_camembert, modeling_camembert.CamembertForMaskedLM, modeling_camembert.CamembertLMHead),
    modeling_distilbert.DistilBertForMaskedLM: (  # vocab_projector(vocab_layer_norm(activation(vocab_transform(x))))
        "distilbert", (),
        lambda model: ((lambda x: norm.dense_act_layer_norm(x, model.vocab_transform, model.activation,
                                                            model.vocab_layer_norm)), model.vocab_projector)),
}
