"""What the server runs: a model and its tokenizer, made into the task its checkpoint was made for.

- ``Embeddings``: a sentence-transformers folder (its pooling, normalization, ``max_seq_length``, lowercasing and
  prompts: ``sentence.py``) or a plain encoder (mean pooling, normalized); with the calibration its int8/uint8
  outputs are quantized by (``formats.py``).
- ``Scores``: a sequence-classification head (a cross-encoder reranker, a classifier). Rerank scores (query,
  document) pairs with the cross-encoder's activation (sigmoid for one label, as ``CrossEncoder.predict``); classify
  gives each text's label and probabilities.
- ``SparseEmbeddings`` and ``MultiVectors`` (``retrieval.py``): SPLADE and ColBERT-style folders.

Each runs a batch's sequences back to back as token ids (``FusedModel.forward_packed``, token types for pairs): no
padded tensor exists at any step. Embeddings are pooled per sequence (``sentence.pool_packed``); scores are the
head's logits on each sequence's first row (``heads.py``). Texts become token ids through ``tokens.py``: as the
tokenizer truncates them, from a bounded prefix. ``run`` gives one row per sequence: a batch's array, or outputs of
each sequence's own shape. ``loading.load`` picks the engine of a checkpoint.
"""

import dataclasses

import numpy as np
import torch

from .. import threads
from ..int8.guard_inputs import usable_texts
from ..sentence import Sentence, pool_packed
from . import formats, heads
from .tokens import Query, Tokens


@dataclasses.dataclass
class Item:
    """One sequence to run: token ids, and token types for a pair. Multi-vector sequences also say which positions
    give a vector (``scored``) and, where ColBERT's query expansion is attended to by nothing, which positions are
    attended to (``attention``; None: all of them)."""

    ids: list[int]
    types: list[int] | None = None
    scored: list[bool] | None = None
    attention: list[int] | None = None


