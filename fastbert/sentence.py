"""What a sentence-transformers model folder says about turning token states into a sentence embedding, and that
math, so that fastbert's ``Embedder`` and server give ``SentenceTransformer.encode``'s vectors without loading
sentence-transformers.

A sentence-transformers folder (local, or a Hub id in the cache) lists its modules in ``modules.json``:

    Transformer   the HF model and tokenizer (in the folder itself, or a subfolder); ``sentence_bert_config.json``:
                  ``max_seq_length`` (texts are truncated there, not at the tokenizer's limit), ``do_lower_case``
    Pooling       ``config.json``: one or more of cls, max, mean, mean_sqrt_len_tokens, weightedmean, lasttoken
                  (several are concatenated, in that order)
    Normalize     L2 normalization

``Sentence.read`` returns them; a folder with any other module (Dense, LayerNorm, ...) is refused with an error
naming it. A plain transformers folder has no ``modules.json``: mean pooling and normalization, as all-MiniLM does.
``config_sentence_transformers.json`` gives the kind of output (its ``model_type``, as sentence-transformers reads it:
SentenceTransformer, SparseEncoder, MultiVectorEncoder; ``retrieval.py`` reads the last two's heads), the prompts and
``truncate_dim``.
"""

import dataclasses
import json
import math
import os

import torch

from . import retrieval

