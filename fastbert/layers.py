"""The fused post-LN encoder block, as mixins over transformers' own modules.

Each fastbert module class is ``class Ours(FusedX, hf.TheirX)``: transformers' class provides ``__init__``, the
children (``query``, ``dense``, ``LayerNorm``, ...), the parameter names and its own ``forward``; the mixin adds
``fused(...)``, the padding-free path on token-major [tokens, hidden] activations. fastbert's model forward calls
``fused``; whenever it runs transformers' implementation instead (an option it does not accelerate, a hooked
container), every module still has HF's exact ``forward``.

    embeddings = LayerNorm(word[ids] + position[pos] + token_type[tt])      FusedEmbeddings
    per layer:                                                               FusedLayer
        qkv = x @ Wqkv + bqkv ; ctx = attention(q, k, v | layout)            FusedSelfAttention
        x   = LayerNorm(ctx @ Wo + bo + x)                                   FusedDenseResidualLayerNorm
        h   = act(x @ Wi + bi)                                               FusedIntermediate  } ops/mlp.py: in int8,
        x   = LayerNorm(h @ Wo2 + bo2 + x)                                   FusedDenseResidualLayerNorm } h as u8

These mixins read BERT's module names, which RoBERTa, XLM-RoBERTa, CamemBERT and ELECTRA share; each family writes
out its classes over them (``fastbert/models/bert.py``) and maps transformers' classes to its own with ``fused_map``.
A family with other names (DistilBERT) writes its own small mixins on the same ops (``fastbert/models/distilbert.py``).
Every layer's ``fused`` takes the activations, the layout (where the rows sit) and the positions (what the family
derived from them: rotary tables, a relative bias).
"""

import torch
from torch import nn

from . import derived, padding, plain, plan, replay
from .int8 import choices as int8
from .ops import activation, embedding, gemm, mlp, norm
from .ops.attention import attention
from .positions import Positions


class Fused:
    """Base of the mixins.

    ``bypassed``: the children whose ``forward`` this module's ``fused`` does not call (it calls their ``fused``, or
    reads their weights). They must be fastbert's classes without hooks, or the model runs transformers' forward
    (``bypassed_hook``). Derived caches are dropped when the module is converted (``.to()``, ``.half()``).
    """

    bypassed: tuple[str, ...] = ()
    # Child Linears the fused path calls on rows that are not tokens (DeBERTa's position projections, on the relative
    # embeddings): ``fastbert.quantize`` leaves them float32.
    float32_linears: tuple[str, ...] = ()
    # Whether this module's attention may run in int8 (``ops/attention_int8.py``), where ``fastbert.quantize``'s guard
    # chooses it (``int8.choose_attention``): a self-attention without a window or position terms.
    quantizable_attention: bool = False

    def _apply(self, *args, **kwargs):
        derived.clear(self)
        plan.converted()
        return super()._apply(*args, **kwargs)

    def __setattr__(self, name, value):
        replaced = self.__dict__.get("_modules", {}).get(name)
        super().__setattr__(name, value)
        if replaced is not None and replaced is not value:
            # A child replaced: PEFT wraps a Linear in LoRA, and after merging (a write through ``.data``, which no
            # version counter sees) puts the Linear back. What was derived below this module goes, both times.
            derived.clear(replaced)
            derived.clear(self)


