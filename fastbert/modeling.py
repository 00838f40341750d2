"""An encoder model of the BERT family, as in BERT's diagram, on transformers' own modules.

    ids, token types, positions, mask  [B, S]
      -> prepare: validate, number positions, check ranges, pack the real tokens       (inputs.py)
      -> embed:   LayerNorm(word[ids] + position[pos] + token_type[tt])  [N, hidden]  (ops/embedding.py)
      -> encode:  num_hidden_layers x layer                                         (layers.py, ops/)
             qkv = x @ Wqkv + bqkv                  one GEMM              [N, 3 * hidden]
             ctx = attention(q, k, v | layout)      flash attention       [N, hidden]
             x   = LayerNorm(ctx @ Wo + bo + x)     GEMM + fused LN
             h   = act(x @ Wi + bi)                 GEMM + fused bias/act [N, intermediate]
             x   = LayerNorm(h @ Wo2 + bo2 + x)     GEMM + fused LN
      -> unpack to [B, S, hidden]; pool = tanh(dense(x[:, 0])) where the model has a pooler

N is B * S on the dense path and the number of real tokens on the packed one. ``FusedModel`` is the mixin of every
family's model class (``class RobertaModel(FusedModel, hf.RobertaModel)``, in ``fastbert/models/``); a family states
only what differs: how positions are numbered, the tables it derives from them (``positions``), a projection after
the embeddings, the layers' home, the output class. Its modules are transformers' classes with fused mixins: same
``__init__``, children, state_dict keys and ``forward``, so checkpoints load strictly both ways, ``fastbert.optimize``
turns an HF model into ours by setting its class, and whatever fastbert does not accelerate runs transformers' own
code on the same modules (``compat.py`` says when).
"""

import contextlib
import inspect

import torch
from transformers import PreTrainedModel

