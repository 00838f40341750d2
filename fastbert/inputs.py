"""A forward's inputs, made ready in one straight pass:

    validate   shapes, dtypes, devices, lengths (``validation.check_inputs``: clear errors naming the argument)
    positions  the family's numbering when ``position_ids`` is not given (``FusedModel.position_ids``)
    check      every id inside its table, with the lengths packing needs read back in the same transfer
               (``validation.flat_indices``: the one host sync of a padded GPU forward, none for CPU inputs)
    pack       the real tokens' rows when the mask has padding (``padding.unpadded_layout``), else the dense layout;
               spare rows where oneDNN runs the GEMMs (``padding.bucket_rows``)
    device     host inputs queued to a GPU model without waiting for it

Integer inputs on the host (as tokenizers return them) take one native pass instead, ``token_indices``: positions,
check, pack and spare rows at once. The steps above are its reference, and what runs for inputs on a device, a
floating-point mask, a mask kept dense (``unpad=False``), a CUDA graph's capture (``graph_safe``), without ``_C``,
and while torch.compile traces, a graph exports or a dispatch mode (fake tensors, functorch) runs.

-> (indices [3, N] int64: each row's word, token type and position; the layout: where the rows sit in [B, S]).
``prepare_packed`` does the same for sequences that come back to back without padding (``forward_packed``).
"""

import torch

from . import announce, dispatch, padding, token_indices, validation
from .int8 import choices as int8
from . import plan as plans
from .ops import gemm

# The inputs the fused forward reads, by transformers' argument names.
NAMES = ("input_ids", "attention_mask", "token_type_ids", "position_ids", "inputs_embeds")

# What a range error calls the positions ``prepare_packed`` numbers.
_PACKED_POSITIONS = "positions (numbered within each sequence)"


def prepare(model, inputs: dict, graph_safe: bool = False, unpad: bool | None = None, first_token_read: bool = True,
            ) -> tuple[torch.Tensor, padding.TokenLayout]:
    """``inputs`` (``NAMES``, None where not given) of ``model`` (a ``FusedModel``) -> (indices [3, N], layout), on
    the model's device. graph_safe: read no device data (no range check, no packing), as a CUDA graph capture
    requires. unpad: pack the real tokens if the mask has padding (default ``model.unpad``). first_token_read: whether
    what reads position 0 (the pooler, a head) reads this forward's output (a left-padded batch is then said once).

    The integer inputs may be on the model's device or, all of them, on the CPU (as tokenizers return them): the
    checks, lengths and layout are then computed on the host and queued to the device without waiting for it."""
    mask = inputs["attention_mask"]
    batch, seq_len, token_type_ids = _checked(model, inputs)
    static = graph_safe or _traced()  # (a graph of static shapes: nothing sized from the data)
    packs = not static and _packs(batch, seq_len, mask, model.unpad if unpad is None else unpad)
    if not static and (packs or mask is None) and _native(inputs["input_ids"], mask, token_type_ids,
                                                          inputs["position_ids"]):
        indices, layout, spans, first_is_real = token_indices.padded(
            model, inputs["input_ids"], mask, token_type_ids, inputs["position_ids"], lambda n: _rows(model, n))
        if validation.input_checks_enabled():
            validation.check_spans(spans, limits(model), "position_ids" if inputs["position_ids"] is not None
                                   else model.positions_name())
    else:
        ids, positions_name = _token_ids(model, inputs, token_type_ids, batch, seq_len)  # [B, S] each
        read_back = _read_back(model, mask) if packs else None
        indices, host = validation.flat_indices(*ids, limits(model), positions_name, read_back, graph_safe)
        if packs:
            layout = padding.unpadded_layout(mask, read_back[:batch], host[:batch])
            first_is_real = all(host[batch:])
        else:
            layout, first_is_real = padding.dense_layout(batch, seq_len, mask), True
        if layout.packed:
            indices = indices.index_select(1, layout.indices)  # [3, N]
        indices, layout = _bucketed(model, indices, layout)
    if packs and first_token_read and not first_is_real:
        _note_first_token(model, layout)
    return _to_device(model, indices, layout)


