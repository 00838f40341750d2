"""What the server runs: a model and its tokenizer, made into the task its checkpoint was made for.

- ``Embeddings``: a sentence-transformers folder (its pooling, normalization, ``max_seq_length`` and lowercasing:
  ``sentence.py``) or a plain encoder (mean pooling, normalized). The sequences of a batch go in back to back as
  token ids (``FusedModel.forward_packed``) and are pooled per sequence (``sentence.pool_packed``): no padded tensor
  exists at any step.
- ``Scores``: a sequence-classification head (a cross-encoder reranker, a classifier). Rerank scores (query,
  document) pairs with the cross-encoder's activation (sigmoid for one label, as ``CrossEncoder.predict``); classify
  gives each text's label and probabilities. The head reads position 0 of a [batch, seq_len] output, so a batch's ids
  are padded (a few bytes per token); the encoder inside still runs on the real tokens only.

``load(model)`` picks the task from the checkpoint: a ``*ForSequenceClassification`` architecture scores, anything
else embeds.
"""

import dataclasses
import os

import numpy as np
import torch

from .. import announce, cpu
from ..int8.quantize import quantize
from ..auto import AutoModel, AutoModelForSequenceClassification
from ..sentence import Sentence, pool_packed

TASKS = ("embeddings", "scores")


@dataclasses.dataclass
class Item:
    """One sequence to run: token ids, and token types for a pair."""

    ids: list[int]
    types: list[int] | None = None