# sentence-transformers' pooling modes, in the order it concatenates them.
POOLING_MODES = ("cls", "max", "mean", "mean_sqrt_len_tokens", "weightedmean", "lasttoken")
# Its older configs: one flag per mode.
_LEGACY_FLAGS = {"pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max", "pooling_mode_mean_tokens": "mean",
                 "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                 "pooling_mode_weightedmean_tokens": "weightedmean", "pooling_mode_lasttoken": "lasttoken"}
_SUPPORTED = ("Transformer", "Pooling", "Normalize")


# config_sentence_transformers.json's model_type -> the kind of output (fastbert.corpus.Embedder's ``kind``).
KINDS = {"SentenceTransformer": "dense", "SparseEncoder": "sparse", "MultiVectorEncoder": "multi_vector"}


@dataclasses.dataclass(frozen=True)
class Sentence:
    """How a model folder makes its embeddings: ``transformer`` (the folder or Hub path of its HF model and
    tokenizer), ``max_length`` (None: the tokenizer's and the model's limit), ``lowercase``, ``pooling`` (modes of
    ``POOLING_MODES``), ``normalize``; ``sentence_transformers``: whether it came from a sentence-transformers
    folder. ``kind``: "dense", "sparse" or "multi_vector" (the folder's model type); ``head``: a sparse or
    multi-vector folder's heads (``retrieval.SparseHead``, ``retrieval.MultiVectorHead``); ``prompts``,
    ``default_prompt_name``, ``truncate_dim``: the folder's defaults; ``include_prompt``: whether pooling reads the
    prompt's tokens."""

    transformer: str | None
    max_length: int | None = None
    lowercase: bool = False
    pooling: tuple[str, ...] = ("mean",)
    normalize: bool = True
    sentence_transformers: bool = False
    kind: str = "dense"
    head: object = None
    prompts: tuple[tuple[str, str], ...] = ()
    default_prompt_name: str | None = None
    truncate_dim: int | None = None
    include_prompt: bool = True

    @classmethod
    def read(cls, model: str, task: str | None = None) -> "Sentence":
        """The folder's (or cached Hub model's) settings, for ``task`` (the route of an inference-free SPLADE); a plain
        transformers model: mean pooling, normalized."""
        modules_file = _file(model, "modules.json")
        if modules_file is None:
            return cls(model)
        with open(modules_file) as f:
            modules = json.load(f)
        config = _json(_file(model, "config_sentence_transformers.json"))
        model_type = config.get("model_type", "SentenceTransformer")
        if model_type not in KINDS:
            raise ValueError(f"{model}: a {model_type} folder (config_sentence_transformers.json) has no fastbert "
                             f"counterpart (fastbert reproduces {', '.join(KINDS)}); use fastbert.optimize on the "
                             "model sentence-transformers loads instead")
        common = dict(sentence_transformers=True, kind=KINDS[model_type],
                      prompts=tuple((config.get("prompts") or {}).items()),
                      default_prompt_name=config.get("default_prompt_name"), truncate_dim=config.get("truncate_dim"))
        if common["kind"] == "sparse":
            head = retrieval.SparseHead.read(model, modules, task, config, _join, _folder_json)
            settings = {} if head.transformer is None else _folder_json(head.transformer, "sentence_bert_config.json")
            return cls(head.transformer, settings.get("max_seq_length"), bool(settings.get("do_lower_case", False)),
                       (), False, head=head, **common)
        if common["kind"] == "multi_vector":
            transformer = _join(model, modules[0].get("path", ""))
            settings = _folder_json(transformer, "sentence_bert_config.json")
            head = retrieval.MultiVectorHead.read(model, modules, settings, _join, _folder_json)
            return cls(transformer, settings.get("max_seq_length"), bool(settings.get("do_lower_case", False)), (),
                       head.normalize, head=head, **common)
        kinds = {}
        for module in modules:
            kind = str(module.get("type", "")).rsplit(".", 1)[-1]
            if kind not in _SUPPORTED:
                raise ValueError(f"{model}: its sentence-transformers module {module.get('type')!r} "
                                 f"({module.get('path') or 'the root'}) has no fastbert counterpart (fastbert "
                                 f"reproduces {', '.join(_SUPPORTED)}); use fastbert.optimize(SentenceTransformer("
                                 f"{model!r})).encode instead")
            kinds[kind] = module.get("path", "")
        if "Transformer" not in kinds:
            raise ValueError(f"{model}: modules.json lists no Transformer module")
        transformer = _join(model, kinds["Transformer"])
        settings = _json(_file(transformer, "sentence_bert_config.json"))
        pooling_config = {} if "Pooling" not in kinds else _json(_file(_join(model, kinds["Pooling"]), "config.json"))
        pooling = ("cls",) if "Pooling" not in kinds else _pooling_modes(pooling_config, model)
        return cls(transformer, settings.get("max_seq_length"), bool(settings.get("do_lower_case", False)), pooling,
                   "Normalize" in kinds, include_prompt=bool(pooling_config.get("include_prompt", True)), **common)

    def prompt(self, task: str | None) -> str | None:
        """The prompt sentence-transformers' encode (task None) or encode_query / encode_document prepends."""
        prompts = dict(self.prompts)
        name = task if task is not None and task in prompts else self.default_prompt_name
        return prompts.get(name) if name is not None else None

    def prompted(self, texts: list[str], task: str | None) -> list[str]:
        """``texts``, each after the task's prompt (``prompt``), as sentence-transformers tokenizes them."""
        prompt = self.prompt(task)
        return [prompt + text for text in texts] if prompt else texts


def _folder_json(folder: str, name: str) -> dict:
    return _json(_file(folder, name))


def _join(model: str, path: str) -> str:
    if not path:
        return model
    if os.path.isdir(model):
        return os.path.join(model, path)
    local = _file(model, os.path.join(path, "config.json"))  # a Hub id: the subfolder in the cache
    return os.path.dirname(local) if local else f"{model}/{path}"


def _file(model: str, name: str) -> str | None:
    """The path of ``name`` in a local folder, or in the cached (or downloadable) Hub model ``model``, or None."""
    if os.path.isdir(model):
        path = os.path.join(model, name)
        return path if os.path.isfile(path) else None
    from transformers.utils import cached_file

    try:
        return cached_file(model, name, _raise_exceptions_for_missing_entries=False,
                           _raise_exceptions_for_connection_errors=False)
    except (OSError, ValueError):
        return None


def _json(path: str | None) -> dict:
    if path is None:
        return {}
    with open(path) as f:
        value = json.load(f)
    return value if isinstance(value, dict) else {}


def _pooling_modes(config: dict, model: str) -> tuple[str, ...]:
    mode = config.get("pooling_mode")
    if mode is not None:
        modes = (mode,) if isinstance(mode, str) else tuple(mode)
    else:
        chosen = {_LEGACY_FLAGS[k] for k, v in config.items() if k in _LEGACY_FLAGS and v}
        modes = tuple(m for m in POOLING_MODES if m in chosen)
    unknown = [m for m in modes if m not in POOLING_MODES]
    if unknown or not modes:
        raise ValueError(f"{model}: pooling mode {unknown or 'none'} is not one of {', '.join(POOLING_MODES)}")
    return modes


def pool(hidden: torch.Tensor, mask: torch.Tensor, modes: tuple[str, ...]) -> torch.Tensor:
    """hidden [B, S, H], mask [B, S] (1 = real token) -> [B, H * len(modes)], as sentence-transformers' Pooling
    computes it (sums in float32 for 16-bit states). Padding positions may hold anything (fastbert's are zeros)."""
    accumulate = torch.float32 if hidden.dtype in (torch.float16, torch.bfloat16) else hidden.dtype
    outputs = []
    for mode in modes:
        if mode == "cls":  # the first real token (left padding included)
            first = mask.to(torch.int).argmax(dim=1)
            outputs.append(hidden[torch.arange(hidden.shape[0]), first])
        elif mode == "max":
            outputs.append(hidden.masked_fill(mask[..., None] == 0, float("-inf")).max(dim=1).values)
        elif mode in ("mean", "mean_sqrt_len_tokens"):
            weights = mask[..., None].to(hidden.dtype)
            total = (hidden * weights).sum(dim=1, dtype=accumulate)
            count = weights.sum(dim=1, dtype=accumulate).clamp(min=1e-9)
            outputs.append((total / (count if mode == "mean" else count.sqrt())).to(hidden.dtype))
        elif mode == "weightedmean":  # weights 1, 2, ... from each row's first real token
            positions = torch.arange(1, hidden.shape[1] + 1, device=hidden.device, dtype=accumulate).view(1, -1, 1)
            positions = positions - mask.to(torch.int32).argmax(dim=1).view(-1, 1, 1)
            weights = mask[..., None].to(accumulate) * positions
            outputs.append(((hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1e-9)).to(hidden.dtype))
        elif mode == "lasttoken":  # the last real token (right or left padding)
            values, from_end = mask.flip(1).max(1)
            last = hidden.shape[1] - 1 - torch.where(values == 0, hidden.shape[1] - 1, from_end)
            outputs.append(hidden[torch.arange(hidden.shape[0]), last] * values[:, None].to(hidden.dtype))
        else:
            raise ValueError(f"pooling mode {mode!r} is not one of {', '.join(POOLING_MODES)}")
    return torch.cat(outputs, dim=-1)


def pool_packed(hidden: torch.Tensor, seqlens: torch.Tensor, modes: tuple[str, ...]) -> torch.Tensor:
    """``pool`` of sequences that come back to back without padding: hidden [N, H], seqlens [B] int64 (each >= 1)
    -> [B, H * len(modes)]: the same math on each sequence's own rows (segment sums, maxima, first and last rows)."""
    if hidden.device.type == "cpu":
        return _pool_sequences(hidden, seqlens.tolist(), modes)
    batch, width = seqlens.shape[0], hidden.shape[1]
    accumulate = torch.float32 if hidden.dtype in (torch.float16, torch.bfloat16) else hidden.dtype
    ends = torch.cumsum(seqlens, 0)
    starts = ends - seqlens
    segment = torch.repeat_interleave(torch.arange(batch, device=hidden.device), seqlens)  # [N]: its sequence
    count = seqlens.to(accumulate)[:, None]  # [B, 1]
    outputs = []
    for mode in modes:
        if mode == "cls":
            outputs.append(hidden[starts])
        elif mode == "lasttoken":
            outputs.append(hidden[ends - 1])
        elif mode == "max":
            outputs.append(hidden.new_full((batch, width), float("-inf")).index_reduce_(0, segment, hidden, "amax"))
        elif mode in ("mean", "mean_sqrt_len_tokens"):
            total = hidden.new_zeros((batch, width), dtype=accumulate).index_add_(0, segment, hidden.to(accumulate))
            outputs.append((total / (count if mode == "mean" else count.sqrt())).to(hidden.dtype))
        elif mode == "weightedmean":  # weights 1, 2, ... within each sequence
            weights = (torch.arange(hidden.shape[0], device=hidden.device) - starts[segment] + 1).to(accumulate)
            total = hidden.new_zeros((batch, width), dtype=accumulate).index_add_(
                0, segment, hidden.to(accumulate) * weights[:, None])
            outputs.append((total / (count * (count + 1) / 2)).to(hidden.dtype))
        else:
            raise ValueError(f"pooling mode {mode!r} is not one of {', '.join(POOLING_MODES)}")
    return torch.cat(outputs, dim=-1)


def _pool_sequences(hidden: torch.Tensor, seqlens: list[int], modes: tuple[str, ...]) -> torch.Tensor:
    """``pool_packed`` on the CPU, each sequence's rows a view reduced on its own: index_add_ and index_reduce_ sort
    their [N, H] index there first (0.3-1 ms for one 18-token sequence of width 384 on a 2-core AMD EPYC, Zen 3,
    against ~10 us for its sum)."""
    accumulate = torch.float32 if hidden.dtype in (torch.float16, torch.bfloat16) else hidden.dtype
    parts = torch.split(hidden, seqlens)  # [n_b, H] each

    def pooled(part: torch.Tensor, mode: str) -> torch.Tensor:  # [n, H] -> [H]
        n = part.shape[0]
        if mode == "cls":
            return part[0]
        if mode == "lasttoken":
            return part[-1]
        if mode == "max":
            return part.amax(0)
        if mode in ("mean", "mean_sqrt_len_tokens"):
            return (part.sum(0, dtype=accumulate) / (n if mode == "mean" else math.sqrt(n))).to(hidden.dtype)
        if mode == "weightedmean":  # weights 1, 2, ... within the sequence
            weights = torch.arange(1, n + 1, dtype=accumulate)[:, None]
            return ((part.to(accumulate) * weights).sum(0) / (n * (n + 1) / 2)).to(hidden.dtype)
        raise ValueError(f"pooling mode {mode!r} is not one of {', '.join(POOLING_MODES)}")

    if not parts:
        return hidden.new_empty((0, hidden.shape[1] * len(modes)))
    return torch.stack([torch.cat([pooled(part, mode) for mode in modes]) for part in parts])
