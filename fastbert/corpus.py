"""Corpus embedding on any engine: one picklable callable that Ray Data, Spark and a plain loop all call on batches.

    embed = fastbert.corpus.Embedder("sentence-transformers/all-MiniLM-L6-v2")     # holds only its arguments
    embed.embed(["a text", "another"])                  # -> float32 array [2, dim], SentenceTransformer.encode's
    embed.embed("one text")                             # -> float32 array [dim]
    embed({"id": ids, "text": texts})                   # -> the batch with an "embedding" column [rows, dim]

    ray.data.read_parquet(src).map_batches(Embedder, fn_constructor_args=(path,), batch_size=256,
                                           compute=ray.data.ActorPoolStrategy(size=4)).write_parquet(dst)
    predict_batch_udf(lambda: Embedder(path).embed, return_type=ArrayType(FloatType()), batch_size=256)

On a sentence-transformers folder (or Hub id) the embeddings are ``SentenceTransformer.encode``'s: its
``max_seq_length``, lowercasing, pooling modes and normalization (``sentence.py``); on a plain transformers model,
mean pooling over the real tokens, L2-normalized. The engine ships the object to its workers (pickle); each worker
process loads the tokenizer and the model once, on its first batch, through ``fastbert.AutoModel`` (accelerated
there: derived caches, settings and CUDA graphs are per process and never travel). A batch is tokenized without
padding, sorted by length and cut into sub-batches of at most ``token_budget`` padded tokens, so short texts are not
padded to the longest of the batch and memory stays bounded whatever the engine's batch size; outputs come back in
the input's order. Nothing here imports an engine: the engines call it, with their own scheduling, retries and I/O
(docs/scale-out.md).
"""

import dataclasses
import os
import sys
import threading
from collections.abc import Mapping, Sequence

import numpy as np
import torch
import transformers

from .auto import AutoModel
from .sentence import POOLING_MODES, Sentence, pool

# A run of at least this many texts shows a progress bar when stderr is a terminal (``show_progress_bar=None``).
PROGRESS_TEXTS = 1000


