"""BERT, as in the paper's diagram, on transformers' own modules.

    ids, token types, positions  [B, S]
      -> validate, then pack the real tokens when the mask has padding           (validation.py, padding.py)
      -> embeddings = LayerNorm(word[ids] + position[pos] + token_type[tt])     [N, hidden]
      -> num_hidden_layers x BertLayer:                                          (layers.py)
             qkv = x @ Wqkv + bqkv                  one GEMM              [N, 3 * hidden]
             ctx = attention(q, k, v | layout)      flash attention       [N, hidden]
             x   = LayerNorm(ctx @ Wo + bo + x)     GEMM + fused LN
             h   = act(x @ Wi + bi)                 GEMM + fused bias/act [N, intermediate]
             x   = LayerNorm(h @ Wo2 + bo2 + x)     GEMM + fused LN
      -> unpack to [B, S, hidden]; pooler = tanh(dense(x[:, 0]))

N is B * S on the dense path and the number of real tokens on the packed one. Every class here is transformers'
class with a fused mixin (``layers.py``): same ``__init__``, children, state_dict keys and ``forward``. So checkpoints
load strictly both ways, ``fastbert.optimize`` turns an HF module into ours by setting its class, and whatever
fastbert does not accelerate runs transformers' own code on the same modules.
"""

import inspect

import torch
import transformers
from transformers.modeling_outputs import BaseModelOutputWithPoolingAndCrossAttentions
from transformers.models.bert import modeling_bert as hf

from . import announce, dispatch, layers, padding, plain, validation


class BertEmbeddings(layers.FusedEmbeddings, hf.BertEmbeddings):
    pass


class BertSelfAttention(layers.FusedSelfAttention, hf.BertSelfAttention):
    pass


class BertSelfOutput(layers.FusedDenseResidualLayerNorm, hf.BertSelfOutput):
    pass


class BertAttention(layers.FusedAttention, hf.BertAttention):
    pass


class BertIntermediate(layers.FusedIntermediate, hf.BertIntermediate):
    pass


class BertOutput(layers.FusedDenseResidualLayerNorm, hf.BertOutput):
    pass


class BertLayer(layers.FusedLayer, hf.BertLayer):
    pass


class BertEncoder(layers.FusedEncoder, hf.BertEncoder):
    pass


class BertPredictionHeadTransform(layers.FusedPredictionHeadTransform, hf.BertPredictionHeadTransform):
    pass


# transformers' class -> ours, for the modules inside an encoder. Exact classes only: a subclass someone wrote may
# behave differently, so it keeps its own forward (and the encoder runs transformers' implementation).
FUSED_CLASSES = {
    hf.BertEmbeddings: BertEmbeddings,
    hf.BertSelfAttention: BertSelfAttention,
    hf.BertSelfOutput: BertSelfOutput,
    hf.BertAttention: BertAttention,
    hf.BertIntermediate: BertIntermediate,
    hf.BertOutput: BertOutput,
    hf.BertLayer: BertLayer,
    hf.BertEncoder: BertEncoder,
}
# transformers 4.x picks a self-attention subclass per attention implementation, and its BertModel.forward builds the
# mask for that class (sdpa: causality from ``is_causal``), so each keeps its own class under the fused mixin.
for _name in ("BertSdpaSelfAttention", "BertFlashAttention2"):
    if hasattr(hf, _name):
        FUSED_CLASSES[getattr(hf, _name)] = type(
            _name, (layers.FusedSelfAttention, getattr(hf, _name)), {"__module__": __name__}
        )
        globals()[_name] = FUSED_CLASSES[getattr(hf, _name)]  # picklable by name

# transformers 5 drops None from tuple outputs; 4.x keeps the pooler's slot (heads index outputs[2:]).
_TRANSFORMERS_4 = int(transformers.__version__.split(".")[0]) < 5


def why_not_accelerated(config) -> str | None:
    """The configuration options whose forward fastbert leaves to transformers, or None."""
    if getattr(config, "is_decoder", False) or getattr(config, "add_cross_attention", False):
        return "config.is_decoder / add_cross_attention (causal masks, KV cache, cross-attention)"
    position_type = getattr(config, "position_embedding_type", "absolute")
    if position_type not in (None, "absolute"):
        return f"config.position_embedding_type={position_type!r} (relative positions)"
    return None


def fuse_children(model, fused_classes: dict) -> None:
    """Give every module under ``model`` whose class is a key of ``fused_classes`` the fused class (in place)."""
    for module in model.modules():
        ours = fused_classes.get(type(module))
        if ours is not None:
            module.__class__ = ours


