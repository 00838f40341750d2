"""An encoder model of the BERT family, as in BERT's diagram, on transformers' own modules.

    ids, token types, positions  [B, S]
      -> validate, then pack the real tokens when the mask has padding           (validation.py, padding.py)
      -> embeddings = LayerNorm(word[ids] + position[pos] + token_type[tt])     [N, hidden]
      -> num_hidden_layers x layer:                                              (layers.py)
             qkv = x @ Wqkv + bqkv                  one GEMM              [N, 3 * hidden]
             ctx = attention(q, k, v | layout)      flash attention       [N, hidden]
             x   = LayerNorm(ctx @ Wo + bo + x)     GEMM + fused LN
             h   = act(x @ Wi + bi)                 GEMM + fused bias/act [N, intermediate]
             x   = LayerNorm(h @ Wo2 + bo2 + x)     GEMM + fused LN
      -> unpack to [B, S, hidden]; pooler = tanh(dense(x[:, 0])) where the model has one

N is B * S on the dense path and the number of real tokens on the packed one. ``FusedModel`` is the mixin of every
family's model class (``class RobertaModel(FusedModel, hf.RobertaModel)``, in ``fastbert/models/``); a family states
only what differs: how positions are numbered, a projection after the embeddings, the output class. Its modules are
transformers' classes with fused mixins: same ``__init__``, children, state_dict keys and ``forward``, so checkpoints
load strictly both ways, ``fastbert.optimize`` turns an HF model into ours by setting its class, and whatever fastbert
does not accelerate runs transformers' own code on the same modules.
"""

import contextlib
import inspect

import torch
import transformers
from transformers import PreTrainedModel

from . import announce, cpu, dispatch, int8, layers, padding, plain, rotary, threads, validation
from . import plan as plans

# transformers 5 drops None from tuple outputs; 4.x keeps the pooler's slot (heads index outputs[2:]).
_TRANSFORMERS_4 = int(transformers.__version__.split(".")[0]) < 5

# The inputs the fused forward reads, by transformers' argument names.
_INPUTS = ("input_ids", "attention_mask", "token_type_ids", "position_ids", "inputs_embeds")
# Arguments the fused forward implements (with HF's meaning) or that HF itself ignores for an encoder.
_HANDLED = {"output_hidden_states", "return_dict", "use_cache", "num_items_in_batch"}
# Arguments that only matter when given (not None); given, transformers' implementation runs.
_NOT_ACCELERATED = ("head_mask", "encoder_hidden_states", "encoder_attention_mask", "past_key_values")


def why_not_accelerated(config) -> str | None:
    """The configuration options whose forward fastbert leaves to transformers, or None."""
    if getattr(config, "is_decoder", False) or getattr(config, "add_cross_attention", False):
        return "config.is_decoder / add_cross_attention (causal masks, KV cache, cross-attention)"
    position_type = getattr(config, "position_embedding_type", "absolute")
    if position_type not in (None, "absolute"):
        return f"config.position_embedding_type={position_type!r} (relative positions)"
    why_rope = rotary.why_not_accelerated(getattr(config, "rope_parameters", None))
    return None if why_rope is None else f"config.rope_parameters {why_rope}"


def fuse_children(model, fused_classes: dict) -> None:
    """Give every module under ``model`` whose class is a key of ``fused_classes`` the fused class (in place)."""
    for module in model.modules():
        ours = fused_classes.get(type(module))
        if ours is not None:
            module.__class__ = ours


