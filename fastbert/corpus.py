"""Corpus embedding on any engine: one picklable callable that Ray Data, Spark and a plain loop all call on batches.

    embed = fastbert.corpus.Embedder("sentence-transformers/all-MiniLM-L6-v2")     # holds only its arguments
    embed.embed(["a text", "another"])                  # -> float32 array [2, dim], SentenceTransformer.encode's
    embed.embed("one text")                             # -> float32 array [dim]
    embed({"id": ids, "text": texts})                   # -> the batch with an "embedding" column [rows, dim]

    ray.data.read_parquet(src).map_batches(Embedder, fn_constructor_args=(path,), batch_size=256,
                                           compute=ray.data.ActorPoolStrategy(size=4)).write_parquet(dst)
    predict_batch_udf(lambda: Embedder(path).embed, return_type=ArrayType(FloatType()), batch_size=256)

On a sentence-transformers folder (or Hub id) the outputs are its ``encode``'s (``encode_query`` /
``encode_document`` with ``task``), of the kind its ``model_type`` says (``sentence.py``, ``retrieval.py``):

    dense         SentenceTransformer: [n, dim] (its max_seq_length, lowercasing, prompts, pooling, normalization,
                  truncate_dim); ``precision`` as sentence-transformers' ``quantize_embeddings``
    sparse        SparseEncoder (SPLADE; inference-free SPLADE's route for the task): per text (indices, values), its
                  non-zero vocabulary entries, ascending; ``top_k`` (default: the folder's max_active_dims) keeps the
                  largest
    multi_vector  MultiVectorEncoder (ColBERT-style): per text a [tokens, dim] array, its scored tokens only (no
                  padding rows); truncate_dim (then L2-normalized, as sentence-transformers does) and ``precision``

On a plain transformers model: mean pooling over the real tokens, L2-normalized. The engine ships the object to its
workers (pickle); each worker process loads the tokenizer and the model once, on its first batch, through
``fastbert.AutoModel`` (``AutoModelForMaskedLM`` for SPLADE; accelerated there: derived caches, settings and CUDA
graphs are per process and never travel). A batch is tokenized without padding, sorted by length and cut into
sub-batches of at most ``token_budget`` padded tokens, so short texts are not padded to the longest of the batch and
memory stays bounded whatever the engine's batch size; outputs come back in the input's order. int8/uint8 ranges
come from ``ranges`` or ``calibration_embeddings``, else from each call's own embeddings as ``quantize_embeddings``
computes them (an engine's batches then get different ranges: said once). Nothing here imports an engine: the engines
call it, with their own scheduling, retries and I/O (docs/scale-out.md).
"""

import dataclasses
import os
import sys
import threading
from collections.abc import Mapping, Sequence

import numpy as np
import torch
import transformers

from . import announce, auto_dtype, precision as precisions, retrieval
from .auto import AutoModel, AutoModelForMaskedLM
from .multi_vector import token_vectors
from .sentence import POOLING_MODES, Sentence, pool
from .sparse import MLMHead

# A run of at least this many texts shows a progress bar when stderr is a terminal (``show_progress_bar=None``).
PROGRESS_TEXTS = 1000


@dataclasses.dataclass(frozen=True)
class _Loaded:
    tokenizer: object
    model: torch.nn.Module | None  # None for a static lookup (inference-free SPLADE's query side)
    sentence: Sentence  # every setting resolved
    head: object = None  # sparse.MLMHead, the static weight [vocab], or the multi-vector projection (or None)


# Tokens per forward by default. On the CPU a forward's activations should stay near the caches: measured on a 2-core
# Zen 5 EPYC (1,000 mixed texts, real all-MiniLM-L6-v2 fp32: 1.90 s at 4,096 against 2.33 at 16,384; bf16 1.10 vs
# 1.16; bert-base-sized fp32 4.14 vs 4.72 s on 300 texts, bf16 2.11 vs 2.36), and 1,024-2,048 no better. A GPU wants
# the larger batches.
TOKEN_BUDGETS = {"cpu": 4096, "cuda": 16384}