class Embedder:
    """Texts -> sentence embeddings with a transformers or sentence-transformers checkpoint through fastbert.

    model: a local directory or Hub id (a sentence-transformers folder, or anything ``transformers.AutoModel`` and
        ``AutoTokenizer`` load). pooling: one of ``sentence.POOLING_MODES`` (default: the folder's, else ``"mean"``);
        normalize: L2-normalize each embedding (default: the folder's, else True); max_length: longer texts are
        truncated (default: the folder's ``max_seq_length``, else the tokenizer's limit, at most the model's position
        table). token_budget: the most padded tokens (rows x longest row) per forward. text_column / output_column:
        the batch columns read and written by ``__call__``. device: where the model runs in each worker (``"cuda"``
        on GPU workers). show_progress_bar: on ``embed`` calls (default: for ``PROGRESS_TEXTS`` texts or more when
        stderr is a terminal).
    """

    def __init__(self, model: str | os.PathLike, *, pooling: str | None = None, normalize: bool | None = None,
                 max_length: int | None = None, token_budget: int = 16384, text_column: str = "text",
                 output_column: str = "embedding", device: str | torch.device = "cpu",
                 show_progress_bar: bool | None = None):
        if not isinstance(model, (str, os.PathLike)):
            raise TypeError(f"model: expected a path or Hub id (str or os.PathLike), got {type(model).__name__}")
        if pooling is not None and pooling not in POOLING_MODES:
            raise ValueError(f"pooling={pooling!r}: expected one of {', '.join(POOLING_MODES)}")
        for name, value in (("max_length", max_length), ("token_budget", token_budget)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name}={value!r}: expected a positive int")
        self.model, self.pooling, self.normalize = os.fspath(model), pooling, normalize
        self.max_length, self.token_budget = max_length, token_budget
        self.text_column, self.output_column = text_column, output_column
        self.device = torch.device(device)
        self.show_progress_bar = show_progress_bar
        self._loaded = None  # (tokenizer, model, Sentence with every setting resolved) once this process loaded them
        self._lock = threading.Lock()

    # Pickles (to an engine's workers) carry the arguments only: each process loads its own model.
    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k not in ("_loaded", "_lock")}

    def __setstate__(self, state):
        self.__dict__.update(state, _loaded=None, _lock=threading.Lock())

    def load(self):
        """The tokenizer, the model in eval mode on ``device`` and how it makes sentence embeddings (``Sentence``, the
        arguments given here overriding the folder's): loaded on first use, once per process (an engine's actor or
        Python worker), then kept."""
        with self._lock:
            if self._loaded is None:
                sentence = Sentence.read(self.model)
                tokenizer = transformers.AutoTokenizer.from_pretrained(sentence.transformer)
                model = self.prepare(AutoModel.from_pretrained(sentence.transformer).to(self.device).eval())
                limit = min(tokenizer.model_max_length, getattr(model.config, "max_position_embeddings", 1 << 30))
                max_length = min(self.max_length or sentence.max_length or limit, limit)
                pooling = (self.pooling,) if self.pooling else sentence.pooling
                normalize = sentence.normalize if self.normalize is None else self.normalize
                self._loaded = tokenizer, model, dataclasses.replace(sentence, max_length=max_length, pooling=pooling,
                                                                     normalize=normalize)
            return self._loaded

    def prepare(self, model: torch.nn.Module) -> torch.nn.Module:
        """Called once per process on the loaded model, before its first batch; returns the model to use. Override
        it for per-worker steps, e.g. ``fastbert.cuda_graphs(model)`` on GPU workers (graphs are never pickled)."""
        return model

    def embed(self, texts: str | Sequence[str] | np.ndarray) -> np.ndarray:
        """Embeddings of ``texts`` (a sequence or 1-D array of str), float32 [len(texts), dim], in their order; of
        one str, float32 [dim] (as ``SentenceTransformer.encode``). The ``make_predict_fn`` result for Spark's
        ``predict_batch_udf`` (which reads its inputs from this signature: one argument)."""
        if isinstance(texts, str):
            return self.embed([texts])[0]
        texts = list(texts.tolist() if isinstance(texts, np.ndarray) else texts)
        for i, text in enumerate(texts):
            if not isinstance(text, str):
                raise TypeError(f"texts[{i}]: expected str, got {type(text).__name__} ({text!r:.40})")
        tokenizer, model, sentence = self.load()
        if sentence.lowercase:
            texts = [text.lower() for text in texts]
        if not texts:
            return np.zeros((0, model.config.hidden_size * len(sentence.pooling)), dtype=np.float32)
        ids = tokenizer(texts, truncation=True, max_length=sentence.max_length)["input_ids"]  # unpadded
        groups = self._sub_batches([len(row) for row in ids])
        show_progress_bar = self.show_progress_bar
        if show_progress_bar is None:
            show_progress_bar = len(texts) >= PROGRESS_TEXTS and sys.stderr.isatty()
        if show_progress_bar:
            from tqdm.auto import tqdm

            groups = tqdm(groups, desc="fastbert embed", unit="batch")
        out = None
        for rows in groups:
            batch = tokenizer.pad({"input_ids": [ids[i] for i in rows]}, return_tensors="pt")
            with torch.inference_mode():
                pooled = self._pool(model, batch["input_ids"].to(self.device), batch["attention_mask"].to(self.device),
                                    sentence).float().cpu().numpy()
            out = np.empty((len(texts), pooled.shape[1]), dtype=np.float32) if out is None else out
            out[rows] = pooled
        return out

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

    def _pool(self, model, input_ids: torch.Tensor, attention_mask: torch.Tensor, sentence: Sentence) -> torch.Tensor:
        """[rows, S] ids and mask -> [rows, dim] pooled (and normalized) states."""
        hidden = model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state  # [rows, S, hidden]
        pooled = pool(hidden, attention_mask, sentence.pooling)
        return torch.nn.functional.normalize(pooled, dim=-1) if sentence.normalize else pooled

    def __call__(self, batch):
        """A Ray Data / pandas batch -> the same batch with ``output_column`` added: a dict of columns (Ray's
        ``"numpy"`` format) gets a float32 [rows, hidden] array, a pandas DataFrame a column of [hidden] arrays."""
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
        embeddings = self.embed(texts.to_numpy() if hasattr(texts, "to_numpy") else texts)
        if isinstance(batch, Mapping):
            return {**batch, self.output_column: embeddings}
        return batch.assign(**{self.output_column: list(embeddings)})