def prepare_packed(model, input_ids: torch.Tensor, seqlens: tuple[int, ...],
                   token_type_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, padding.TokenLayout]:
    """Sequences back to back: input_ids [N] (sequence b the next ``seqlens[b]`` ids), token_type_ids [N] or None
    (zeros) -> (indices [3, N], the packed layout), positions numbered per sequence
    (``FusedModel.packed_position_ids``). A family without token types ignores them, as transformers does."""
    for name, value in (("input_ids", input_ids), ("token_type_ids", token_type_ids)):
        if value is not None and (value.dim() != 1 or value.dtype not in (torch.int64, torch.int32)):
            raise ValueError(f"{name} must be a 1-D int64 tensor of token ids, got {tuple(value.shape)} "
                             f"{value.dtype}")
    if token_type_ids is not None and token_type_ids.shape != input_ids.shape:
        raise ValueError(f"token_type_ids must have one type per id: {token_type_ids.shape[0]} types for "
                         f"{input_ids.shape[0]} ids")
    if not seqlens or min(seqlens) < 1 or sum(seqlens) != input_ids.shape[0]:
        raise ValueError(f"seqlens must be >= 1 each and add up to the {input_ids.shape[0]} ids, got "
                         f"{list(seqlens)[:8]}{'...' if len(seqlens) > 8 else ''}")
    if _native(input_ids, token_type_ids):
        types = token_type_ids if model.embeddings.table("token_type") is not None else None
        indices, layout, spans = token_indices.back_to_back(model, input_ids, seqlens, types,
                                                            lambda n: _rows(model, n))
        if validation.input_checks_enabled():
            validation.check_spans(spans, limits(model), _PACKED_POSITIONS)
        return _to_device(model, indices, layout)
    ids = input_ids.long().cpu()
    types = torch.zeros_like(ids) if token_type_ids is None or model.embeddings.table("token_type") is None \
        else token_type_ids.long().cpu()
    lengths = torch.tensor(seqlens)
    starts = torch.repeat_interleave(torch.cumsum(lengths, 0) - lengths, lengths)  # [N]: its sequence's first row
    positions = model.packed_position_ids(ids, starts)
    indices, _ = validation.flat_indices(ids[None], types[None], positions[None], limits(model), _PACKED_POSITIONS)
    return _to_device(model, *_bucketed(model, indices, padding.packed_layout(seqlens, torch.device("cpu"))))


def limits(model) -> list[int]:
    """The sizes of the word, token-type and position tables the ids index (a family without token types: 1;
    rotary positions index no table: ``validation.UNBOUNDED``)."""
    embeddings = model.embeddings
    token_types, positions = embeddings.table("token_type"), embeddings.table("position")
    return [embeddings.table("word").weight.shape[0], 1 if token_types is None else token_types.weight.shape[0],
            validation.UNBOUNDED if positions is None else positions.weight.shape[0]]


def _checked(model, inputs: dict) -> tuple[int, int, torch.Tensor | None]:
    """Checks the inputs' metadata (clear errors before any kernel runs) -> (batch, seq_len, the token types the
    family reads: None for one without, DistilBERT, which ignores them as transformers does, e.g. a pair
    tokenizer's)."""
    token_type_ids = inputs["token_type_ids"] if model.embeddings.table("token_type") is not None else None
    input_ids, position_ids = inputs["input_ids"], inputs["position_ids"]
    batch, seq_len = validation.check_inputs(
        model.embeddings.table("word").weight, input_ids, inputs["attention_mask"], token_type_ids, position_ids,
        inputs["inputs_embeds"], None if position_ids is not None else model.max_seq_len(input_ids))
    return batch, seq_len, token_type_ids


def _native(*integer_inputs: torch.Tensor | None) -> bool:
    """Whether ``token_indices`` prepares these inputs: the ids given, all on the host, and no dispatch mode (fake
    tensors, functorch) runs the forward, whose tensors may have no memory to read."""
    return integer_inputs[0] is not None and token_indices.takes(*integer_inputs) and plans.plannable()


