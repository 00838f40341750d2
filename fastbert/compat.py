"""transformers' compatibility rules: when a forward runs transformers' own implementation instead of the fused one,
and the outputs in the shapes transformers returns them.

transformers' own forward runs (announced once, ``announce.fallback``) for:
- a configuration fastbert does not accelerate (``why_not_accelerated``): decoders and cross-attention, relative
  position embeddings, rotary frequencies that follow the input's length, DeBERTa's talking heads;
- an argument it does not accelerate (``head_mask``, ``output_attentions``, the decoder's, an unknown one), or a 3-D
  or 4-D attention mask;
- a hook the fused forward would skip: a global module hook, one on a module it bypasses (a layer, an attention
  block), or a module it reads without calling (a rotary model's ``rotary_emb``) that is not transformers' own.
Everything else transformers' forward accepts is accepted with its meaning (``output_hidden_states`` as a flag or,
in transformers 5, indices; ``return_dict``; ``use_cache`` and ``num_items_in_batch``, which an encoder ignores).
"""

import torch
import transformers

from . import layers, plain
from . import plan as plans
from .inputs import NAMES

# transformers 5 drops None from tuple outputs; 4.x keeps the pooler's slot (heads index outputs[2:]).
TRANSFORMERS_4 = int(transformers.__version__.split(".")[0]) < 5
# Arguments the fused forward implements (with HF's meaning) or that HF itself ignores for an encoder.
_HANDLED = {"output_hidden_states", "return_dict", "use_cache", "num_items_in_batch"}
# Arguments that only matter when given (not None); given, transformers' implementation runs.
_NOT_ACCELERATED = ("head_mask", "encoder_hidden_states", "encoder_attention_mask", "past_key_values")
# transformers' RoPE types whose frequencies change with the input's length (``dynamic_rope_update``).
_LENGTH_DEPENDENT = ("dynamic", "longrope")


def why_not_accelerated(config) -> str | None:
    """The configuration options whose forward fastbert leaves to transformers, or None."""
    if getattr(config, "is_decoder", False) or getattr(config, "add_cross_attention", False):
        return "config.is_decoder / add_cross_attention (causal masks, KV cache, cross-attention)"
    if getattr(config, "talking_head", False):
        return "config.talking_head (DeBERTa's mixing of the heads' scores)"
    position_type = getattr(config, "position_embedding_type", "absolute")
    if position_type not in (None, "absolute"):
        return f"config.position_embedding_type={position_type!r} (relative positions)"
    rope = getattr(config, "rope_parameters", None)
    if isinstance(rope, dict):  # (one dict, or one per attention type)
        for parameters in [v for v in rope.values() if isinstance(v, dict)] or [rope]:
            rope_type = parameters.get("rope_type")
            if rope_type and any(kind in rope_type for kind in _LENGTH_DEPENDENT):
                return (f"config.rope_parameters rope_type {rope_type!r} (frequencies that depend on the sequence "
                        "length)")
    return None


def why_transformers(model, kwargs: dict) -> str | None:
    """Why this call of ``model`` (a ``FusedModel``) must run transformers' implementation, or None."""
    if model._config_not_accelerated:
        return model._config_not_accelerated
    given = [name for name in _NOT_ACCELERATED if kwargs.get(name) is not None]
    if flag(kwargs, "output_attentions", model.config):
        given.append("output_attentions (the fused attention never forms the probabilities)")
    given += sorted(name for name, v in kwargs.items() if v is not None and name not in NAMES and name not in _HANDLED
                    and name not in _NOT_ACCELERATED and name != "output_attentions")
    if given:
        return "the argument " + ", ".join(given)
    attention_mask = kwargs.get("attention_mask")
    if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() in (3, 4):
        return f"a {attention_mask.dim()}-D attention_mask"
    return plans.decided(model, "hooks", _why_hooks, model)


def _why_hooks(model) -> str | None:
    """A hook (global, or on a module the fused forward bypasses) that only transformers' forward would run."""
    if plain.global_hooks():
        return "a global module hook"
    for name in model.read_modules:
        module = getattr(model, name)
        if plain.has_hooks(module) or not type(module).__module__.startswith("transformers."):
            return f"{name} being a {type(module).__name__} with hooks or a class of its own"
    bypassed = layers.bypassed_hook(model)
    if bypassed is not None:
        name = next(n for n, m in model.named_modules() if m is bypassed)
        if isinstance(bypassed, layers.Fused):
            return f"a hook on {name}"
        return f"{name} being a {type(bypassed).__name__}"
    return None


def register_output_capture(model) -> None:
    """transformers 5 records hidden states/attentions for the classes it saw constructed; a model that became ours
    through ``optimize`` was constructed as transformers' class, so ours is registered here."""
    try:
        from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY as registry
    except ImportError:  # transformers 4.x collects outputs in its forward
        return
    if not registry.get(model):
        registry[model] = model._can_record_outputs


def flag(kwargs: dict, name: str, config, default=False):
    """An output option: the argument when given, else the config's value (as transformers resolves it)."""
    value = kwargs.get(name)
    return getattr(config, name, default) if value is None else value


def selected_states(output_hidden_states, num_layers: int) -> set[int] | None:
    """Indices into (embeddings, layer 1, ..., layer L) that ``output_hidden_states`` asks for, or None for none.

    True selects all; an int or a list of ints (transformers 5) selects those, negative ones from the end, out of
    range ones dropped. The unselected entries of the returned tuple are None, as in transformers.
    """
    if output_hidden_states is None or output_hidden_states is False:
        return None
    if TRANSFORMERS_4:  # a flag: any truthy value means all
        return set(range(num_layers + 1)) if output_hidden_states else None
    if output_hidden_states is True:
        return set(range(num_layers + 1))
    selected = [output_hidden_states] if isinstance(output_hidden_states, int) else list(output_hidden_states)
    count = num_layers + 1
    return {i % count for i in selected if -count <= i < count}


def finish(model, out, kwargs: dict):
    """``out`` (the model's ``output_class``) as transformers returns it: itself, or a tuple with
    ``return_dict=False``."""
    if flag(kwargs, "return_dict", model.config, default=True):
        return out
    if TRANSFORMERS_4 and "pooler_output" in model.output_class.__dataclass_fields__:
        hidden_states = out.hidden_states
        return (out.last_hidden_state, out.pooler_output) + ((hidden_states,) if hidden_states is not None else ())
    return out.to_tuple()