# The names of transformers.BertModel.forward's parameters in order, for positional arguments past position_ids
# (their order differs between transformers 4.x and 5.x).
_HF_PARAMETERS = [
    name
    for name, p in inspect.signature(hf.BertModel.forward).parameters.items()
    if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and name != "self"
]
# Arguments the fused forward implements (with HF's meaning) or that HF itself ignores for an encoder.
_HANDLED = {"inputs_embeds", "output_hidden_states", "return_dict", "use_cache", "num_items_in_batch"}
# Arguments that only matter when given (not None); given, transformers' implementation runs.
_NOT_ACCELERATED = ("head_mask", "encoder_hidden_states", "encoder_attention_mask", "past_key_values")


class BertModel(hf.BertModel):
    """Drop-in for ``transformers.BertModel``: same constructor, weights, arguments and outputs.

    ``unpad`` (default True): when ``attention_mask`` has padding, run every layer on the packed real tokens only.
    ``last_hidden_state`` then holds zeros at padding positions (HF returns values there that carry no meaning).
    What fastbert does not accelerate (decoders, cross-attention, KV cache, relative positions, ``head_mask``,
    ``output_attentions``, hooks on its inner modules) runs transformers' own forward, announced once.
    """

    def __init__(self, config, add_pooling_layer: bool = True, unpad: bool = True):
        super().__init__(config, add_pooling_layer=add_pooling_layer)
        if why_not_accelerated(config) is None:  # as optimize() does: anything else keeps transformers' modules
            fuse_children(self, FUSED_CLASSES)
        self._configure(config, unpad)

    def _configure(self, config, unpad: bool = True):
        """State of ours beyond HF's (``__init__`` and ``optimize`` call it)."""
        self.unpad = unpad
        _register_output_capture(self)
        self._config_not_accelerated = why_not_accelerated(config)
        if self._config_not_accelerated:
            announce.fallback(f"{self._config_not_accelerated} is not accelerated: transformers' BertModel runs")

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None, *args, **kwargs):
        """transformers.BertModel.forward's arguments and outputs (``BaseModelOutputWithPoolingAndCrossAttentions``).

        input_ids / token_type_ids / attention_mask (nonzero = real token): [B, S]; position_ids: [B, S] or [1, S];
        inputs_embeds: [B, S, hidden] instead of input_ids.
        """
        kwargs.update(zip(_HF_PARAMETERS[4:], args))
        why = self._why_transformers(attention_mask, kwargs)
        if why:
            announce.fallback(f"{why} is not accelerated: transformers' BertModel.forward runs for this call")
            return super().forward(input_ids, attention_mask, token_type_ids, position_ids, **kwargs)
        config = self.config
        inputs_embeds = kwargs.get("inputs_embeds")
        word = self.embeddings.word_embeddings.weight
        batch, seq_len = validation.check_inputs(
            config, word, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds
        )
        device = word.device
        if token_type_ids is None:
            token_type_ids = torch.zeros(batch, seq_len, dtype=torch.long, device=device)
        if position_ids is None:
            position_ids = torch.arange(seq_len, device=device)[None]
        indices = validation.flat_indices(
            torch.zeros_like(token_type_ids) if input_ids is None else input_ids,
            token_type_ids,
            position_ids.expand(batch, seq_len),
            [config.vocab_size, config.type_vocab_size, config.max_position_embeddings],
        )  # [3, B * S]

        layout = self._layout(batch, seq_len, attention_mask)
        if layout.packed:
            indices = indices.index_select(1, layout.indices)  # [3, N]
        embeds = None if inputs_embeds is None else padding.pack(inputs_embeds, layout)
        keep = _selected_states(_flag(kwargs, "output_hidden_states", config), config.num_hidden_layers)
        x = self.embeddings.fused(indices, embeds)  # [N, hidden]
        x, states = self.encoder.fused(x, layout, keep)
        sequence_output = padding.unpack(x, layout)  # [B, S, hidden]
        pooled_output = None
        if self.pooler is not None:
            first = sequence_output if seq_len else sequence_output.new_zeros(batch, 1, x.shape[-1])
            pooled_output = self.pooler(first)

        hidden_states = None
        if keep is not None:
            hidden_states = (*states, sequence_output if config.num_hidden_layers in keep else None)
        out = BaseModelOutputWithPoolingAndCrossAttentions(
            last_hidden_state=sequence_output, pooler_output=pooled_output, hidden_states=hidden_states
        )
        if _flag(kwargs, "return_dict", config, default=True):
            return out
        if _TRANSFORMERS_4:
            return (sequence_output, pooled_output) + ((hidden_states,) if hidden_states is not None else ())
        return out.to_tuple()

    # transformers' tests and tools read the forward's signature (which inputs a model takes): show HF's.
    forward.__signature__ = inspect.signature(hf.BertModel.forward)

    def _why_transformers(self, attention_mask, kwargs) -> str | None:
        """Why this call must run transformers' implementation instead of the fused one, or None."""
        if self._config_not_accelerated:
            return self._config_not_accelerated
        given = [name for name in _NOT_ACCELERATED if kwargs.get(name) is not None]
        if _flag(kwargs, "output_attentions", self.config):
            given.append("output_attentions (the fused attention never forms the probabilities)")
        given += sorted(name for name, v in kwargs.items() if name not in _HANDLED and name not in _NOT_ACCELERATED
                        and name != "output_attentions" and v is not None)
        if given:
            return "the argument " + ", ".join(given)
        if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() in (3, 4):
            return f"a {attention_mask.dim()}-D attention_mask"
        return _hooked_container(self)

    def _layout(self, batch: int, seq_len: int, attention_mask: torch.Tensor | None) -> padding.TokenLayout:
        """Packed when unpadding is on and the mask has padding; dense otherwise.

        Under torch.compile and export the dense (masked) path runs: packing sizes tensors from the data, which a
        static graph cannot do.
        """
        if (
            attention_mask is None
            or not self.unpad
            or torch.compiler.is_compiling()
            or dispatch.exporting()
            or batch * seq_len == 0
        ):
            return padding.dense_layout(batch, seq_len, attention_mask)
        return padding.unpadded_layout(attention_mask)


