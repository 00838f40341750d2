"""The engines of sentence-transformers' retrieval folders (``fastbert/retrieval.py`` reads their heads), giving what
``fastbert.corpus.Embedder`` gives on them -- their ``encode``'s outputs -- from the server's packed batches:

- ``SparseEmbeddings``: a SparseEncoder (SPLADE) folder -> each text's (indices, values), the non-zero vocabulary
  entries of its SpladePooling vector, ascending (``MLMHead.splade_packed``). Inference-free SPLADE (a Router): the
  tasks routed to SPLADE run it; a task routed to the static lookup (its queries) runs ``StaticLookup``, no forward.
- ``MultiVectors``: a MultiVectorEncoder (ColBERT-style) folder -> each text's token vectors [tokens, dim], its
  scored tokens only, no padding rows (``multi_vector.packed_token_vectors``), cut to the folder's ``truncate_dim``
  and normalized again.

A request's ``task`` is None (``encode``), "query" or "document" (``encode_query`` / ``encode_document``): the task's
prompt, and for multi-vector its length, ColBERT's query expansion and the document skip-list, each sequence
carrying what it needs (``engine.Item``), so that requests of every task share one batch.
"""

import numpy as np
import torch
import torch.nn.functional as F

import transformers

from .. import retrieval
from ..multi_vector import packed_token_vectors, token_vectors
from ..sentence import Sentence
from ..sparse import MLMHead
from .engine import Engine, Item, model_limit, packed, refuse_cut
from .tokens import Tokens

RETRIEVAL_TASKS = (None, "query", "document")


class _Retrieval(Engine):
    """Tokenizing per task: the task's prompt (as ``Sentence.prompt``) and its own ``Tokens`` (its length)."""

    def __init__(self, model, tokenizer, name: str, sentence: Sentence, lengths: dict):
        """``lengths``: each task's most tokens."""
        super().__init__(model, tokenizer, name, lengths[None], sentence.lowercase)
        self.sentence, self.lengths = sentence, lengths
        by_length = {lengths[None]: self.tokens}
        for length in lengths.values():
            by_length.setdefault(length, Tokens(tokenizer, length, sentence.lowercase))
        self.tokens_of = {task: by_length[length] for task, length in lengths.items()}
        self.refused: dict[str | None, str] = {}  # task -> why this server does not serve it
        self.lookups: dict[str | None, StaticLookup] = {}  # task -> its static lookup (no forward)

    def tokenize(self, texts: list[str], truncate: bool, first: int = 0, field: str = "inputs",
                 task: str | None = None) -> list[Item]:
        """Texts (``<field>[first:]`` of a request) -> the task's sequences, cut at its length as the tokenizer cuts
        them (or refused: ``truncate`` False)."""
        sequences = self.tokens_of[task].single(self.sentence.prompted(texts, task))
        if not truncate:
            refuse_cut(sequences, first, f"has more than the model's {self.lengths[task]} tokens"
                       + (f" for task {task!r}" if task else ""), field)
        return self.items(sequences, task)

    def items(self, sequences, task: str | None) -> list[Item]:
        """The task's tokenized sequences (``tokens.Tokenized``) -> what ``run`` takes."""
        return [Item(s.ids) for s in sequences]


class SparseEmbeddings(_Retrieval):
    task = "sparse"

    def __init__(self, model, tokenizer, name: str, sentence: Sentence, refused: dict | None = None,
                 lookups: dict | None = None):
        """``model``: the SPLADE route's masked-LM model (``fastbert.AutoModelForMaskedLM``); ``refused``: the tasks
        whose route is another SPLADE model; ``lookups``: {task: ``StaticLookup``} for the tasks routed to a static
        lookup (``sparse_routes``)."""
        head = MLMHead.of(model)
        if isinstance(head, str):
            raise ValueError(f"{name}: its SPLADE model cannot run fastbert's fused head: {head}")
        limit = model_limit(model, tokenizer)
        length = min(sentence.max_length or limit, limit)
        super().__init__(model, tokenizer, name, sentence, dict.fromkeys(RETRIEVAL_TASKS, length))
        self.head, self.splade = head, sentence.head
        self.refused.update(refused or {})
        self.lookups.update(lookups or {})
        self.vocab_size = model.get_output_embeddings().weight.shape[0]

    def run(self, items: list[Item]) -> list[tuple[np.ndarray, np.ndarray]]:
        """[B] sequences -> each one's (indices int64, values float32): its vector's non-zero entries, ascending."""
        ids, seqlens = packed(items)
        with torch.inference_mode():
            pooled = self.head.splade_packed(ids, seqlens, self.splade.activation, self.splade.pooling)  # [B, vocab]
        return [(indices.numpy(), values.numpy()) for indices, values in retrieval.sparse_rows(pooled.float().cpu())]

    def describe(self) -> dict:
        return {**super().describe(), "vocab_size": self.vocab_size, "top_k": self.splade.top_k}


