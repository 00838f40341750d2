"""sentence-transformers' SparseEncoder and MultiVectorEncoder, heads included, as ``fastbert.optimize`` leaves them.

optimize() turns the encoder inside into fastbert's, as in any model, and gives the model a subclass of ours (of the
same name) whose ``forward`` runs the modules it knows fused, padding-free from the embedding to the pooled output:

    SparseEncoder        [Transformer (fill-mask), SpladePooling], or  sparse.MLMHead.splade: features'
                         a Router with that pair on the route taken    "sentence_embedding" [B, vocab], without the
                         (inference-free SPLADE's document side)       [B, S, vocab] logits
    MultiVectorEncoder   [Transformer, Dense, MultiVectorMask,         multi_vector.token_vectors: features'
                          Normalize] (Dense, mask, norm optional)      "token_embeddings" [B, S, dim], the scoring
                                                                       "attention_mask"

The query side of an inference-free SPLADE (SparseStaticEmbedding: a lookup) runs as it is. Anything else (other
modules, hooks on the ones bypassed, gradients, an input or option the fused path does not take) runs
sentence-transformers' own forward, said once. The classes only add that ``forward``: isinstance, ``encode``,
``save`` (the folder names sentence-transformers' classes: no module's class changes), the state_dict are
sentence-transformers'.

Where the fused forward's features differ (said once, at run time): the SPLADE pair does not write
``token_embeddings`` (the MLM logits are never materialized), and the multi-vector ``token_embeddings`` are zeros at
positions that are not scored (sentence-transformers' ``encode`` reads the scored ones only).
"""

import sentence_transformers as st
import torch
from sentence_transformers.base.modules import Dense, Normalize, Router, Transformer
from sentence_transformers.multi_vector_encoder.modules import MultiVectorMask
from sentence_transformers.sparse_encoder.modules import MLMTransformer, SpladePooling
from torch import nn

from . import announce, compat, modeling, multi_vector
from .kernels.splade_pool import ACTIVATIONS, POOLINGS
from .plain import has_hooks
from .sparse import MLMHead

# The features a fused forward reads or may ignore (sentence-transformers' bookkeeping); any other key would go to
# the model (positions, embeddings, flattened inputs), so it runs sentence-transformers' forward instead.
_TOKEN_INPUTS = ("input_ids", "attention_mask", "token_type_ids")
_IGNORED = {"modality", "prompt_length", "task", "query_expansion_positions"}


def _plain(module: nn.Module, *classes: type) -> bool:
    return type(module) in classes and not has_hooks(module)


def _why_not_transformer(transformer: nn.Module, task: str, features: dict) -> str | None:
    """Why the fused path cannot stand in for ``transformer`` (sentence-transformers' Transformer module, run for
    ``task`` "fill-mask" or "feature-extraction") on ``features``."""
    if not _plain(transformer, Transformer, MLMTransformer):
        return f"its {type(transformer).__name__} module is not sentence-transformers' Transformer, or has hooks"
    text = transformer.modality_config.get("text", {})
    output = text.get("method_output_name")
    if (getattr(transformer, "transformer_task", None) != task or text.get("method") != "forward"
            or (output if isinstance(output, str) else tuple(output or ())) not in (
                ("logits", ("logits",)) if task == "fill-mask" else ("last_hidden_state", ("last_hidden_state",)))
            or transformer.module_output_name != "token_embeddings" or transformer.backend != "torch"):
        return f"its Transformer module runs {task!r} other than as the task's default (options, outputs, backend)"
    other = sorted(set(features) - set(_TOKEN_INPUTS) - _IGNORED)
    if other or features.get("modality", "text") != "text" or "input_ids" not in features:
        return f"inputs other than text token ids ({', '.join(other) or 'no input_ids'})"
    if getattr(transformer.auto_model.config, "output_hidden_states", False):
        return "output_hidden_states is set on the model's config"
    if torch.is_grad_enabled() and any(p.requires_grad for p in transformer.parameters()) or transformer.training:
        return "gradients are required or the model trains (the fused heads are forward-only)"
    return None