class FusedModel(layers.Fused):
    """Mixin making a transformers ``*Model`` of the BERT family fastbert's: same constructor, weights, arguments
    and outputs, with the fused forward.

    A family subclass sets ``fused_classes`` (transformers' module classes -> ours), ``output_class`` (what HF's
    forward returns) and, where it differs from BERT, ``encoder_name``, ``position_ids`` and ``embed``.

    ``unpad`` (default True): when ``attention_mask`` has padding, run every layer on the packed real tokens only.
    ``last_hidden_state`` then holds zeros at padding positions (HF returns values there that carry no meaning).
    What fastbert does not accelerate (decoders, cross-attention, KV cache, relative positions, ``head_mask``,
    ``output_attentions``, hooks on its inner modules) runs transformers' own forward, announced once.
    """

    fused_classes: dict[type, type] = {}
    output_class: type
    encoder_name = "encoder"
    # Children whose state the fused forward reads without calling them (the rotary module's frequencies): they must
    # be transformers' own class without hooks, or transformers' forward runs.
    read_modules: tuple[str, ...] = ()
    _graphs = None  # a graphs.GraphSet once ``fastbert.cuda_graphs`` enabled CUDA graphs on this model

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        hf_classes = [b for b in cls.__mro__ if issubclass(b, PreTrainedModel) and not issubclass(b, FusedModel)]
        if not hf_classes:  # a mixin shared by families (roberta.RobertaShapedModel)
            return
        cls.hf_class = hf_classes[0]
        cls.bypassed = ("embeddings", cls.encoder_name)
        # The names of HF's forward parameters in order, for positional arguments (their order differs between
        # families and between transformers 4.x and 5.x).
        signature = inspect.signature(cls.hf_class.forward)
        cls._hf_parameters = tuple(
            name for name, p in signature.parameters.items()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and name != "self"
        )

        if "forward" in cls.__dict__:  # a subclass with a forward of its own (calling ours through super())
            return

        def forward(self, *args, **kwargs):
            return FusedModel._forward(self, args, kwargs)

        # transformers' tests and tools read the forward's signature (which inputs a model takes): show HF's.
        forward.__signature__ = signature
        forward.__doc__ = f"``{cls.hf_class.__name__}.forward``'s arguments and outputs; " + FusedModel._forward.__doc__
        cls.forward = forward

    @classmethod
    def is_custom_code(cls) -> bool:
        """transformers' answer for its own class: checkpoints load and save through transformers' weight conversions
        for the architecture (GTE's fused ``qkv_proj``, renamed keys), which it skips for classes defined elsewhere."""
        return cls.hf_class.is_custom_code()

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        """transformers' ``from_pretrained``; an int8 decision saved with the checkpoint (``fastbert.quantize``) is
        applied once the weights are loaded."""
        loaded = super().from_pretrained(*args, **kwargs)  # (a tuple with output_loading_info=True)
        from .quantize import apply_saved  # (quantize builds on the model classes)

        apply_saved(loaded[0] if isinstance(loaded, tuple) else loaded)
        return loaded

    def __init__(self, config, *args, unpad: bool = True, **kwargs):
        super().__init__(config, *args, **kwargs)
        if why_not_accelerated(config) is None:  # as optimize() does: anything else keeps transformers' modules
            fuse_children(self, self.fused_classes)
        self._configure(unpad)

    def _configure(self, unpad: bool = True):
        """State of ours beyond HF's (``__init__`` and ``optimize`` call it)."""
        self.unpad = unpad
        _register_output_capture(self)
        self._config_not_accelerated = why_not_accelerated(self.config)
        if self._config_not_accelerated:
            announce.fallback(
                f"{self._config_not_accelerated} is not accelerated: transformers' {self.hf_class.__name__} runs"
            )

    def _forward(self, args: tuple, kwargs: dict, graph_safe: bool = False):
        """input_ids / token_type_ids / attention_mask (nonzero = real token): [B, S]; position_ids: [B, S] or
        [1, S]; inputs_embeds: [B, S, embedding width] instead of input_ids. The integer inputs may all be on the
        CPU with a GPU model (no host sync then).

        graph_safe: never read device data (no range check, no packing: the padded batch runs dense with its mask),
        as a CUDA graph capture requires; also whenever a capture is under way."""
        if len(args) > len(self._hf_parameters):
            raise TypeError(f"forward() takes {len(self._hf_parameters)} positional arguments but {len(args)} "
                            "were given")
        for name, value in zip(self._hf_parameters, args):
            if name in kwargs:
                raise TypeError(f"forward() got multiple values for argument {name!r}")
            kwargs[name] = value
        word = self.get_input_embeddings().weight
        embeds = kwargs.get("inputs_embeds")
        plan = plans.for_model(self, word.device, word.dtype, isinstance(embeds, torch.Tensor) and embeds.requires_grad)
        with plans.active(plan):
            why = self._why_transformers(kwargs)
            if why is None:
                return self._fused_forward(kwargs, graph_safe)
        announce.fallback(f"{why} is not accelerated: transformers' {self.hf_class.__name__}.forward runs for this "
                          "call")
        return super(FusedModel, self).forward(**kwargs)

    def _fused_forward(self, kwargs: dict, graph_safe: bool):
        word = self.get_input_embeddings().weight
        if word.dtype == torch.bfloat16 and word.device.type == "cpu" and not cpu.native_bf16():
            announce.note("this CPU has no native bf16 (no AVX512-BF16 or AMX): bf16 matmuls are emulated, slower "
                          "than float32 here in transformers and fastbert alike; float32 is the faster choice")
        if self._graphs is not None and not graph_safe:
            out = self._graphs.run(self, kwargs)  # None: this call runs without a graph
            if out is not None:
                return self._finish(out, kwargs)
        inputs = {name: kwargs.pop(name, None) for name in _INPUTS}
        indices, layout = self._prepare(inputs, graph_safe or dispatch.capturing())
        inputs_embeds = inputs["inputs_embeds"]
        embeds = None if inputs_embeds is None else padding.pack(inputs_embeds, layout)
        keep = _selected_states(_flag(kwargs, "output_hidden_states", self.config), self.config.num_hidden_layers)
        # (int8 GEMMs take their activation range over the layout's tokens only; a CPU forward runs the threads the
        # machine gives it, threads.py)
        with int8.counting(layout), _cpu_threads(word.device):
            return self._finish(self._encode(indices, layout, embeds, keep), kwargs)

    def forward_packed(self, input_ids: torch.Tensor, seqlens) -> torch.Tensor:
        """Sequences back to back, no padding anywhere: input_ids [N] int (sequence b is the next ``seqlens[b]`` ids,
        each at least 1) -> the last hidden state [N, hidden] of each token, for inference. Token types are 0 and
        positions are numbered as the family numbers a sequence of its own (``packed_position_ids``). What a server
        runs: requests' token ids go in as they are, and no [batch, seq_len] tensor is ever built."""
        seqlens = tuple(int(n) for n in seqlens)
        if input_ids.dim() != 1 or input_ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"input_ids must be a 1-D int64 tensor of token ids, got {tuple(input_ids.shape)} "
                             f"{input_ids.dtype}")
        if not seqlens or min(seqlens) < 1 or sum(seqlens) != input_ids.shape[0]:
            raise ValueError(f"seqlens must be >= 1 each and add up to the {input_ids.shape[0]} ids, got "
                             f"{list(seqlens)[:8]}{'...' if len(seqlens) > 8 else ''}")
        why = self._why_transformers({})
        if why is not None:
            raise ValueError(f"forward_packed runs fastbert's fused forward only, and {why} needs transformers' "
                             "(call the model on a padded batch instead)")
        word = self.get_input_embeddings().weight
        plan = plans.for_model(self, word.device, word.dtype, False)
        with plans.active(plan):
            ids = input_ids.long().cpu()
            lengths = torch.tensor(seqlens)
            starts = torch.repeat_interleave(torch.cumsum(lengths, 0) - lengths, lengths)  # [N]: its sequence's start
            positions = self.packed_position_ids(ids, starts)
            token_types = torch.zeros_like(ids)
            indices, _ = validation.flat_indices(ids[None], token_types[None], positions[None], self._limits(),
                                                 "positions (numbered within each sequence)")
            layout = padding.packed_layout(seqlens, word.device)
            if plans.decided(self, "bucket_rows", self._buckets_rows):
                indices, layout = padding.with_spare_rows(indices, layout, padding.bucket_rows(layout.tokens))
            indices = padding.to_device(indices, word.device)
            with int8.counting(layout), _cpu_threads(word.device):
                x, _ = self.encode(self.embed(indices, None), indices, layout, None)
        return x[: layout.tokens]

    def _encode(self, indices: torch.Tensor, layout: padding.TokenLayout, inputs_embeds: torch.Tensor | None = None,
                keep: set[int] | None = None):
        """indices [3, N] (``_prepare``), inputs_embeds [N, width] or None -> ``output_class`` with [B, S, hidden]
        outputs; ``keep``: the hidden states to return (``_selected_states``). Reads no device data."""
        x = self.embed(indices, inputs_embeds)  # [N, hidden]
        x, states = self.encode(x, indices, layout, keep)
        sequence_output = padding.unpack(x, layout)  # [B, S, hidden]
        hidden_states = None
        if keep is not None:
            hidden_states = (*states, sequence_output if self.config.num_hidden_layers in keep else None)
        outputs = dict(last_hidden_state=sequence_output, hidden_states=hidden_states)
        if "pooler_output" in self.output_class.__dataclass_fields__:  # (field order matters: tuple outputs follow it)
            pooler = getattr(self, "pooler", None)
            first = sequence_output if layout.seq_len else sequence_output.new_zeros(layout.batch, 1, x.shape[-1])
            outputs["pooler_output"] = None if pooler is None else pooler(first)
        return self.output_class(**outputs)

    def _prepare(self, inputs: dict, graph_safe: bool = False, unpad: bool | None = None,
                 ) -> tuple[torch.Tensor, padding.TokenLayout]:
        """The inputs (``_INPUTS`` by name, None where not given) -> (indices [3, N] int64: word, token type and
        position of each token the encoder runs; the layout: where those tokens sit in [B, S]), both on the model's
        device. unpad: pack the real tokens if the mask has padding (default ``self.unpad``).

        The integer inputs may be on the model's device or, all of them, on the CPU (as tokenizers return them): the
        checks, lengths and layout are then computed on the host and queued to the device without waiting for it.
        """
        word = self.get_input_embeddings().weight
        mask = inputs["attention_mask"]
        ids, limits, positions_name = self._token_ids(inputs)  # checked; [B, S] each
        batch, seq_len = ids[0].shape
        packs = not graph_safe and self._packs(batch, seq_len, mask, self.unpad if unpad is None else unpad)
        read_back = self._read_back(mask) if packs else None
        indices, host = validation.flat_indices(*ids, limits, positions_name, read_back, graph_safe)  # [3, B * S]
        if packs:
            layout = padding.unpadded_layout(mask, read_back[:batch], host[:batch])
            self._note_first_token(layout, host[batch:])
        else:
            layout = padding.dense_layout(batch, seq_len, mask)
        if layout.packed:
            indices = indices.index_select(1, layout.indices)  # [3, N]
        if plans.decided(self, "bucket_rows", self._buckets_rows):
            indices, layout = padding.with_spare_rows(indices, layout, padding.bucket_rows(layout.tokens))
        if indices.device != word.device:  # (host inputs, GPU model: a right-padded mask goes as bounds only)
            layout = padding.bounds_only(layout) if word.device.type == "cuda" else layout
            indices, layout = padding.to_device(indices, word.device), layout.to(word.device)
        return indices, layout

    def _buckets_rows(self) -> bool:
        """Whether the token rows are bucketed (``padding.bucket_rows``): in CPU inference where oneDNN runs the
        GEMMs (its fp32 linear, or its int8 one for a model ``fastbert.quantize`` chose), whose memory grows with
        every distinct row count it sees."""
        word = self.get_input_embeddings().weight
        if word.device.type != "cpu" or not plans.plannable() or (
                torch.is_grad_enabled() and any(p.requires_grad for p in self.parameters())):
            return False
        return dispatch.choose("gemm", word) == "onednn" or int8.runs_in(self)

    def _token_ids(self, inputs: dict) -> tuple[tuple[torch.Tensor, ...], list[int], str]:
        """Checks the inputs (clear errors before any kernel runs) -> ((word, token type, position ids, [B, S] each,
        on the device of the integer inputs), the sizes of their tables, what a range error calls the positions)."""
        input_ids, mask, inputs_embeds = inputs["input_ids"], inputs["attention_mask"], inputs["inputs_embeds"]
        embeddings = self.embeddings
        token_types = embeddings.table("token_type")
        # (DistilBERT has none; transformers ignores them too, e.g. a pair tokenizer's)
        token_type_ids = inputs["token_type_ids"] if token_types is not None else None
        word = embeddings.table("word").weight
        position_ids = inputs["position_ids"]
        batch, seq_len = validation.check_inputs(
            word, input_ids, mask, token_type_ids, position_ids, inputs_embeds,
            None if position_ids is not None else self.max_seq_len(input_ids),
        )
        device = next((t.device for t in (input_ids, mask, token_type_ids, position_ids) if t is not None), word.device)
        if token_type_ids is None:
            token_type_ids = torch.zeros(batch, seq_len, dtype=torch.long, device=device)
        positions_name = "position_ids"
        if position_ids is None:
            position_ids, positions_name = self.position_ids(input_ids, batch, seq_len, device)
        if input_ids is None:
            input_ids = torch.zeros_like(token_type_ids)
        return (input_ids, token_type_ids, position_ids.expand(batch, seq_len)), self._limits(), positions_name

    def _limits(self) -> list[int]:
        """The sizes of the word, token-type and position tables the ids index (a family without token types: 1;
        rotary positions index no table: ``validation.UNBOUNDED``)."""
        embeddings = self.embeddings
        token_types, positions = embeddings.table("token_type"), embeddings.table("position")
        return [embeddings.table("word").weight.shape[0], 1 if token_types is None else token_types.weight.shape[0],
                validation.UNBOUNDED if positions is None else positions.weight.shape[0]]

    def _read_back(self, mask: torch.Tensor) -> torch.Tensor:
        """What packing needs on the host, read back with the range check: [B] sequence lengths, then, when the
        model reads position 0 (``_first_token_reader``), [B] whether position 0 is a real token."""
        lengths = padding.sequence_lengths(mask)
        if self._first_token_reader() is None:
            return lengths
        return torch.cat([lengths, mask[:, 0].to(lengths.dtype)])

    def _first_token_reader(self) -> str | None:
        """What reads position 0 of this encoder's output, if anything: its pooler, or the head ``optimize`` found
        it in (a sequence-classification or multiple-choice head)."""
        if getattr(self, "pooler", None) is not None:
            return "its pooler (pooler_output)"
        return self._read_by_head

    _read_by_head: str | None = None  # set by ``optimize`` inside a head that reads position 0

    def _note_first_token(self, layout: padding.TokenLayout, first_is_real: tuple[int, ...]) -> None:
        """Say once that a left-padded batch feeds zeros to what reads position 0 (transformers feeds it a value
        computed from the padding token there)."""
        if layout.packed and not all(first_is_real):
            announce.note(
                f"{type(self).__name__}: {self._first_token_reader()} reads position 0, and rows of this batch have "
                "padding there (left padding). fastbert runs padding-free, so the hidden state there is zeros, where "
                "transformers computes a value from the padding token that depends on its attention implementation. "
                "Pad on the right (tokenizer.padding_side = 'right'), or set unpad=False on the encoder "
                "(fastbert.BertModel(..., unpad=False), or model.<encoder>.unpad = False after optimize) to compute "
                "position 0 as transformers does."
            )

    def _finish(self, out, kwargs: dict):
        """The output as HF returns it: ``out`` (an ``output_class``), or a tuple when ``return_dict=False``."""
        if _flag(kwargs, "return_dict", self.config, default=True):
            return out
        if _TRANSFORMERS_4 and "pooler_output" in self.output_class.__dataclass_fields__:
            hidden_states = out.hidden_states
            return (out.last_hidden_state, out.pooler_output) + ((hidden_states,) if hidden_states is not None else ())
        return out.to_tuple()

    # --- what a family may change ------------------------------------------------------------------------------

    def max_seq_len(self, input_ids: torch.Tensor | None) -> int | None:
        """The longest input the position table holds when ``position_ids`` is not given (None: data-dependent)."""
        return self.config.max_position_embeddings

    def position_ids(self, input_ids, batch: int, seq_len: int, device) -> tuple[torch.Tensor, str]:
        """Positions when ``position_ids`` is not given: ([1, S] or [B, S] int64, what an error calls them)."""
        return torch.arange(seq_len, device=device).unsqueeze(0), "position_ids (0 .. seq_len - 1)"

    def packed_position_ids(self, input_ids: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
        """``position_ids`` of packed sequences: input_ids [N], starts [N] (the index of each token's sequence's
        first token) -> [N] int64, as each sequence would get alone."""
        return torch.arange(input_ids.shape[0]) - starts

    def embed(self, indices: torch.Tensor, inputs_embeds: torch.Tensor | None) -> torch.Tensor:
        """indices [3, N] -> the encoder's input [N, hidden]."""
        return self.embeddings.fused(indices, inputs_embeds)

    def encode(self, x: torch.Tensor, indices: torch.Tensor, layout: padding.TokenLayout, keep: set[int] | None):
        """The layers: x [N, hidden] -> (last [N, hidden], kept states), see ``layers.run_layers``. indices [3, N]:
        the tokens' ids, types and positions (a rotary model builds its tables from the positions)."""
        return getattr(self, self.encoder_name).fused(x, layout, keep)

    # -------------------------------------------------------------------------------------------------------------

    def _why_transformers(self, kwargs) -> str | None:
        """Why this call must run transformers' implementation instead of the fused one, or None."""
        if self._config_not_accelerated:
            return self._config_not_accelerated
        given = [name for name in _NOT_ACCELERATED if kwargs.get(name) is not None]
        if _flag(kwargs, "output_attentions", self.config):
            given.append("output_attentions (the fused attention never forms the probabilities)")
        given += sorted(name for name, v in kwargs.items() if v is not None and name not in _INPUTS
                        and name not in _HANDLED and name not in _NOT_ACCELERATED and name != "output_attentions")
        if given:
            return "the argument " + ", ".join(given)
        attention_mask = kwargs.get("attention_mask")
        if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() in (3, 4):
            return f"a {attention_mask.dim()}-D attention_mask"
        return plans.decided(self, "hooks", self._why_hooks)

    def _why_hooks(self) -> str | None:
        """A hook (global, or on a module the fused forward bypasses) that only transformers' forward would run."""
        if plain.global_hooks():
            return "a global module hook"
        for name in self.read_modules:
            module = getattr(self, name)
            if plain.has_hooks(module) or not type(module).__module__.startswith("transformers."):
                return f"{name} being a {type(module).__name__} with hooks or a class of its own"
        bypassed = layers.bypassed_hook(self)
        if bypassed is not None:
            name = next(n for n, m in self.named_modules() if m is bypassed)
            if isinstance(bypassed, layers.Fused):
                return f"a hook on {name}"
            return f"{name} being a {type(bypassed).__name__}"
        return None

    def _packs(self, batch: int, seq_len: int, attention_mask: torch.Tensor | None, unpad: bool) -> bool:
        """Whether to pack the real tokens (when the mask turns out to have padding; dense otherwise).

        Under torch.compile and export the dense (masked) path runs: packing sizes tensors from the data, which a
        static graph cannot do.
        """
        return not (
            attention_mask is None
            or not unpad
            or torch.compiler.is_compiling()
            or dispatch.exporting()
            or batch * seq_len == 0
        )


def _cpu_threads(device: torch.device):
    """The thread count of a CPU forward (``threads.py``); a compiled or exported graph keeps what it runs with."""
    if device.type != "cpu" or torch.compiler.is_compiling() or dispatch.exporting():
        return contextlib.nullcontext()
    return threads.running(threads.for_forward())


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