class InputError(ValueError):
    """A request's input the model cannot take (the API answers 400 with its message)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class _Engine:
    task: str

    def __init__(self, model, tokenizer, name: str, max_length: int):
        self.model, self.tokenizer, self.name, self.max_length = model, tokenizer, name, max_length
        self.device = next(model.parameters()).device
        self.vocab_size = model.get_input_embeddings().weight.shape[0] if hasattr(model, "get_input_embeddings") \
            else len(tokenizer)

    def _check_length(self, ids: list[int], truncate: bool, index: int, param: str) -> list[int]:
        if len(ids) <= self.max_length:
            return ids
        if not truncate:
            raise InputError(f"{param}[{index}] has {len(ids)} tokens, more than the model's {self.max_length} "
                             "(send truncate: true to cut it there)", param)
        return ids[: self.max_length - 1] + ids[-1:] if self._ends_with_special(ids) else ids[: self.max_length]

    def _ends_with_special(self, ids: list[int]) -> bool:
        return bool(ids) and ids[-1] in set(self.tokenizer.all_special_ids)


class Embeddings(_Engine):
    task = "embeddings"

    def __init__(self, model, tokenizer, name: str, sentence: Sentence):
        limit = min(tokenizer.model_max_length, getattr(model.config, "max_position_embeddings", 1 << 30))
        super().__init__(model, tokenizer, name, min(sentence.max_length or limit, limit))
        self.sentence = sentence
        self.dim = model.config.hidden_size * len(sentence.pooling)

    def tokenize(self, texts: list[str], truncate: bool) -> list[Item]:
        """Texts -> sequences of token ids, truncated at the model's length (or refused: ``truncate`` False)."""
        if self.sentence.lowercase:
            texts = [text.lower() for text in texts]
        rows = self.tokenizer(texts, truncation=truncate, max_length=self.max_length if truncate else None,
                              return_attention_mask=False, return_token_type_ids=False)["input_ids"]
        return [Item(self._check_length(row, truncate, i, "input")) for i, row in enumerate(rows)]

    def token_ids(self, rows: list[list[int]], truncate: bool) -> list[Item]:
        """Token ids given by the client (run as they are: no special tokens added), checked against the vocabulary."""
        for i, row in enumerate(rows):
            if not row:
                raise InputError(f"input[{i}] is empty", "input")
            bad = next((t for t in row if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise InputError(f"input[{i}] holds token id {bad}, outside the vocabulary [0, {self.vocab_size})",
                                 "input")
        return [Item(self._check_length(list(row), truncate, i, "input")) for i, row in enumerate(rows)]

    def run(self, items: list[Item]) -> np.ndarray:
        """[B] sequences -> float32 [B, dim] sentence embeddings (normalized as the model says)."""
        seqlens = [len(item.ids) for item in items]
        ids = torch.tensor([t for item in items for t in item.ids], dtype=torch.long)
        with torch.inference_mode():
            hidden = self.model.forward_packed(ids, seqlens)  # [N, hidden]
            pooled = pool_packed(hidden, torch.tensor(seqlens, device=hidden.device), self.sentence.pooling)
            if self.sentence.normalize:
                pooled = torch.nn.functional.normalize(pooled.float(), dim=-1)
            return pooled.float().cpu().numpy()


class Scores(_Engine):
    task = "scores"

    def __init__(self, model, tokenizer, name: str, activation: str):
        limit = min(tokenizer.model_max_length, getattr(model.config, "max_position_embeddings", 1 << 30))
        super().__init__(model, tokenizer, name, limit)
        self.activation = activation  # "sigmoid" or "identity": the cross-encoder's, for rerank scores
        self.labels = [model.config.id2label.get(i, str(i)) for i in range(model.config.num_labels)]

    def tokenize(self, texts: list[str], truncate: bool, pairs_with: list[str] | None = None) -> list[Item]:
        """Texts (or (text, pairs_with[i]) pairs: a query and each document) -> sequences with token types."""
        encoded = self.tokenizer(texts, pairs_with, truncation="longest_first" if truncate else False,
                                 max_length=self.max_length if truncate else None, return_attention_mask=False)
        types = encoded.get("token_type_ids")
        items = []
        for i, row in enumerate(encoded["input_ids"]):
            if len(row) > self.max_length:
                raise InputError(f"{'documents' if pairs_with else 'input'}[{i}] has {len(row)} tokens with the "
                                 f"query, more than the model's {self.max_length} (send truncate: true)",
                                 "documents" if pairs_with else "input")
            items.append(Item(row, None if types is None else types[i]))
        return items

    def run(self, items: list[Item]) -> np.ndarray:
        """[B] sequences -> float32 [B, labels] logits."""
        longest = max(len(item.ids) for item in items)
        pad = self.tokenizer.pad_token_id or 0
        ids = torch.full((len(items), longest), pad, dtype=torch.long)
        mask = torch.zeros((len(items), longest), dtype=torch.long)
        types = torch.zeros((len(items), longest), dtype=torch.long)
        for row, item in enumerate(items):
            ids[row, : len(item.ids)] = torch.tensor(item.ids)
            mask[row, : len(item.ids)] = 1
            if item.types is not None:
                types[row, : len(item.types)] = torch.tensor(item.types)
        inputs = dict(input_ids=ids, attention_mask=mask)
        if "token_type_ids" in self.tokenizer.model_input_names:
            inputs["token_type_ids"] = types
        with torch.inference_mode():
            logits = self.model(**{k: v.to(self.device) for k, v in inputs.items()}).logits
        return logits.float().cpu().numpy()


def load(model: str, *, device: str = "cpu", dtype: str = "float32", int8: bool = False, task: str | None = None,
         name: str | None = None):
    """The engine of ``model`` (a local folder or a Hub id in the cache): ``Embeddings`` or ``Scores`` by its
    architecture (``task`` forces one), in ``dtype`` on ``device``, with int8 GEMMs (``fastbert.quantize`` and its
    guard) when ``int8``."""
    import transformers

    if task not in (None, *TASKS):
        raise ValueError(f"task={task!r}: expected one of {', '.join(TASKS)}")
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(dtype)
    if torch_dtype is None:
        raise ValueError(f"dtype={dtype!r}: expected float32, bfloat16 or float16")
    if int8 and (torch_dtype != torch.float32 or torch.device(device).type != "cpu"):
        raise ValueError("int8 runs float32 models on the CPU (--dtype float32 --device cpu)")
    if torch_dtype == torch.bfloat16 and torch.device(device).type == "cpu" and not cpu.native_bf16():
        announce.note("this CPU has no native bf16 (no AVX512-BF16 or AMX): bf16 is emulated, slower than float32")
    sentence = Sentence.read(model)
    config = transformers.AutoConfig.from_pretrained(sentence.transformer)
    scores = task == "scores" or (task is None and not sentence.sentence_transformers and any(
        a.endswith("ForSequenceClassification") for a in (config.architectures or [])))
    tokenizer = transformers.AutoTokenizer.from_pretrained(sentence.transformer)
    name = name or os.fspath(model)
    # (transformers 5 names the argument dtype; 4.x torch_dtype)
    dtype_argument = {"dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype": torch_dtype}
    auto = AutoModelForSequenceClassification if scores else AutoModel
    loaded = auto.from_pretrained(sentence.transformer, **dtype_argument)
    loaded = loaded.to(device).eval()
    if int8:
        quantize(loaded, tokenizer=tokenizer)
    if scores:
        return Scores(loaded, tokenizer, name, _cross_encoder_activation(config))
    if not hasattr(loaded, "forward_packed"):
        raise ValueError(f"{model}: {type(loaded).__name__} is not a family fastbert accelerates, so it cannot be "
                         "served padding-free")
    return Embeddings(loaded, tokenizer, name, sentence)


def _cross_encoder_activation(config) -> str:
    """The activation ``CrossEncoder.predict`` applies to this checkpoint's logits: the one its config names, else
    sigmoid for one label and none for more."""
    saved = (getattr(config, "sentence_transformers", None) or {}).get("activation_fn") or ""
    if "Sigmoid" in saved:
        return "sigmoid"
    if "Identity" in saved:
        return "identity"
    return "sigmoid" if config.num_labels == 1 else "identity"


def describe(engine) -> dict:
    return {"task": engine.task, "max_length": engine.max_length,
            **({"dim": engine.dim, "pooling": list(engine.sentence.pooling), "normalize": engine.sentence.normalize}
               if engine.task == "embeddings" else {"labels": engine.labels, "activation": engine.activation})}