def _inputs(features: dict) -> tuple:
    return tuple(features.get(name) for name in _TOKEN_INPUTS)


# --- SPLADE --------------------------------------------------------------------------------------------------------


def _splade(modules: list[nn.Module], features: dict) -> dict | str:
    """[Transformer (fill-mask), SpladePooling] fused on ``features``: the features, or why not."""
    if len(modules) != 2 or type(modules[1]) is not SpladePooling:
        return f"its modules ({', '.join(type(m).__name__ for m in modules)}) are not a Transformer and a SpladePooling"
    if has_hooks(modules[1]):
        return "its SpladePooling has hooks"
    transformer, pooling = modules
    why = _why_not_transformer(transformer, "fill-mask", features)
    if why is None and (pooling.pooling_strategy not in POOLINGS or pooling.activation_function not in ACTIVATIONS):
        why = f"SpladePooling {pooling.pooling_strategy!r} / {pooling.activation_function!r} has no fused path"
    head = MLMHead.of(transformer.auto_model) if why is None else why
    if isinstance(head, str):
        return head
    embeddings = head.splade(*_inputs(features), pooling.activation_function, pooling.pooling_strategy)
    if pooling.embedding_dimension is None:  # (as SpladePooling's forward sets it)
        pooling.embedding_dimension = embeddings.shape[1]
    announce.note("the fused SPLADE head writes features['sentence_embedding'] but not features['token_embeddings'] "
                  "(the [batch, seq_len, vocab] MLM logits, never materialized)")
    return {**features, "sentence_embedding": embeddings}


class SparseEncoder(st.SparseEncoder):
    """sentence-transformers' SparseEncoder, its [Transformer, SpladePooling] run fused (see the module's notes)."""

    def forward(self, input: dict, **kwargs) -> dict:
        named = list(self._modules.items())
        where = "SparseEncoder"
        if len(named) == 1 and isinstance(named[0][1], Router):  # inference-free SPLADE: the pair on a route
            router = named[0][1]
            route = _route(router, input, kwargs)
            if route is None or not any(isinstance(m, SpladePooling) for m in router.sub_modules[route]):
                return super().forward(input, **kwargs)  # (the query side's lookup: nothing to fuse)
            where = f"SparseEncoder's Router route {route!r}"
            named = list(router.sub_modules[route]._modules.items())
            passed = [k for _, m in named for k in (*kwargs, "task", "modality") if k in m.forward_kwargs]
        else:
            passed = [k for name, m in named for k in kwargs
                      if k in (self.module_kwargs or {}).get(name, []) or k in getattr(m, "forward_kwargs", ())]
        fused = f"keyword arguments {passed} reach its modules" if passed else _splade([m for _, m in named], input)
        if isinstance(fused, dict):
            return fused
        announce.fallback(f"{where}: sentence-transformers' own forward runs ({fused})")
        return super().forward(input, **kwargs)


def _route(router: nn.Module, features: dict, kwargs: dict) -> str | None:
    """The route ``router`` takes for these features and keyword arguments, as its forward resolves it; None where it
    is not sentence-transformers' Router without hooks, or resolves none (its forward then says why)."""
    if type(router) is not Router or has_hooks(router):
        return None
    task = kwargs.get("task") if kwargs.get("task") is not None else features.get("task")
    modality = kwargs.get("modality") if kwargs.get("modality") is not None else features.get("modality")
    try:
        return router._resolve_route(task=task, modality=modality)
    except Exception:  # noqa: BLE001 - its forward raises its own error for it
        return None


# --- multi-vector --------------------------------------------------------------------------------------------------


