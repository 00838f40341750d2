"""What the server runs: a model and its tokenizer, made into the task its checkpoint was made for.

- ``Embeddings``: a sentence-transformers folder (its pooling, normalization, ``max_seq_length`` and lowercasing:
  ``sentence.py``) or a plain encoder (mean pooling, normalized).
- ``Scores``: a sequence-classification head (a cross-encoder reranker, a classifier). Rerank scores (query,
  document) pairs with the cross-encoder's activation (sigmoid for one label, as ``CrossEncoder.predict``); classify
  gives each text's label and probabilities.

Both run a batch's sequences back to back as token ids (``FusedModel.forward_packed``, token types for pairs): no
padded tensor exists at any step. Embeddings are pooled per sequence (``sentence.pool_packed``); scores are the
head's logits on each sequence's first row (``heads.py``). Texts become token ids through ``tokens.py``: as the
tokenizer truncates them, from a bounded prefix.

``load(model)`` picks the task from the checkpoint: a ``*ForSequenceClassification`` architecture scores, anything
else embeds. ``settings`` checks and resolves the device and precision (the one place a new default would go).
"""

import dataclasses
import os

import numpy as np
import torch

from .. import announce, auto_dtype, cpu
from ..auto import AutoModel, AutoModelForSequenceClassification
from ..int8.quantize import quantize
from ..sentence import Sentence, pool_packed
from . import heads
from .tokens import Query, Tokens

TASKS = ("embeddings", "scores")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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

    def __init__(self, model, tokenizer, name: str, max_length: int, lowercase: bool = False):
        self.model, self.tokenizer, self.name, self.max_length = model, tokenizer, name, max_length
        self.tokens = Tokens(tokenizer, max_length, lowercase)
        self.device = next(model.parameters()).device
        # what the model computes in, and why (the start line says it): dtype=auto's choice, or the option given
        self.precision = str(next(model.parameters()).dtype).removeprefix("torch.")

    def tokenize(self, texts: list[str], truncate: bool, first: int = 0) -> list[Item]:
        """Texts (``input[first:]`` of a request) -> sequences of token ids, cut at the model's length as the
        tokenizer cuts them (or refused: ``truncate`` False)."""
        sequences = self.tokens.single(texts)
        if not truncate:
            _refuse_cut(sequences, first, f"has more than the model's {self.max_length} tokens", "input")
        return [Item(s.ids, s.types) for s in sequences]


class Embeddings(_Engine):
    task = "embeddings"

    def __init__(self, model, tokenizer, name: str, sentence: Sentence):
        if not hasattr(model, "forward_packed"):
            raise ValueError(f"{type(model).__name__} is not a family fastbert accelerates, so it cannot be served "
                             "padding-free")
        limit = min(tokenizer.model_max_length, getattr(model.config, "max_position_embeddings", 1 << 30))
        super().__init__(model, tokenizer, name, min(sentence.max_length or limit, limit), sentence.lowercase)
        self.sentence = sentence
        self.dim = model.config.hidden_size * len(sentence.pooling)
        self.vocab_size = model.get_input_embeddings().weight.shape[0]

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
        why = heads.why_not(model)
        if why is not None:
            raise ValueError(why)
        limit = min(tokenizer.model_max_length, getattr(model.config, "max_position_embeddings", 1 << 30))
        super().__init__(model, tokenizer, name, limit)
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
            _refuse_cut(sequences, first, f"with the query has more than the model's {self.max_length} tokens",
                        "documents")
        return [Item(s.ids, s.types) for s in sequences]

    def run(self, items: list[Item]) -> np.ndarray:
        """[B] sequences -> float32 [B, labels] logits."""
        seqlens = [len(item.ids) for item in items]
        ids = torch.tensor([t for item in items for t in item.ids], dtype=torch.long)
        types = torch.tensor([t for item in items for t in item.types], dtype=torch.long) if self.token_types \
            else None
        with torch.inference_mode():
            hidden = self.model.base_model.forward_packed(ids, seqlens, types)  # [N, hidden]
            logits = heads.logits(self.model, hidden, torch.tensor(seqlens, device=hidden.device))
        return logits.float().cpu().numpy()


def _refuse_cut(sequences, first: int, what: str, param: str) -> None:
    cut = next((i for i, s in enumerate(sequences) if s.cut), None)
    if cut is not None:
        raise InputError(f"{param}[{first + cut}] {what} (send truncate: true to cut it there)", param)


# --- loading ----------------------------------------------------------------------------------------------------------