def _register_output_capture(model) -> None:
    """transformers 5 records hidden states/attentions for the classes it saw constructed; a model that became ours
    through ``optimize`` was constructed as transformers' class, so ours is registered here."""
    try:
        from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY as registry
    except ImportError:  # transformers 4.x collects outputs in its forward
        return
    if not registry.get(model):
        registry[model] = model._can_record_outputs


def _flag(kwargs: dict, name: str, config, default=False):
    """An output option: the argument when given, else the config's value (as transformers resolves it)."""
    value = kwargs.get(name)
    return getattr(config, name, default) if value is None else value


def _selected_states(output_hidden_states, num_layers: int) -> set[int] | None:
    """Indices into (embeddings, layer 1, ..., layer L) that ``output_hidden_states`` asks for, or None for none.

    True selects all; an int or a list of ints (transformers 5) selects those, negative ones from the end, out of
    range ones dropped. The unselected entries of the returned tuple are None, as in transformers.
    """
    if output_hidden_states is None or output_hidden_states is False:
        return None
    if _TRANSFORMERS_4:  # a flag: any truthy value means all
        return set(range(num_layers + 1)) if output_hidden_states else None
    if output_hidden_states is True:
        return set(range(num_layers + 1))
    selected = [output_hidden_states] if isinstance(output_hidden_states, int) else list(output_hidden_states)
    count = num_layers + 1
    return {i % count for i in selected if -count <= i < count}


def _hooked_container(model) -> str | None:
    """A reason when calling ``fused`` would skip something: a hook on a container module (its ``forward`` would
    not run), a global hook, or a module replaced by one that is not fastbert's. Reads ``_modules`` directly: this
    runs every forward (~0.5 µs per module)."""
    if plain.global_hooks():
        return "a global module hook"
    encoder = model._modules["encoder"]
    checks = [("embeddings", model._modules["embeddings"], layers.FusedEmbeddings), ("encoder", encoder, layers.FusedEncoder)]
    for i, layer in enumerate(encoder._modules["layer"]._modules.values()):
        if not isinstance(layer, layers.FusedLayer):
            checks.append((f"encoder.layer.{i}", layer, layers.FusedLayer))
            break
        attention = layer._modules["attention"]
        checks += [(i, layer, layers.FusedLayer), (i, attention, layers.FusedAttention),
                   (i, attention._modules["self"], layers.FusedSelfAttention),
                   (i, attention._modules["output"], layers.FusedDenseResidualLayerNorm),
                   (i, layer._modules["intermediate"], layers.FusedIntermediate),
                   (i, layer._modules["output"], layers.FusedDenseResidualLayerNorm)]
    for name, module, fused_class in checks:
        if not isinstance(module, fused_class):
            return f"{_name(model, name, module)} being a {type(module).__name__}"
        if (module._forward_hooks or module._forward_pre_hooks or module._backward_hooks or module._backward_pre_hooks
                or "forward" in module.__dict__) and plain.has_hooks(module):
            return f"a hook on {_name(model, name, module)}"
    return None


def _name(model, name, module) -> str:
    """The dotted name of ``module`` (``name`` is a layer index for the modules inside a layer)."""
    if isinstance(name, str):
        return name
    return next(n for n, m in model.named_modules() if m is module)
