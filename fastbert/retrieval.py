"""What a sentence-transformers SparseEncoder or MultiVectorEncoder folder says about its heads, and their math on
token ids, so that ``Embedder`` gives their ``encode``'s outputs without loading sentence-transformers.

SparseEncoder (``config_sentence_transformers.json``: ``"model_type": "SparseEncoder"``; ``max_active_dims``: top-k)
    Transformer (fill-mask) or MLMTransformer, SpladePooling     SPLADE (``sparse.MLMHead.splade``)
    Router with routes of those, or of a SparseStaticEmbedding  inference-free SPLADE: the route of the task (query:
                                                                the static lookup, document: SPLADE)
MultiVectorEncoder (``"model_type": "MultiVectorEncoder"``)
    Transformer (``query_length``, ``document_length``, ``query_expansion`` in its sentence_bert_config.json),
    Dense (token_embeddings), MultiVectorMask (skip-list), Normalize                 (``multi_vector.token_vectors``)

A folder with other modules is refused, naming the module.
"""

import dataclasses
import json
import os

import torch

from .kernels.splade_pool import ACTIVATIONS, POOLINGS


def _module_kind(module: dict) -> str:
    return str(module.get("type", "")).rsplit(".", 1)[-1]


def _refuse(model: str, what: str) -> ValueError:
    return ValueError(f"{model}: {what} has no fastbert counterpart; use fastbert.optimize on the model "
                      "sentence-transformers loads instead")


# --- SPLADE -----------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SparseHead:
    """The route a SparseEncoder folder takes for a task: SPLADE (``activation``, ``pooling``) on ``transformer``, or
    the static lookup of ``static`` (a SparseStaticEmbedding folder: its weights and tokenizer). ``top_k``: the
    folder's ``max_active_dims``."""

    transformer: str | None = None
    activation: str = "relu"
    pooling: str = "max"
    static: str | None = None
    top_k: int | None = None

    @classmethod
    def read(cls, model: str, modules: list[dict], task: str | None, settings: dict, join, read_json) -> "SparseHead":
        top_k = settings.get("max_active_dims")
        kinds = [_module_kind(m) for m in modules]
        if kinds == ["Router"]:
            folder = join(model, modules[0].get("path", ""))
            config = read_json(folder, "router_config.json")
            parameters = config.get("parameters", {})
            if parameters.get("route_mappings"):
                raise _refuse(model, "a Router with route_mappings")
            structure = config.get("structure", {})
            route = task if task in structure else parameters.get("default_route")
            if route not in structure:
                raise ValueError(f"task={task!r}: {model}'s Router has the routes {', '.join(structure)} and no "
                                 "default route")
            names = structure[route]
            route_modules = [{"type": config["types"][name], "path": name} for name in names]
            return cls._route(model, route_modules, folder, top_k, join, read_json)
        return cls._route(model, modules, model, top_k, join, read_json)

    @classmethod
    def _route(cls, model, modules, folder, top_k, join, read_json) -> "SparseHead":
        kinds = [_module_kind(m) for m in modules]
        if kinds == ["SparseStaticEmbedding"]:
            return cls(static=join(folder, modules[0].get("path", "")), top_k=top_k)
        if len(kinds) != 2 or kinds[0] not in ("Transformer", "MLMTransformer") or kinds[1] != "SpladePooling":
            raise _refuse(model, f"a SparseEncoder of {', '.join(kinds)} (fastbert reproduces a Transformer and a "
                                 "SpladePooling, or a Router of those and a SparseStaticEmbedding)")
        transformer = join(folder, modules[0].get("path", ""))
        if read_json(transformer, "sentence_bert_config.json").get("transformer_task", "fill-mask") != "fill-mask":
            raise _refuse(model, "a SPLADE Transformer that is not fill-mask")
        splade = read_json(join(folder, modules[1].get("path", "")), "config.json")
        activation = splade.get("activation_function", "relu")
        pooling = splade.get("pooling_strategy", "max")
        if activation not in ACTIVATIONS or pooling not in POOLINGS:
            raise _refuse(model, f"SpladePooling {pooling!r} / {activation!r}")
        return cls(transformer, activation, pooling, top_k=top_k)