from . import announce, compat, cpu, dispatch, inputs, layers, padding, run, threads
from . import plan as plans
from .int8 import decisions as int8_decisions
from .positions import NONE, Positions


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
    forward returns) and, where it differs from BERT, ``encoder_name``, ``position_ids``, ``positions``, ``embed``
    and ``encode``.

    ``unpad`` (default True): when ``attention_mask`` has padding, run every layer on the packed real tokens only.
    ``last_hidden_state`` then holds zeros at padding positions (HF returns values there that carry no meaning).
    """

    fused_classes: dict[type, type] = {}
    output_class: type
    encoder_name = "encoder"
    # Children whose state the fused forward reads without calling them (the rotary module's frequencies): they must
    # be transformers' own class without hooks, or transformers' forward runs.
    read_modules: tuple[str, ...] = ()
    _graphs = None  # a graphs.GraphSet once ``fastbert.cuda_graphs`` enabled CUDA graphs on this model
    _read_by_head: str | None = None  # set by ``optimize`` inside a head that reads position 0

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
        model = loaded[0] if isinstance(loaded, tuple) else loaded
        if int8_decisions.has_saved(model):
            int8_decisions.apply_saved(model, [model])
        return loaded

    def __init__(self, config, *args, unpad: bool = True, **kwargs):
        super().__init__(config, *args, **kwargs)
        if compat.why_not_accelerated(config) is None:  # as optimize() does: anything else keeps transformers' modules
            fuse_children(self, self.fused_classes)
        self._configure(unpad)

    def _configure(self, unpad: bool = True):
        """State of ours beyond HF's (``__init__`` and ``optimize`` call it)."""
        self.unpad = unpad
        compat.register_output_capture(self)
        self._config_not_accelerated = compat.why_not_accelerated(self.config)
        if self._config_not_accelerated:
            announce.fallback(
                f"{self._config_not_accelerated} is not accelerated: transformers' {self.hf_class.__name__} runs"
            )

    # --- the forward ---------------------------------------------------------------------------------------------

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
        with _entering(plan):  # (what this forward knows beside its arguments: run.py)
            why = compat.why_transformers(self, kwargs)
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
                return compat.finish(self, out, kwargs)
        given = {name: kwargs.pop(name, None) for name in inputs.NAMES}
        indices, layout = inputs.prepare(self, given, graph_safe or dispatch.capturing())
        embeds = None if given["inputs_embeds"] is None else padding.pack(given["inputs_embeds"], layout)
        keep = compat.selected_states(compat.flag(kwargs, "output_hidden_states", self.config),
                                      self.config.num_hidden_layers)
        return compat.finish(self, self.run_encoder(indices, layout, embeds, keep), kwargs)

    def run_encoder(self, indices: torch.Tensor, layout: padding.TokenLayout,
                    inputs_embeds: torch.Tensor | None = None, keep: set[int] | None = None):
        """embed -> encode -> unpack -> pool: indices [3, N] (``inputs.prepare``), inputs_embeds [N, width] or None
        -> ``output_class`` with [B, S, hidden] outputs; ``keep``: the hidden states to return
        (``compat.selected_states``). Reads no device data."""
        x, layout, states = self.encode_tokens(indices, layout, inputs_embeds, keep)
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

    def encode_tokens(self, indices: torch.Tensor, layout: padding.TokenLayout,
                      inputs_embeds: torch.Tensor | None = None, keep: set[int] | None = None):
        """embed -> encode, nothing unpacked: -> (the last hidden state [N + spare rows, hidden], the layout the
        layers ran on, the kept states as ``encode`` returns them). Reads no device data."""
        # (int8 GEMMs take their activation range over the layout's tokens only: the forward's Run holds it; a CPU
        # forward runs the threads the machine gives it, threads.py)
        with _within_run(layout), _cpu_threads(layout, indices.device):
            x = self.embed(indices, inputs_embeds)  # [N, hidden]
            layout, positions = self.positions(indices, layout)
            x, states = self.encode(x, layout, positions, keep)
        return x, layout, states

    def token_states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                     token_type_ids: torch.Tensor | None = None, *,
                     unpad: bool | None = None) -> tuple[torch.Tensor, padding.TokenLayout]:
        """The last hidden state of a padded batch's tokens, left packed, for inference: input_ids, attention_mask,
        token_type_ids [B, S] (checked and numbered as ``forward`` does them, positions by column as transformers
        numbers them, left padding included) -> (x [N, hidden], the layout: where row n sits in [B, S]). With
        ``unpad`` (default ``self.unpad``) the rows are the real tokens whenever the mask has padding; with
        ``unpad=False`` every position of the batch, each computed as transformers computes it (a padding position
        attends to the real tokens). What heads that read token rows run on (``fastbert/sparse.py``,
        ``fastbert/multi_vector.py``), instead of [B, S, hidden]."""
        why = compat.why_transformers(self, {})
        if why is not None:
            raise ValueError(f"token_states runs fastbert's fused forward only, and {why} needs transformers' (call "
                             "the model instead)")
        word = self.get_input_embeddings().weight
        given = dict.fromkeys(inputs.NAMES)
        given.update(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
        with _entering(plans.for_model(self, word.device, word.dtype, False)):
            indices, layout = inputs.prepare(self, given, dispatch.capturing(), unpad, first_token_read=False)
            x, layout, _ = self.encode_tokens(indices, layout)
        return x[: layout.tokens], layout

    def forward_packed(self, input_ids: torch.Tensor, seqlens, token_type_ids: torch.Tensor | None = None,
                       ) -> torch.Tensor:
        """Sequences back to back, no padding anywhere: input_ids [N] int (sequence b is the next ``seqlens[b]`` ids,
        each at least 1), token_type_ids [N] int or None (zeros: a pair's second text has type 1) -> the last hidden
        state [N, hidden] of each token, for inference. Positions are numbered as the family numbers a sequence of
        its own (``packed_position_ids``). What a server runs: requests' token ids go in as they are, and no
        [batch, seq_len] tensor is ever built (a head reading position 0 reads each sequence's first row)."""
        seqlens = tuple(int(n) for n in seqlens)
        why = compat.why_transformers(self, {})
        if why is not None:
            raise ValueError(f"forward_packed runs fastbert's fused forward only, and {why} needs transformers' "
                             "(call the model on a padded batch instead)")
        word = self.get_input_embeddings().weight
        with _entering(plans.for_model(self, word.device, word.dtype, False)):
            indices, layout = inputs.prepare_packed(self, input_ids, seqlens, token_type_ids)
            x, layout, _ = self.encode_tokens(indices, layout)
        return x[: layout.tokens]

    # --- what a family may change ------------------------------------------------------------------------------

    def max_seq_len(self, input_ids: torch.Tensor | None) -> int | None:
        """The longest input the position table holds when ``position_ids`` is not given (None: data-dependent)."""
        return self.config.max_position_embeddings

    def position_numbering(self) -> tuple[str, int]:
        """How positions are numbered where ``position_ids`` is not given: ("column", 0), a token's column
        0 .. S - 1 (BERT); ("rank", p), p + the token's rank among its row's ids other than p, and p for those
        (RoBERTa, p = padding_idx: numbered from input_ids whatever the mask says; inputs_embeds: p + 1 .. p + S).
        ``position_ids`` and ``packed_position_ids`` are its torch form, ``token_indices`` its native one."""
        return "column", 0

    def position_ids(self, input_ids, batch: int, seq_len: int, device) -> tuple[torch.Tensor, str]:
        """Positions when ``position_ids`` is not given: ([1, S] or [B, S] int64, what an error calls them)."""
        rule, base = self.position_numbering()
        if rule == "column":
            return torch.arange(seq_len, device=device).unsqueeze(0), self.positions_name()
        if input_ids is None:
            return torch.arange(base + 1, seq_len + base + 1, device=device).unsqueeze(0), (
                f"positions {base + 1} .. seq_len + {base} of inputs_embeds")
        real = input_ids.ne(base)
        return (real.cumsum(dim=1) * real + base).long(), self.positions_name()  # [B, S]

    def positions_name(self) -> str:
        """What a range error calls the positions ``position_numbering`` gives input_ids."""
        rule, base = self.position_numbering()
        if rule == "column":
            return "position_ids (0 .. seq_len - 1)"
        return f"positions numbered from input_ids ({base} + rank among non-padding tokens)"

    def packed_position_ids(self, input_ids: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
        """``position_ids`` of packed sequences: input_ids [N], starts [N] (the index of each token's sequence's
        first token) -> [N] int64, as each sequence would get alone."""
        rule, base = self.position_numbering()
        if rule == "column":
            return torch.arange(input_ids.shape[0]) - starts
        real = input_ids.ne(base).long()
        before = real.cumsum(0) - real  # [N]: ids other than base before each, from the first sequence's start
        return (real.cumsum(0) - before[starts]) * real + base

    def first_token_reader(self) -> str | None:
        """What reads position 0 of this encoder's output, if anything: its pooler, or the head ``optimize`` found
        it in (a sequence-classification or multiple-choice head)."""
        if getattr(self, "pooler", None) is not None:
            return "its pooler (pooler_output)"
        return self._read_by_head

    def embed(self, indices: torch.Tensor, inputs_embeds: torch.Tensor | None) -> torch.Tensor:
        """indices [3, N] -> the encoder's input [N, hidden]."""
        return self.embeddings.fused(indices, inputs_embeds)

    def positions(self, indices: torch.Tensor, layout: padding.TokenLayout) -> tuple[padding.TokenLayout,
                                                                                    Positions]:
        """What the layers read by position, built once per forward from indices[2] (the tokens' positions), and the
        layout with what they need of its geometry (columns, for distances between tokens). BERT: nothing."""
        return layout, NONE

    def encode(self, x: torch.Tensor, layout: padding.TokenLayout, positions: Positions, keep: set[int] | None):
        """The layers: x [N, hidden] -> (last [N, hidden], kept states), see ``layers.run_layers``."""
        return getattr(self, self.encoder_name).fused(x, layout, positions, keep)


def _entering(plan):
    """The forward's ``Run`` to enter; none while torch.compile traces (a compiled graph holds no forward state: it
    runs dense, without int8 handoffs or replay, so the ops read nothing of a Run)."""
    return contextlib.nullcontext() if torch.compiler.is_compiling() else run.Run(plan=plan)


@contextlib.contextmanager
def _within_run(layout: padding.TokenLayout):
    """The forward's ``Run`` with its layout set (``run_encoder`` inside a model forward, as always in fastbert), or
    a new one for this call (called directly); nothing while torch.compile traces."""
    current = run.current()
    if torch.compiler.is_compiling():
        yield
    elif current is None:
        with run.Run() as current:
            current.layout = layout
            yield
    else:
        current.layout = layout
        yield


def _cpu_threads(layout: padding.TokenLayout, device: torch.device):
    """The thread count of a CPU forward (``threads.py``); a compiled or exported graph keeps what it runs with."""
    if device.type != "cpu" or torch.compiler.is_compiling() or dispatch.exporting():
        return contextlib.nullcontext()
    return threads.running(threads.for_forward())