def locate(model: str) -> str:
    """``model`` when it is a local folder or can be a Hub id; a clear error, at once, for a path that names no
    folder (transformers would first look for it on the Hub)."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if os.path.isdir(model):
        return model
    if os.path.exists(model):
        raise ValueError(f"{model} is a file: give the model's folder")
    try:
        validate_repo_id(model)
    except HFValidationError:
        raise ValueError(f"{model}: no such folder") from None
    return model


def served_name(model: str) -> str:
    """The name clients give a model by default: a local folder's own name, or the Hub id."""
    return os.path.basename(os.path.normpath(model)) if os.path.isdir(model) else model


def settings(device: str = "cpu", dtype: str = "auto", int8: bool = False) -> tuple[torch.device, torch.dtype | None]:
    """The device and dtype a model is served in, checked before anything loads (a clear error naming the option);
    None for ``auto`` without int8 (chosen once the float32 model is loaded: ``auto_dtype.choose``; int8 quantizes a
    float32 model, so ``auto`` with int8 is float32)."""
    try:
        where = torch.device(device)
    except (RuntimeError, ValueError):
        raise ValueError(f"device {device!r}: expected cpu, cuda or cuda:N") from None
    if where.type not in ("cpu", "cuda"):
        raise ValueError(f"device {device!r}: expected cpu, cuda or cuda:N")
    if where.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r}: this machine has no CUDA GPU torch can use")
    if where.type == "cuda" and where.index is not None and where.index >= torch.cuda.device_count():
        raise ValueError(f"device {device!r}: this machine has {torch.cuda.device_count()} CUDA GPU(s)")
    if dtype == "auto":
        return where, torch.float32 if int8 else None
    torch_dtype = DTYPES.get(dtype)
    if torch_dtype is None:
        raise ValueError(f"dtype {dtype!r}: expected auto, {', '.join(DTYPES)}")
    if int8 and where.type != "cpu":
        raise ValueError("int8 runs on the CPU (int8 GEMMs through oneDNN): use --device cpu, or drop --int8")
    if int8 and torch_dtype != torch.float32:
        raise ValueError(f"int8 quantizes a float32 model: use --dtype float32 (not {dtype}) with --int8")
    if torch_dtype == torch.bfloat16 and where.type == "cpu" and not cpu.native_bf16():
        announce.note("this CPU has no native bf16 (no AVX512-BF16 or AMX): bf16 is emulated, slower than float32")
    return where, torch_dtype


def load(model: str, *, device: str = "cpu", dtype: str = "auto", int8: bool = False, task: str | None = None,
         name: str | None = None):
    """The engine of ``model`` (a local folder or a Hub id): ``Embeddings`` or ``Scores`` by its architecture (``task``
    forces one), in ``dtype`` on ``device``, with int8 GEMMs (``fastbert.quantize`` and its guard) when ``int8``;
    clients call it ``name`` (default: the folder's name, or the Hub id)."""
    import transformers

    if task not in (None, *TASKS):
        raise ValueError(f"task={task!r}: expected one of {', '.join(TASKS)}")
    model = locate(os.fspath(model))
    where, torch_dtype = settings(device, dtype, int8)
    sentence = Sentence.read(model)
    config = transformers.AutoConfig.from_pretrained(sentence.transformer)
    scores = task == "scores" or (task is None and not sentence.sentence_transformers and any(
        a.endswith("ForSequenceClassification") for a in (config.architectures or [])))
    tokenizer = transformers.AutoTokenizer.from_pretrained(sentence.transformer)
    # (transformers 5 names the argument dtype; 4.x torch_dtype)
    dtype_argument = {"dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype":
                      torch_dtype or torch.float32}
    auto = AutoModelForSequenceClassification if scores else AutoModel
    loaded = auto.from_pretrained(sentence.transformer, **dtype_argument).to(where).eval()
    why = f"--dtype {dtype}"
    if torch_dtype is None:  # (auto: bf16 where the CPU has it natively and the guard passes, said once)
        loaded, why = auto_dtype.choose(loaded, tokenizer, served_name(model))
    if int8:
        quantize(loaded, tokenizer=tokenizer)
    name = name or served_name(model)
    served = Scores(loaded, tokenizer, name, _cross_encoder_activation(config)) if scores else \
        Embeddings(loaded, tokenizer, name, sentence)
    served.precision = f"{served.precision}{' with int8 GEMMs' if int8 else ''} ({why})"
    return served


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