def _multi_vector(named: list[tuple[str, nn.Module]], features: dict, kwargs: dict, module_kwargs: dict) -> dict | str:
    """[Transformer, Dense?, MultiVectorMask?, Normalize?] fused on ``features``: the features, or why not."""
    modules = [m for _, m in named]
    kinds = [type(m) for m in modules]
    dense = modules[1] if len(modules) > 1 and kinds[1] is Dense else None
    rest = modules[2:] if dense is not None else modules[1:]
    mask_module = rest[0] if rest and isinstance(rest[0], MultiVectorMask) else None
    rest = rest[1:] if mask_module is not None else rest
    normalize = rest[0] if rest and kinds[-1] is Normalize else None
    if len(rest) != (normalize is not None) or not modules:
        return (f"its modules ({', '.join(k.__name__ for k in kinds)}) are not Transformer, Dense, MultiVectorMask, "
                "Normalize")
    for module in (dense, normalize):
        if module is not None and (has_hooks(module) or module.module_input_name != "token_embeddings"
                                   or module.module_output_name != "token_embeddings"):
            return f"its {type(module).__name__} has hooks or reads or writes other features than token_embeddings"
    passed = [k for name, m in named for k in kwargs
              if (k in module_kwargs.get(name, []) or k in getattr(m, "forward_kwargs", ())) and m is not mask_module]
    if passed:
        return f"keyword arguments {passed} reach its modules"
    transformer = modules[0]
    why = _why_not_transformer(transformer, "feature-extraction", features)
    encoder = transformer.auto_model
    if why is None and not isinstance(encoder, modeling.FusedModel):
        why = f"its {type(encoder).__name__} is not accelerated"
    if why is None:
        why = compat.why_transformers(encoder, {})
    if why is not None:
        return why
    input_ids, attention_mask, token_type_ids = _inputs(features)
    scored = attention_mask.bool() if attention_mask is not None else torch.ones_like(input_ids, dtype=torch.bool)
    if mask_module is not None:  # (called: whatever its settings, on the [B, S] features it expects)
        names = ("input_ids", "attention_mask", "query_expansion_positions")
        task = {k: v for k, v in kwargs.items() if k in mask_module.forward_kwargs}
        scored = mask_module({k: features[k] for k in names if k in features}, **task)["attention_mask"].bool()
    vectors, _ = multi_vector.token_vectors(encoder, input_ids, attention_mask, token_type_ids, scored,
                                            None if dense is None else _projection(dense), normalize is not None)
    announce.note("the fused multi-vector heads leave features['token_embeddings'] zero at positions that are not "
                  "scored (encode reads the scored ones only)")
    return {**features, "token_embeddings": multi_vector.scatter(vectors, scored),
            "attention_mask": scored if mask_module is not None else attention_mask}


def _projection(dense: Dense):
    """sentence-transformers' Dense on rows: activation(linear(x)) (+ the residual it may add)."""
    def project(x: torch.Tensor) -> torch.Tensor:
        out = dense.activation_function(dense.linear(x))
        if dense.use_residual:
            out = out + (x if dense.in_features == dense.out_features else dense.residual(x))
        return out
    return project


class MultiVectorEncoder(st.MultiVectorEncoder):
    """sentence-transformers' MultiVectorEncoder, its token heads run fused (see the module's notes)."""

    def forward(self, input: dict, **kwargs) -> dict:
        fused = _multi_vector(list(self._modules.items()), input, kwargs, self.module_kwargs or {})
        if isinstance(fused, dict):
            return fused
        announce.fallback(f"MultiVectorEncoder: sentence-transformers' own forward runs ({fused})")
        return super().forward(input, **kwargs)


_CLASSES = {st.SparseEncoder: SparseEncoder, st.MultiVectorEncoder: MultiVectorEncoder}


def fuse_heads(model: nn.Module) -> list[str]:
    """Give sentence-transformers' SparseEncoder and MultiVectorEncoder models under ``model`` our classes (same
    names, so saved folders name sentence-transformers' own), in place: what was changed, as labels."""
    labels = []
    for name, module in model.named_modules():
        ours = _CLASSES.get(type(module))
        if ours is not None:
            module.__class__ = ours
            labels.append(f"{name or type(model).__name__} ({ours.__name__}'s heads)")
    return labels