def _traced() -> bool:
    """Whether torch.compile traces or a graph exports: the dense layout and the registered range check then run
    (packing and the native pass size tensors from the data, which a static graph cannot do)."""
    return torch.compiler.is_compiling() or dispatch.exporting()


def _token_ids(model, inputs: dict, token_type_ids: torch.Tensor | None, batch: int, seq_len: int,
               ) -> tuple[tuple[torch.Tensor, ...], str]:
    """The checked inputs -> ((word, token type, position ids, [B, S] each, on the device of the integer inputs),
    what a range error calls the positions)."""
    input_ids, position_ids = inputs["input_ids"], inputs["position_ids"]
    word = model.embeddings.table("word").weight
    device = next((t.device for t in (input_ids, inputs["attention_mask"], token_type_ids, position_ids)
                   if t is not None), word.device)
    if token_type_ids is None:
        token_type_ids = torch.zeros(batch, seq_len, dtype=torch.long, device=device)
    positions_name = "position_ids"
    if position_ids is None:
        position_ids, positions_name = model.position_ids(input_ids, batch, seq_len, device)
    if input_ids is None:
        input_ids = torch.zeros_like(token_type_ids)
    return (input_ids, token_type_ids, position_ids.expand(batch, seq_len)), positions_name


def _packs(batch: int, seq_len: int, attention_mask: torch.Tensor | None, unpad: bool) -> bool:
    """Whether to pack the real tokens (when the mask turns out to have padding; dense otherwise)."""
    return not (attention_mask is None or not unpad or batch * seq_len == 0)


def _read_back(model, mask: torch.Tensor) -> torch.Tensor:
    """What packing needs on the host, read back with the range check: [B] sequence lengths, then, when the model
    reads position 0 (``first_token_reader``), [B] whether position 0 is a real token."""
    lengths = padding.sequence_lengths(mask)
    if model.first_token_reader() is None:
        return lengths
    return torch.cat([lengths, mask[:, 0].to(lengths.dtype)])


def _note_first_token(model, layout: padding.TokenLayout) -> None:
    """Say once that a left-padded batch feeds zeros to what reads position 0 (transformers feeds it a value computed
    from the padding token there)."""
    if layout.packed and model.first_token_reader() is not None:
        announce.note(
            f"{type(model).__name__}: {model.first_token_reader()} reads position 0, and rows of this batch have "
            "padding there (left padding). fastbert runs padding-free, so the hidden state there is zeros, where "
            "transformers computes a value from the padding token that depends on its attention implementation. Pad "
            "on the right (tokenizer.padding_side = 'right'), or set unpad=False on the encoder "
            "(fastbert.BertModel(..., unpad=False), or model.<encoder>.unpad = False after optimize) to compute "
            "position 0 as transformers does."
        )


def _bucketed(model, indices: torch.Tensor, layout: padding.TokenLayout):
    return padding.with_spare_rows(indices, layout, _rows(model, layout.tokens))


def _rows(model, tokens: int) -> int:
    """The rows to run ``tokens`` tokens as: spare rows up to ``padding.bucket_rows`` where oneDNN runs the GEMMs
    (its fp32 linear) or a model ``fastbert.quantize`` chose runs int8 ones: oneDNN's memory grows with every
    distinct row count it sees, and a replay's programs are per row count (a few buckets serve a server's varied
    batches)."""
    if plans.decided(model, "bucket_rows", _buckets_rows, model):
        return padding.bucket_rows(tokens)
    return tokens


def _buckets_rows(model) -> bool:
    word = model.get_input_embeddings().weight
    if word.device.type != "cpu" or not plans.plannable() or (
            torch.is_grad_enabled() and any(p.requires_grad for p in model.parameters())):
        return False
    return gemm.onednn_runs(word.device, word.dtype) or int8.runs_in(model)


def _to_device(model, indices: torch.Tensor, layout: padding.TokenLayout):
    word = model.get_input_embeddings().weight
    if indices.device == word.device:
        return indices, layout
    # (host inputs, GPU model: a right-padded mask goes as bounds only)
    layout = padding.bounds_only(layout) if word.device.type == "cuda" else layout
    return padding.to_device(indices, word.device), layout.to(word.device)