def largest(indices: np.ndarray, values: np.ndarray, k: int | None) -> tuple[np.ndarray, np.ndarray]:
    """A sparse row's k entries of largest absolute value (sentence-transformers' ``max_active_dims``; ties to the
    lower index), still ascending; all of them for None."""
    if k is None or len(values) <= k:
        return indices, values
    keep = np.sort(np.lexsort((indices, -np.abs(values)))[:k])
    return indices[keep], values[keep]


class StaticLookup:
    """Inference-free SPLADE's query side (a SparseStaticEmbedding route): each text's distinct token ids, valued by
    the route's weight (``retrieval.static_sparse``, as ``fastbert.corpus.Embedder`` gives them). Its tokens are as
    the route's tokenizer makes them with no special tokens, cut at its length; no forward: the server runs it in
    the tokenizing threads."""

    # The tokenizer's length, where it names one: a longer text passes the server's token limit of a request (300K)
    # and is refused anyway.
    MOST_TOKENS = 1 << 20

    def __init__(self, sentence: Sentence):
        tokenizer = transformers.AutoTokenizer.from_pretrained(sentence.head.static)
        self.sentence, self.max_length = sentence, min(tokenizer.model_max_length, self.MOST_TOKENS)
        self.tokens = Tokens(tokenizer, self.max_length, sentence.lowercase, special_tokens=False)
        self.weight = retrieval.load_weights(sentence.head.static)["weight"].float()  # [vocab]

    def tokenize(self, texts: list[str], truncate: bool, first: int, field: str, task: str | None) -> list[Item]:
        sequences = self.tokens.single(self.sentence.prompted(texts, task))
        if not truncate:
            refuse_cut(sequences, first, f"has more than the {self.max_length} tokens of task {task!r}'s "
                       "tokenizer", field)
        return [Item(s.ids) for s in sequences]

    def run(self, items: list[Item]) -> list[tuple[np.ndarray, np.ndarray]]:
        """[B] sequences -> each one's (indices int64, values float32), ascending."""
        rows = retrieval.static_sparse(self.weight, [item.ids for item in items])
        return [(indices.numpy(), values.numpy()) for indices, values in rows]


def sparse_routes(model: str) -> tuple[Sentence, dict, dict]:
    """A SparseEncoder folder -> (the settings of its SPLADE route, {task: why it is not served} for the tasks whose
    route is another SPLADE model or none, {task: ``StaticLookup``} for the tasks routed to a static lookup)."""
    routes, refused, lookups = {}, {}, {}
    for task in RETRIEVAL_TASKS:
        try:
            routes[task] = Sentence.read(model, task)
        except ValueError as error:
            refused[task] = str(error)
    splade = [sentence for sentence in routes.values() if sentence.head.static is None]
    if not splade:
        raise ValueError(f"{model}: no route of this SparseEncoder runs SPLADE (fastbert serves SPLADE; its static "
                         "lookups run in fastbert.corpus.Embedder)")
    for task, sentence in routes.items():
        if sentence.head.static is not None:
            lookups[task] = StaticLookup(sentence)
        elif sentence.head != splade[0].head:
            refused[task] = (f"task {task!r}: this model's route for it is another SPLADE model, which this server "
                             "does not serve (fastbert.corpus.Embedder does)")
    return splade[0], refused, lookups