class InputError(ValueError):
    """A request's input the model cannot take (the API answers 400 with its message)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class Engine:
    """A model and its tokenizer serving ``task``; subclasses give ``run`` and ``describe``."""

    task: str

    def __init__(self, model, tokenizer, name: str, max_length: int, lowercase: bool = False):
        self.model, self.tokenizer, self.name, self.max_length = model, tokenizer, name, max_length
        self.tokens = Tokens(tokenizer, max_length, lowercase)
        self.device = next(model.parameters()).device
        # what the model computes in, and why (the start line says it): dtype=auto's choice, or the option given
        self.precision = str(next(model.parameters()).dtype).removeprefix("torch.")

    def tokenize(self, texts: list[str], truncate: bool, first: int = 0, field: str = "input") -> list[Item]:
        """Texts (``<field>[first:]`` of a request) -> sequences of token ids, cut at the model's length as the
        tokenizer cuts them (or refused: ``truncate`` False)."""
        sequences = self.tokens.single(texts)
        if not truncate:
            refuse_cut(sequences, first, f"has more than the model's {self.max_length} tokens", field)
        return [Item(s.ids, s.types) for s in sequences]

    def describe(self) -> dict:
        """What ``GET /v1/models`` says of the model beside its name."""
        return {"task": self.task, "max_length": self.max_length}


class Embeddings(Engine):
    task = "embeddings"

    def __init__(self, model, tokenizer, name: str, sentence: Sentence,
                 calibration: np.ndarray | list[str] | None = None):
        """``calibration``: the int8/uint8 calibration embeddings [n, dim] (the model's float32 outputs), or texts
        whose vectors are (default: fastbert's shipped sentences, ``data/int8_guard.txt``), run once here."""
        if not hasattr(model, "forward_packed"):
            raise ValueError(f"{type(model).__name__} is not a family fastbert accelerates, so it cannot be served "
                             "padding-free")
        if sentence.prompt(None) and not sentence.include_prompt:
            raise ValueError(f"{name}: its pooling leaves its default prompt {sentence.prompt(None)!r} out "
                             "(include_prompt=False), which fastbert does not reproduce")
        limit = model_limit(model, tokenizer)
        super().__init__(model, tokenizer, name, min(sentence.max_length or limit, limit), sentence.lowercase)
        self.sentence = sentence
        self.dim = model.config.hidden_size * len(sentence.pooling)
        self.vocab_size = model.get_input_embeddings().weight.shape[0]
        if not isinstance(calibration, np.ndarray):
            texts = usable_texts(tokenizer, None)[0] if calibration is None else calibration
            # (in a short-lived thread, as fastbert's one-time work runs: an OpenMP pool left in this thread would
            # make the model instances' pools sleep at every barrier, ``threads.py``)
            calibration = threads.in_own_thread(self.run, self.tokenize(texts, truncate=True))
        self.calibration = formats.Calibration(calibration, self.dim)

    def tokenize(self, texts: list[str], truncate: bool, first: int = 0, field: str = "input",
                 task: str | None = None) -> list[Item]:
        """As ``Engine.tokenize``, each text after the task's prompt (``Sentence.prompt``: None is ``encode``'s, the
        folder's default prompt; "query" / "document" are ``encode_query`` / ``encode_document``'s)."""
        prompt = self.sentence.prompt(task)
        if prompt and not self.sentence.include_prompt:
            raise InputError(f"task {task!r}: the model's pooling leaves its prompt {prompt!r} out "
                             "(include_prompt=False), which fastbert does not reproduce", "task")
        return super().tokenize(self.sentence.prompted(texts, task), truncate, first, field)

    def token_ids(self, rows: list[list[int]], truncate: bool) -> list[Item]:
        """Token ids given by the client (run as they are: no special tokens added), checked against the vocabulary."""
        items = []
        for i, row in enumerate(rows):
            if not row:
                raise InputError(f"input[{i}] is empty", "input")
            bad = next((t for t in row if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise InputError(f"input[{i}] holds token id {bad}, outside the vocabulary [0, {self.vocab_size})",
                                 "input")
            if len(row) > self.max_length and not truncate:
                raise InputError(f"input[{i}] has {len(row)} tokens, more than the model's {self.max_length} "
                                 "(send truncate: true to cut it there)", "input")
            items.append(Item(self._cut(list(row))))
        return items

    def _cut(self, ids: list[int]) -> list[int]:
        """Token ids cut at the model's length, keeping a closing special token where the row ends with one."""
        if len(ids) <= self.max_length:
            return ids
        closing = ids[-1] in set(self.tokenizer.all_special_ids)
        return ids[: self.max_length - 1] + ids[-1:] if closing else ids[: self.max_length]

    def run(self, items: list[Item]) -> np.ndarray:
        """[B] sequences -> float32 [B, dim] sentence embeddings (normalized as the model says)."""
        ids, seqlens = packed(items)
        with torch.inference_mode():
            hidden = self.model.forward_packed(ids, seqlens)  # [N, hidden]
            pooled = pool_packed(hidden, torch.tensor(seqlens, device=hidden.device), self.sentence.pooling)
            if self.sentence.normalize:
                pooled = torch.nn.functional.normalize(pooled.float(), dim=-1)
            return pooled.float().cpu().numpy()

    def describe(self) -> dict:
        return {**super().describe(), "dim": self.dim, "pooling": list(self.sentence.pooling),
                "normalize": self.sentence.normalize}


class Scores(Engine):
    task = "scores"

    def __init__(self, model, tokenizer, name: str, activation: str):
        why = heads.why_not(model)
        if why is not None:
            raise ValueError(why)
        super().__init__(model, tokenizer, name, model_limit(model, tokenizer))
        self.activation = activation  # "sigmoid" or "identity": the cross-encoder's, for rerank scores
        self.labels = [model.config.id2label.get(i, str(i)) for i in range(model.config.num_labels)]
        self.token_types = "token_type_ids" in tokenizer.model_input_names  # (RoBERTa's tokenizers give none)

    def query(self, text: str) -> Query:
        """A rerank query, tokenized once for all its documents."""
        return self.tokens.query(text)

    def shortest_pair(self, query: Query) -> int:
        """The fewest tokens any (query, document) pair of this query has."""
        return self.tokens.shortest_pair(query)

    def pairs(self, query: Query, documents: list[str], truncate: bool, first: int = 0) -> list[Item]:
        """(query, document) pairs (``documents[first:]`` of a request) -> sequences with token types, truncated as
        the tokenizer truncates pairs (or refused: ``truncate`` False)."""
        sequences = self.tokens.pairs(query, documents)
        if not truncate:
            refuse_cut(sequences, first, f"with the query has more than the model's {self.max_length} tokens",
                       "documents")
        return [Item(s.ids, s.types) for s in sequences]

    def run(self, items: list[Item]) -> np.ndarray:
        """[B] sequences -> float32 [B, labels] logits."""
        ids, seqlens = packed(items)
        types = torch.tensor([t for item in items for t in item.types], dtype=torch.long) if self.token_types \
            else None
        with torch.inference_mode():
            hidden = self.model.base_model.forward_packed(ids, seqlens, types)  # [N, hidden]
            logits = heads.logits(self.model, hidden, torch.tensor(seqlens, device=hidden.device))
        return logits.float().cpu().numpy()

    def describe(self) -> dict:
        return {**super().describe(), "labels": self.labels, "activation": self.activation}


def packed(items: list[Item]) -> tuple[torch.Tensor, list[int]]:
    """Sequences -> (their token ids back to back [N] int64, each one's length [B]): ``forward_packed``'s input."""
    return torch.tensor([t for item in items for t in item.ids], dtype=torch.long), [len(item.ids) for item in items]


def model_limit(model, tokenizer) -> int:
    """The most tokens a sequence may have: the tokenizer's limit, within the model's position table."""
    return min(tokenizer.model_max_length, getattr(model.config, "max_position_embeddings", 1 << 30))


def refuse_cut(sequences, first: int, what: str, param: str) -> None:
    """InputError naming the first of ``sequences`` (``tokens.Tokenized``, from ``<param>[first]`` on) that was cut."""
    cut = next((i for i, s in enumerate(sequences) if s.cut), None)
    if cut is not None:
        raise InputError(f"{param}[{first + cut}] {what} (send truncate: true to cut it there)", param)