def static_sparse(weight: torch.Tensor, ids: list[list[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """SparseStaticEmbedding: each text's distinct token ids, valued by the weight (zeros dropped), sorted."""
    out = []
    for row in ids:
        indices = torch.tensor(sorted(set(row)), dtype=torch.long)
        values = weight[indices]
        keep = values != 0
        out.append((indices[keep], values[keep]))
    return out


def top_k(embeddings: torch.Tensor, k: int | None) -> torch.Tensor:
    """sentence-transformers' ``select_max_active_dims``: [rows, vocab] with all but the k largest (by absolute value)
    of each row zeroed."""
    if k is None:
        return embeddings
    _, indices = torch.topk(torch.abs(embeddings), k=min(k, embeddings.shape[-1]), dim=-1)
    return torch.zeros_like(embeddings).scatter_(-1, indices, embeddings.gather(-1, indices))


def sparse_rows(embeddings: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """[rows, vocab] -> each row's (indices of its non-zero entries, ascending; their values)."""
    return [(row.nonzero().flatten(), row[row != 0]) for row in embeddings]


# --- multi-vector -----------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class MultiVectorHead:
    """A MultiVectorEncoder folder's token heads: ``dense`` (a Dense folder, or None), the skip-list (``mask``: None
    without a MultiVectorMask), ``normalize``; its Transformer's per-task lengths and query expansion."""

    dense: str | None = None
    mask: dict | None = None  # skiplist_words, skiplist_tasks, keep_only_token_ids
    normalize: bool = False
    query_length: int | None = None
    document_length: int | None = None
    query_expansion: dict | None = None

    @classmethod
    def read(cls, model: str, modules: list[dict], transformer_settings: dict, join, read_json) -> "MultiVectorHead":
        kinds = [_module_kind(m) for m in modules]
        rest, values = list(zip(kinds, modules))[1:], {}
        if rest and rest[0][0] == "Dense":
            config = read_json(join(model, rest[0][1].get("path", "")), "config.json")
            if config.get("module_input_name", "sentence_embedding") != "token_embeddings" or config.get(
                    "module_output_name", config.get("module_input_name")) != "token_embeddings":
                raise _refuse(model, "a Dense module that does not map token_embeddings to token_embeddings")
            values["dense"], rest = join(model, rest[0][1].get("path", "")), rest[1:]
        if rest and rest[0][0] == "MultiVectorMask":
            config = read_json(join(model, rest[0][1].get("path", "")), "config.json")
            tasks = config.get("skiplist_tasks", ["document"])
            values["mask"] = dict(skiplist_words=list(config.get("skiplist_words") or []),
                                  skiplist_tasks=[tasks] if isinstance(tasks, str) else list(tasks),
                                  keep_only_token_ids=config.get("keep_only_token_ids"))
            rest = rest[1:]
        if rest and rest[0][0] == "Normalize":
            values["normalize"], rest = True, rest[1:]
        if kinds[:1] != ["Transformer"] or rest:
            raise _refuse(model, f"a MultiVectorEncoder of {', '.join(kinds)} (fastbert reproduces Transformer, "
                                 "Dense, MultiVectorMask, Normalize)")
        expansion = transformer_settings.get("query_expansion")
        if expansion is not None:
            expansion = {"attend": False, "token": None, **expansion}
        return cls(**values, query_length=transformer_settings.get("query_length"),
                   document_length=transformer_settings.get("document_length"), query_expansion=expansion)

    def max_length(self, task: str | None, default: int) -> int:
        """The tokenizer's max_length for ``task``: the expansion length for fixed-width queries, else the task's
        length (at least the expansion length for "min" queries), else ``default``."""
        expansion = self.query_expansion if task == "query" else None
        if expansion is not None and expansion["strategy"] == "fixed":
            return expansion["length"]
        length = {"query": self.query_length, "document": self.document_length}.get(task) or default
        return max(length, expansion["length"]) if expansion is not None and self.query_length else length

    def projection(self):
        """The Dense module as a function on rows (None without one): activation(linear(x)) (+ its residual)."""
        if self.dense is None:
            return None
        config = read_json(self.dense, "config.json")
        activation = _activation(config.get("activation_function", "torch.nn.modules.activation.Tanh"))
        weights = load_weights(self.dense)
        linear = torch.nn.Linear(config["in_features"], config["out_features"], bias=config.get("bias", True))
        residual = None
        if config.get("use_residual") and config["in_features"] != config["out_features"]:
            residual = torch.nn.Linear(config["in_features"], config["out_features"], bias=False)
            residual.weight = torch.nn.Parameter(weights["residual.weight"])
        linear.load_state_dict({k.removeprefix("linear."): v for k, v in weights.items() if k.startswith("linear.")})
        linear.eval()

        def project(x: torch.Tensor) -> torch.Tensor:
            x = x.float()  # (the Dense module's float32 weights, whatever the encoder computes in: dtype="auto")
            out = activation(linear.to(x.device)(x))
            if config.get("use_residual"):
                out = out + (x if residual is None else residual.to(x.device)(x))
            return out
        return project

    def scored(self, tokenizer, input_ids: torch.Tensor, attention_mask: torch.Tensor,
               expansion_positions: torch.Tensor | None, task: str | None) -> torch.Tensor:
        """MultiVectorMask's scoring mask [B, S] bool (the attention mask without one)."""
        mask = attention_mask.bool()
        if self.mask is None:
            return mask
        if task == "query" and expansion_positions is not None:
            mask = mask | expansion_positions
        skip = _skiplist_ids(tokenizer, self.mask["skiplist_words"])
        if (task or "document") in self.mask["skiplist_tasks"] and skip:
            mask = ~torch.isin(input_ids, torch.tensor(skip, dtype=torch.long)) & mask
        if task != "query" and self.mask["keep_only_token_ids"]:
            mask = torch.isin(input_ids, torch.tensor(self.mask["keep_only_token_ids"], dtype=torch.long)) & mask
        return mask

    def expand(self, tokenizer, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple:
        """ColBERT's query expansion of a padded query batch, as sentence-transformers' Transformer.preprocess does it:
        (input_ids, attention_mask, expansion positions [B, S] bool)."""
        expansion, floor = self.query_expansion, self.query_expansion["length"]
        if input_ids.shape[1] < floor:  # ("min": the batch is widened to the floor, on the right)
            missing = floor - input_ids.shape[1]
            input_ids = torch.nn.functional.pad(input_ids, (0, missing), value=0)
            attention_mask = torch.nn.functional.pad(attention_mask, (0, missing), value=0)
        positions = (attention_mask == 0) & (torch.arange(input_ids.shape[1]) < floor)
        token = (tokenizer.convert_tokens_to_ids(expansion["token"]) if expansion["token"] is not None else
                 tokenizer.mask_token_id if tokenizer.mask_token_id is not None else tokenizer.eos_token_id)
        if token is not None:
            input_ids = input_ids.masked_fill(positions, token)
        if expansion["attend"]:
            attention_mask = attention_mask.masked_fill(positions, 1)
        return input_ids, attention_mask, positions


def read_json(folder: str, name: str) -> dict:
    with open(os.path.join(folder, name)) as f:
        return json.load(f)


def _skiplist_ids(tokenizer, words: list[str]) -> list[int]:
    """MultiVectorMask.resolve_with_tokenizer: the words' ids, those that are no single token (unknown) dropped."""
    ids = []
    for word in words:
        token_id = tokenizer.convert_tokens_to_ids(word)
        if tokenizer.unk_token_id is None or token_id != tokenizer.unk_token_id or word == tokenizer.unk_token:
            ids.append(token_id)
    return ids


def _activation(path: str) -> torch.nn.Module:
    """A Dense module's activation: a torch.nn class, as sentence-transformers loads it without trust_remote_code."""
    import importlib

    module_name, _, name = path.rpartition(".")
    cls = getattr(importlib.import_module(module_name), name, None) if path.startswith("torch.") else None
    if not (isinstance(cls, type) and issubclass(cls, torch.nn.Module)):
        raise ValueError(f"Dense activation_function {path!r}: fastbert loads torch.nn modules only")
    return cls()


def load_weights(folder: str) -> dict[str, torch.Tensor]:
    """A sentence-transformers module folder's weights: model.safetensors, else pytorch_model.bin."""
    path = os.path.join(folder, "model.safetensors")
    if os.path.isfile(path):
        from safetensors.torch import load_file

        return load_file(path)
    return torch.load(os.path.join(folder, "pytorch_model.bin"), map_location="cpu", weights_only=True)