class MultiVectors(_Retrieval):
    task = "multi_vector"

    def __init__(self, model, tokenizer, name: str, sentence: Sentence):
        """``model``: the folder's encoder (``fastbert.AutoModel``)."""
        if not hasattr(model, "forward_packed"):
            raise ValueError(f"{type(model).__name__} is not a family fastbert accelerates, so it cannot be served "
                             "padding-free")
        limit = model_limit(model, tokenizer)
        default = min(sentence.max_length or limit, limit)
        head = sentence.head
        super().__init__(model, tokenizer, name, sentence,
                         {task: min(head.max_length(task, default), limit) for task in RETRIEVAL_TASKS})
        self.head, self.project = head, head.projection()
        width = retrieval.read_json(head.dense, "config.json")["out_features"] if head.dense else \
            model.config.hidden_size
        self.dim = min(width, sentence.truncate_dim or width)

    def items(self, sequences, task: str | None) -> list[Item]:
        """Each sequence with its scored positions: ColBERT's expansion of a query (as sentence-transformers'
        Transformer.preprocess expands a batch of that query alone), the skip-list (``MultiVectorHead.scored``)."""
        expansion = self.head.query_expansion if task == "query" else None
        items = []
        for sequence in sequences:
            ids = torch.tensor([sequence.ids])
            mask, positions = torch.ones_like(ids), None
            if expansion is not None:
                missing = expansion["length"] - len(sequence.ids)
                if expansion["strategy"] == "fixed" and missing > 0:  # (padded to the width on the tokenizer's side)
                    sides = (missing, 0) if self.tokenizer.padding_side == "left" else (0, missing)
                    ids = F.pad(ids, sides, value=self.tokenizer.pad_token_id or 0)
                    mask = F.pad(mask, sides, value=0)
                ids, mask, positions = self.head.expand(self.tokenizer, ids, mask)
            scored = self.head.scored(self.tokenizer, ids, mask, positions, task)
            items.append(Item(ids[0].tolist(), scored=scored[0].tolist(),
                              attention=None if bool(mask.all()) else mask[0].tolist()))
        return items

    def run(self, items: list[Item]) -> list[np.ndarray]:
        """[B] sequences -> each one's float32 [scored tokens, dim]."""
        out = [None] * len(items)
        attended = [i for i, item in enumerate(items) if item.attention is None]
        expanded = [i for i, item in enumerate(items) if item.attention is not None]
        normalize = self.sentence.normalize
        with torch.inference_mode():
            if attended:
                chosen = [items[i] for i in attended]
                ids, seqlens = packed(chosen)
                scored = torch.tensor([s for item in chosen for s in item.scored])
                vectors = packed_token_vectors(self.model, ids, seqlens, scored, self.project, normalize)
                for i, rows in zip(attended, vectors.split([sum(item.scored) for item in chosen])):
                    out[i] = rows
            if expanded:
                # Queries whose expansion nothing attends to: their hidden states are computed as transformers
                # computes a padding position, so they run as a [queries, width] batch -- every one of them exactly
                # the expansion's width, so no row is padded for another.
                chosen = [items[i] for i in expanded]
                ids, mask, scored = (torch.tensor([getattr(item, name) for item in chosen], device=self.device)
                                     for name in ("ids", "attention", "scored"))
                vectors, cu_seqlens = token_vectors(self.model, ids, mask, None, scored, self.project, normalize)
                for i, rows in zip(expanded, vectors.split(cu_seqlens.diff().tolist())):
                    out[i] = rows
        return [self._truncated(rows).float().cpu().numpy() for rows in out]

    def _truncated(self, vectors: torch.Tensor) -> torch.Tensor:
        """The folder's truncate_dim: the first dimensions, L2-normalized again (as sentence-transformers does)."""
        if self.sentence.truncate_dim is None:
            return vectors
        return F.normalize(vectors[:, : self.sentence.truncate_dim], dim=-1)

    def describe(self) -> dict:
        return {**super().describe(), "dim": self.dim,
                "max_lengths": {task or "encode": length for task, length in self.lengths.items()}}