class Embedder:
    """Texts -> embeddings with a transformers or sentence-transformers checkpoint through fastbert.

    model: a local directory or Hub id (a sentence-transformers folder, or anything ``transformers.AutoModel`` and
        ``AutoTokenizer`` load). pooling: one of ``sentence.POOLING_MODES`` (default: the folder's, else ``"mean"``);
        normalize: L2-normalize each embedding (default: the folder's, else True); max_length: longer texts are
        truncated (default: the folder's ``max_seq_length``, else the tokenizer's limit, at most the model's position
        table). token_budget: the most padded tokens (rows x longest row) per forward (default ``TOKEN_BUDGETS``:
        4,096 on the CPU, 16,384 on a GPU). text_column / output_column:
        the batch columns read and written by ``__call__``. device: where the model runs in each worker (``"cuda"``
        on GPU workers). show_progress_bar: on ``embed`` calls (default: for ``PROGRESS_TEXTS`` texts or more when
        stderr is a terminal).
        task: None (``encode``), "query" or "document" (``encode_query`` / ``encode_document``: the task's prompt,
        lengths, query expansion, skip-list, an inference-free SPLADE's route). precision: one of
        ``precision.PRECISIONS`` (dense and multi-vector), with ``ranges`` [2, dim] or ``calibration_embeddings``
        [n, dim] for int8/uint8. truncate_dim: keep the first dimensions (default: the folder's). top_k: sparse
        outputs keep their k largest entries (default: the folder's max_active_dims).
        dtype: what the model computes in: "auto" (default: bf16 on a CPU with native bf16 where a guard on real
        sentences passes, float32 elsewhere: ``fastbert/auto_dtype.py``, said once and in ``fastbert.info()``),
        "float32" (sentence-transformers' vectors to float32 rounding), "bfloat16" or "float16". The outputs are
        float32 (or ``precision``'s) whatever it is.
    """

    def __init__(self, model: str | os.PathLike, *, pooling: str | None = None, normalize: bool | None = None,
                 max_length: int | None = None, token_budget: int | None = None, text_column: str = "text",
                 output_column: str = "embedding", device: str | torch.device = "cpu",
                 show_progress_bar: bool | None = None, task: str | None = None, precision: str = "float32",
                 ranges: np.ndarray | None = None, calibration_embeddings: np.ndarray | None = None,
                 truncate_dim: int | None = None, top_k: int | None = None, dtype: str | torch.dtype = "auto"):
        if not isinstance(model, (str, os.PathLike)):
            raise TypeError(f"model: expected a path or Hub id (str or os.PathLike), got {type(model).__name__}")
        if pooling is not None and pooling not in POOLING_MODES:
            raise ValueError(f"pooling={pooling!r}: expected one of {', '.join(POOLING_MODES)}")
        for name, value in (("max_length", max_length), ("token_budget", token_budget),
                            ("truncate_dim", truncate_dim), ("top_k", top_k)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name}={value!r}: expected a positive int")
        if task is not None and not isinstance(task, str):
            raise TypeError(f"task: expected None, \"query\", \"document\" or another route's name, got "
                            f"{type(task).__name__}")
        precisions.check(precision, ranges, calibration_embeddings)
        self.dtype = auto_dtype.parse(dtype)
        self.model, self.pooling, self.normalize = os.fspath(model), pooling, normalize
        self.text_column, self.output_column = text_column, output_column
        self.device = torch.device(device)
        self.max_length = max_length
        self.token_budget = token_budget or TOKEN_BUDGETS.get(self.device.type, TOKEN_BUDGETS["cuda"])
        self.show_progress_bar = show_progress_bar
        self.task, self.precision, self.ranges = task, precision, ranges
        self.calibration_embeddings, self.truncate_dim, self.top_k = calibration_embeddings, truncate_dim, top_k
        self._loaded = None  # a _Loaded once this process loaded the model
        self._lock = threading.Lock()

    # Pickles (to an engine's workers) carry the arguments only: each process loads its own model.
    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k not in ("_loaded", "_lock")}

    def __setstate__(self, state):
        self.__dict__.update(state, _loaded=None, _lock=threading.Lock())

    @property
    def kind(self) -> str:
        """"dense", "sparse" or "multi_vector": the outputs of this model folder (read from it, nothing loaded)."""
        return self._settings().kind

    def _settings(self) -> Sentence:
        """The folder's settings with the arguments given here, checked against its kind (no model loaded)."""
        sentence = Sentence.read(self.model, self.task)
        kind = sentence.kind
        wrong = [name for name, value, kinds in (
            ("pooling", self.pooling, ("dense",)), ("top_k", self.top_k, ("sparse",)),
            ("normalize", self.normalize, ("dense", "multi_vector")),
            ("precision", None if self.precision == "float32" else self.precision, ("dense", "multi_vector")),
            ("truncate_dim", self.truncate_dim, ("dense", "multi_vector"))) if value is not None and kind not in kinds]
        if wrong:
            raise ValueError(f"{wrong[0]}={getattr(self, wrong[0])!r}: {self.model} gives {kind} outputs, which take "
                             f"no {wrong[0]}")
        prompt = sentence.prompt(self.task)
        if kind == "dense" and prompt and not sentence.include_prompt:
            raise ValueError(f"task={self.task!r}: {self.model}'s pooling leaves its prompt {prompt!r} out "
                             "(include_prompt=False), which fastbert does not reproduce")
        return dataclasses.replace(
            sentence, pooling=(self.pooling,) if self.pooling else sentence.pooling,
            normalize=sentence.normalize if self.normalize is None else self.normalize,
            truncate_dim=self.truncate_dim or sentence.truncate_dim)

    def load(self) -> _Loaded:
        """The tokenizer, the model in eval mode on ``device``, its settings (the arguments given here overriding the
        folder's) and its head: loaded on first use, once per process (an engine's actor or Python worker), then
        kept."""
        with self._lock:
            if self._loaded is None:
                loaded = self._load(self._settings())
                precisions.check_dim(self._output_dim(loaded), self.ranges, self.calibration_embeddings)
                self._loaded = loaded
            return self._loaded

    @staticmethod
    def _output_dim(loaded: _Loaded) -> int | None:
        """The width of a dense embedding or of a multi-vector token vector (None for sparse outputs)."""
        sentence = loaded.sentence
        if sentence.kind == "sparse":
            return None
        width = loaded.model.config.hidden_size * len(sentence.pooling)
        if sentence.kind == "multi_vector" and sentence.head.dense is not None:
            width = retrieval.read_json(sentence.head.dense, "config.json")["out_features"]
        return min(width, sentence.truncate_dim or width)

    def _load(self, sentence: Sentence) -> _Loaded:
        head = sentence.head
        if isinstance(head, retrieval.SparseHead) and head.static is not None:
            tokenizer = transformers.AutoTokenizer.from_pretrained(head.static)
            weight = retrieval.load_weights(head.static)["weight"].float()
            return _Loaded(tokenizer, None, sentence, weight)
        tokenizer = transformers.AutoTokenizer.from_pretrained(sentence.transformer)
        auto = AutoModelForMaskedLM if isinstance(head, retrieval.SparseHead) else AutoModel
        model = self.prepare(self._in_dtype(auto.from_pretrained(sentence.transformer).to(self.device).eval(),
                                            tokenizer))
        limit = min(tokenizer.model_max_length, getattr(model.config, "max_position_embeddings", 1 << 30))
        sentence = dataclasses.replace(sentence, max_length=min(self.max_length or sentence.max_length or limit, limit))
        if isinstance(head, retrieval.SparseHead):
            mlm = MLMHead.of(model)
            if isinstance(mlm, str):
                raise ValueError(f"{self.model}: its SPLADE model cannot run fastbert's fused head: {mlm}")
            return _Loaded(tokenizer, model, sentence, mlm)
        if isinstance(head, retrieval.MultiVectorHead):
            return _Loaded(tokenizer, model, sentence, head.projection())
        return _Loaded(tokenizer, model, sentence)

    def _in_dtype(self, model: torch.nn.Module, tokenizer) -> torch.nn.Module:
        """The float32 model as ``dtype`` says: auto's choice (``auto_dtype.choose``), or the dtype given."""
        if self.dtype == "auto":
            return auto_dtype.choose(model, tokenizer, self.model)[0]
        return model.to(self.dtype)

    def prepare(self, model: torch.nn.Module) -> torch.nn.Module:
        """Called once per process on the loaded model, before its first batch; returns the model to use. Override
        it for per-worker steps, e.g. ``fastbert.cuda_graphs(model)`` on GPU workers (graphs are never pickled)."""
        return model

    def embed(self, texts: str | Sequence[str] | np.ndarray):
        """The embeddings of ``texts`` (a sequence or 1-D array of str), in their order, as the folder's
        ``encode`` gives them: dense, an array [len(texts), dim] (float32, or the ``precision``'s dtype); sparse, a
        list of (indices int64, values float32) arrays; multi-vector, a list of [tokens, dim] arrays. Of one str,
        that text's output alone (as ``encode``). The ``make_predict_fn`` result for Spark's ``predict_batch_udf``
        (which reads its inputs from this signature: one argument)."""
        if isinstance(texts, str):
            return self.embed([texts])[0]
        texts = list(texts.tolist() if isinstance(texts, np.ndarray) else texts)
        for i, text in enumerate(texts):
            if not isinstance(text, str):
                raise TypeError(f"texts[{i}]: expected str, got {type(text).__name__} ({text!r:.40})")
        loaded = self.load()
        sentence = loaded.sentence
        texts = sentence.prompted(texts, self.task)
        if sentence.lowercase:
            texts = [text.lower() for text in texts]
        if loaded.model is None:  # a static lookup: no forward
            ids = loaded.tokenizer(texts, add_special_tokens=False, truncation=True)["input_ids"]
            return [_numpy_sparse(i, v) for i, v in self._top_k(retrieval.static_sparse(loaded.head, ids), loaded)]
        outputs = self._forwards(texts, loaded)
        if sentence.kind == "sparse":
            return [_numpy_sparse(*row) for row in outputs]
        if sentence.kind == "multi_vector":
            return self._quantized_vectors(outputs, sentence)
        if not texts:
            return np.zeros((0, loaded.model.config.hidden_size * len(sentence.pooling)), dtype=np.float32)
        return self._quantized(torch.stack(outputs).numpy()[:, : sentence.truncate_dim], self.precision)

    def _forwards(self, texts: list[str], loaded: _Loaded) -> list:
        """Each text's output (dense: its pooled vector; sparse: (indices, values); multi-vector: [tokens, dim]),
        as tensors on the CPU, running the model on sub-batches of at most ``token_budget`` padded tokens."""
        tokenizer, sentence = loaded.tokenizer, loaded.sentence
        max_length = sentence.max_length
        if sentence.kind == "multi_vector":
            max_length = sentence.head.max_length(self.task, max_length)
        ids = tokenizer(texts, truncation=True, max_length=max_length)["input_ids"] if texts else []  # unpadded
        lengths = [len(row) for row in ids]
        expansion = sentence.head.query_expansion if sentence.kind == "multi_vector" and self.task == "query" else None
        if expansion is not None:  # (queries grow to the expansion length)
            lengths = [max(n, expansion["length"]) for n in lengths]
        groups = self._sub_batches(lengths) if texts else []
        show_progress_bar = self.show_progress_bar
        if show_progress_bar is None:
            show_progress_bar = len(texts) >= PROGRESS_TEXTS and sys.stderr.isatty()
        if show_progress_bar:
            from tqdm.auto import tqdm

            groups = tqdm(groups, desc="fastbert embed", unit="batch")
        out = [None] * len(texts)
        fixed = expansion is not None and expansion["strategy"] == "fixed"
        # Sub-batches padded on the right, whatever the tokenizer says: left padding shifts BERT's positions by the
        # padding a row gets, so its output would depend on the rows it is batched with (fixed-width queries: every
        # row has the expansion length, no padding of its own to depend on).
        side = tokenizer.padding_side if fixed else "right"
        if side != tokenizer.padding_side and texts:
            announce.note(f"{self.model}'s tokenizer pads on the left; Embedder pads on the right, so that a text's "
                          "positions, and its embedding, do not depend on its batch: the outputs are "
                          "sentence-transformers' for each text alone (its left-padded batches shift positions)")
        for rows in groups:
            batch = tokenizer.pad({"input_ids": [ids[i] for i in rows]}, padding="max_length" if fixed else True,
                                  max_length=max_length if fixed else None, padding_side=side, return_tensors="pt")
            with torch.inference_mode():
                results = self._run(loaded, batch["input_ids"], batch["attention_mask"], expansion is not None)
            for i, result in zip(rows, results):
                out[i] = result
        return out

    def _run(self, loaded: _Loaded, input_ids: torch.Tensor, attention_mask: torch.Tensor, expand: bool) -> list:
        """One padded sub-batch [rows, S] (on the CPU) -> each row's output on the CPU."""
        sentence, device = loaded.sentence, self.device
        if sentence.kind == "sparse":
            embeddings = loaded.head.splade(input_ids.to(device), attention_mask.to(device), None,
                                            sentence.head.activation, sentence.head.pooling).float().cpu()
            return retrieval.sparse_rows(retrieval.top_k(embeddings, self.top_k or sentence.head.top_k))
        if sentence.kind == "multi_vector":
            head, positions = sentence.head, None
            if expand:
                input_ids, attention_mask, positions = head.expand(loaded.tokenizer, input_ids, attention_mask)
            scored = head.scored(loaded.tokenizer, input_ids, attention_mask, positions, self.task)
            vectors, cu_seqlens = token_vectors(loaded.model, input_ids.to(device), attention_mask.to(device), None,
                                                scored.to(device), loaded.head, sentence.normalize)
            return list(vectors.float().cpu().split(cu_seqlens.diff().tolist()))
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
        hidden = loaded.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state  # [rows, S, H]
        pooled = pool(hidden, attention_mask, sentence.pooling)
        pooled = torch.nn.functional.normalize(pooled, dim=-1) if sentence.normalize else pooled
        return list(pooled.float().cpu())

    def _top_k(self, rows: list, loaded: _Loaded) -> list:
        """``top_k`` on (indices, values) rows, as on their dense vectors."""
        k = self.top_k or loaded.sentence.head.top_k
        if k is None:
            return rows
        dense = torch.zeros(len(rows), loaded.head.shape[0])
        for row, (indices, values) in zip(dense, rows):
            row[indices] = values
        return retrieval.sparse_rows(retrieval.top_k(dense, k))

    def _quantized(self, embeddings: np.ndarray, precision: str) -> np.ndarray:
        """[n, dim] float32 -> ``precision``, the ranges given, calibrated, or this call's."""
        if not precision.endswith("int8"):
            return precisions.quantize(embeddings, precision)
        ranges = self.ranges
        if ranges is None and len(embeddings):
            if self.calibration_embeddings is None:
                announce.note(f"Embedder(precision={precision!r}) without ranges or calibration_embeddings: each "
                              "call's ranges come from its own embeddings (as quantize_embeddings computes them), so "
                              "an engine's batches are quantized differently; pass ranges or calibration_embeddings")
            ranges = precisions.ranges_of(embeddings, precision, self.calibration_embeddings)
        return precisions.quantize(embeddings, precision, ranges)

    def _quantized_vectors(self, vectors: list[torch.Tensor], sentence: Sentence) -> list[np.ndarray]:
        """Each text's [tokens, dim]: truncated and L2-normalized (``truncate_dim``), in ``precision`` with ranges
        shared by the call's vectors."""
        if sentence.truncate_dim is not None:
            vectors = [torch.nn.functional.normalize(v[:, : sentence.truncate_dim], dim=-1) for v in vectors]
        arrays = [v.numpy() for v in vectors]
        if self.precision == "float32" or not arrays:
            return arrays
        counts = np.cumsum([len(a) for a in arrays])[:-1]
        return np.split(self._quantized(np.concatenate(arrays), self.precision), counts)

    def _sub_batches(self, lengths: list[int]) -> list[list[int]]:
        """Row indices grouped shortest first, each group at most ``token_budget`` padded tokens (one row alone
        may exceed it): rows x the group's longest length."""
        groups, group, longest = [], [], 0
        for i in sorted(range(len(lengths)), key=lengths.__getitem__):
            longest_with = max(longest, lengths[i])
            if group and longest_with * (len(group) + 1) > self.token_budget:
                groups.append(group)
                group, longest_with = [], lengths[i]
            group.append(i)
            longest = longest_with
        return groups + [group]

    def __call__(self, batch):
        """A Ray Data / pandas batch -> the same batch with the outputs added: a dict of columns (Ray's ``"numpy"``
        format) gets ``output_column``, a [rows, dim] array (dense) or an object array of [tokens, dim] arrays
        (multi-vector: Ray Data stores it as a variable-shaped tensor column, in Arrow and Parquet), or, sparse, the
        object arrays ``<output_column>_indices`` and ``<output_column>_values``; a pandas DataFrame gets the same
        columns, of arrays."""
        if isinstance(batch, Mapping):
            columns = batch
        elif hasattr(batch, "columns") and hasattr(batch, "assign"):  # a pandas DataFrame (not imported here)
            columns = {name: batch[name] for name in batch.columns}
        else:
            raise TypeError(f"batch: expected a dict of columns or a pandas DataFrame, got {type(batch).__name__}")
        if self.text_column not in columns:
            raise KeyError(f"text_column={self.text_column!r} is not a column of the batch (it has "
                           f"{', '.join(map(str, columns)) or 'none'})")
        texts = columns[self.text_column]
        outputs = self.embed(texts.to_numpy() if hasattr(texts, "to_numpy") else texts)
        kind = self.load().sentence.kind
        if kind == "sparse":
            added = {f"{self.output_column}_indices": _objects([indices for indices, _ in outputs]),
                     f"{self.output_column}_values": _objects([values for _, values in outputs])}
        else:
            added = {self.output_column: _objects(outputs) if kind == "multi_vector" else outputs}
        if isinstance(batch, Mapping):
            return {**batch, **added}
        return batch.assign(**{name: list(column) for name, column in added.items()})


def _objects(arrays: list[np.ndarray]) -> np.ndarray:
    """A 1-D object array holding ``arrays`` as they are (np.array would stack arrays of equal shapes)."""
    column = np.empty(len(arrays), dtype=object)
    for i, array in enumerate(arrays):
        column[i] = array
    return column


def _numpy_sparse(indices: torch.Tensor, values: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    return indices.numpy().astype(np.int64), values.numpy().astype(np.float32)