class FusedEmbeddings(Fused):
    # role -> the attribute holding that module in transformers' embeddings class (a family with other names, as
    # ModernBERT's ``tok_embeddings``/``norm``/``drop``, overrides it); a role without an attribute is absent.
    module_names = dict(word="word_embeddings", position="position_embeddings", token_type="token_type_embeddings",
                        norm="LayerNorm", dropout="dropout")

    def table(self, role: str) -> nn.Module | None:
        """The module playing ``role`` (a key of ``module_names``), or None where the family has none."""
        name = self.module_names.get(role)
        return None if name is None else getattr(self, name, None)

    def fused(self, indices: torch.Tensor, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """indices [3, N] (word, token type, position) -> [N, hidden]."""
        return embedding.embedding(indices, self, inputs_embeds)


class FusedSelfAttention(Fused):
    quantizable_attention = True  # (BERT's family: no position terms in the attention)

    def fused(self, x: torch.Tensor, layout: padding.TokenLayout, positions: Positions) -> torch.Tensor:
        """[N, hidden] -> attention context [N, hidden]."""
        qkv = gemm.stacked(x, (self.query, self.key, self.value))  # [N, 3 * hidden]
        p = self.dropout.p if self.training else 0.0
        return attention(qkv, layout, self.num_attention_heads, p, relative_bias=positions.relative_bias,
                         int8_attention=int8.attention_chosen(self), handoff=self)


class FusedDenseResidualLayerNorm(Fused):
    """LayerNorm(dropout(dense(hidden)) + residual): the shape of both BertSelfOutput and BertOutput."""

    def fused(self, hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return norm.dense_residual_layer_norm(hidden, residual, self.dense, self.dropout, self.LayerNorm)


class FusedAttention(Fused):
    bypassed = ("self", "output")

    def fused(self, x: torch.Tensor, layout: padding.TokenLayout, positions: Positions) -> torch.Tensor:
        return self.output.fused(self.self.fused(x, layout, positions), x)


class FusedIntermediate(Fused):
    def fused(self, x: torch.Tensor) -> torch.Tensor:
        return activation.dense_act(x, self.dense, self.intermediate_act_fn)


class FusedLayer(Fused):
    bypassed = ("attention", "intermediate", "output")

    def fused(self, x: torch.Tensor, layout: padding.TokenLayout, positions: Positions) -> torch.Tensor:
        x = self.attention.fused(x, layout, positions)
        return mlp.mlp(x, self.intermediate, self.output)  # (self.output.fused(self.intermediate.fused(x), x))


class FusedEncoder(Fused):
    bypassed = ("layer",)

    def fused(self, x: torch.Tensor, layout: padding.TokenLayout, positions: Positions, keep: set[int] | None):
        return run_layers(self, self.layer, x, layout, positions, keep)


def run_layers(owner: nn.Module, layers, x: torch.Tensor, layout: padding.TokenLayout, positions: Positions,
               keep: set[int] | None):
    """x [N, hidden] through each of ``layers`` (``fused(x, layout, positions)``) -> (last [N, hidden], [B, S,
    hidden] inputs of the layers whose index is in ``keep``). ``owner``: the module holding the layers (the encoder,
    or the model where the layers sit on it directly), whose gradient checkpointing flag applies.

    ``keep``: layer indices (0 = the embeddings) whose input to return, None for none; the list has one entry per
    layer, None where not kept. A kept state is the tensor the layer reads (through a view or a gather), so gradients
    reach it as in HF.
    """
    if keep is None:  # (where this plan has met the shape before, the layers' native steps alone: replay/)
        return replay.encode(owner, layers, x, layout, lambda x: _each_layer(owner, layers, x, layout, positions)), []
    states = []
    for i, layer in enumerate(layers):
        states.append(padding.unpack(x, layout) if i in keep else None)  # [B, S, hidden]
        x = x if states[-1] is None else padding.pack(states[-1], layout)
        x = _checkpointed(owner, layer)(x, layout, positions)
    return x, states


def _each_layer(owner: nn.Module, layers, x: torch.Tensor, layout: padding.TokenLayout, positions: Positions):
    for layer in layers:
        x = _checkpointed(owner, layer)(x, layout, positions)
    return x


def _checkpointed(encoder, layer):
    """``layer.fused``, under gradient checkpointing when HF's ``gradient_checkpointing_enable()`` asked for it
    (transformers 5 flags each layer, 4.x the encoder) and the model trains with gradients."""
    owner = layer if getattr(layer, "gradient_checkpointing", False) else encoder
    if getattr(owner, "gradient_checkpointing", False) and layer.training and torch.is_grad_enabled():
        return lambda x, layout, positions: owner._gradient_checkpointing_func(layer.fused, x, layout, positions)
    return layer.fused


class FusedPredictionHeadTransform(Fused):
    """The MLM head's dense -> act -> LayerNorm with act + LayerNorm fused. Its ``forward`` is the fused one: the
    head calls it with [..., hidden] like HF's. ``activation_name``, ``layer_norm_name``: the attributes holding the
    activation and the LayerNorm modules."""

    activation_name = "transform_act_fn"
    layer_norm_name = "LayerNorm"

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        x = norm.dense_act_layer_norm(x, self.dense, getattr(self, self.activation_name),
                                      getattr(self, self.layer_norm_name))
        return x.view(*hidden_states.shape[:-1], x.shape[-1])


def bypassed_hook(module: nn.Module) -> nn.Module | None:
    """The first module that ``module.fused`` would bypass although it must run: one that is not fastbert's (a
    replacement someone installed), or one with hooks. None when the fused path skips nothing. Reads ``_modules``
    directly: this runs every forward (~0.5 µs per module)."""
    for name in module.bypassed:
        child = module._modules[name]
        children = child._modules.values() if type(child) is nn.ModuleList else (child,)
        for c in children:
            if not isinstance(c, Fused):
                return c
            if (c._forward_hooks or c._forward_pre_hooks or c._backward_hooks or c._backward_pre_hooks
                    or "forward" in c.__dict__) and plain.has_hooks(c):
                return c
            found = bypassed_hook(c)
            if found is not None:
                return found
    return None


def transformers4_variants(hf_module, names: tuple[str, ...], mixin: type, namespace: dict) -> dict[type, type]:
    """transformers 4.x's per-implementation attention classes (``BertSdpaSelfAttention``,
    ``DistilBertFlashAttention2``, ...), which 5.x does not have: for each of ``names`` that ``hf_module`` defines,
    ``class Name(mixin, hf.Name)`` is put in ``namespace`` (the family module's globals) -> ``fused_map`` of them.
    4.x's model forward builds the mask for the implementation's class, so each keeps its own class under the
    mixin."""
    classes = []
    for name in names:
        theirs = getattr(hf_module, name, None)
        if theirs is not None:
            namespace[name] = type(name, (mixin, theirs), {"__module__": namespace["__name__"]})
            classes.append(namespace[name])
    return fused_map(*classes)


def fused_map(*classes: type) -> dict[type, type]:
    """transformers' class -> ours, for fastbert classes written ``class Ours(FusedMixin, hf.Theirs)``: what
    ``optimize`` and ``FusedModel.__init__`` swap in. Exact classes only: a subclass someone wrote may behave
    differently, so it keeps its own forward (and the model runs transformers' implementation)."""
    mapping = {}
    for ours in classes:
        theirs = next(base for base in ours.__mro__[1:] if not issubclass(base, Fused) and base.__module__.startswith(
            "transformers."))
        mapping[theirs] = ours
    return mapping
