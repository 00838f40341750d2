"""A batch's embedding indices from host inputs, range-checked, and where its tokens sit: one native pass.

    reference  ``inputs.prepare`` / ``prepare_packed`` op by op (validation.flat_indices, padding.unpadded_layout,
               packing and spare rows: ~20 torch calls, 0.4-0.7 ms of a 1 x 24-token MiniLM forward's ~8 ms on a
               2-core AMD EPYC (Zen 3), whatever the batch)
    native     ``_C.count_real_tokens`` sizes the packed batch from the mask; ``_C.token_indices`` writes the
               [3, rows] indices (word, token type, position of each real token, then zeros), each token's place in
               [B, S] and cu_seqlens, numbering positions as the family does (``FusedModel.position_numbering``),
               and returns the spans the range check reads (``validation.check_spans``)

For integer inputs on the host (as tokenizers return them), to a model on any device: ``takes`` says when. The
caller checks the inputs' metadata first (``validation.check_inputs``) and queues the result to the model's device.
"""

import functools

import torch

from . import padding
from ._extension import _C, cpu_kernel_reasons

# dtype codes of the integer inputs _C reads (token_indices.h)
CODES = {torch.int64: 0, torch.int32: 1, torch.bool: 2, torch.uint8: 2}
NUMBERINGS = {"column": 0, "rank": 1}


@functools.cache
def unavailable_reasons() -> tuple[str, ...]:
    """Why the native pass cannot run here (() when it can): no ``_C``, or one built before it."""
    return cpu_kernel_reasons("token_indices", "the native input preparation", lambda c: True, "", threaded=False)


def takes(*integer_inputs: torch.Tensor | None) -> bool:
    """Whether the native pass reads these inputs: each absent or a host tensor of a dtype in ``CODES`` (the
    caller's checks hold ids, token types and positions to int64 or int32), and ``_C`` has it."""
    return not unavailable_reasons() and all(
        t is None or (t.device.type == "cpu" and t.dtype in CODES) for t in integer_inputs)


def padded(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, token_type_ids: torch.Tensor | None,
           position_ids: torch.Tensor | None, rows_for) -> tuple[torch.Tensor, padding.TokenLayout, list[int], bool]:
    """input_ids, attention_mask, token_type_ids [B, S] and position_ids [1 or B, S] (each but the ids None where not
    given; checked by ``validation.check_inputs``) -> (indices [3, rows] int64, the layout: packed when the mask has
    padding, else dense without a mask; the spans [6]; whether every row's position 0 is a real token).
    rows_for(N) -> the rows to run N real tokens as (N, or more: spare rows)."""
    batch, seq_len = input_ids.shape
    tokens, first_real, seqlens = batch * seq_len, True, None
    if attention_mask is not None:
        attention_mask = attention_mask.contiguous()
        lengths = torch.empty(batch, dtype=torch.int32)
        tokens, first_real = _C.count_real_tokens(attention_mask.data_ptr(), CODES[attention_mask.dtype], batch,
                                                  seq_len, lengths.data_ptr())
        seqlens = tuple(lengths.tolist()) if tokens < batch * seq_len else None
    indices, layout, spans = _run(model, input_ids, token_type_ids, position_ids, None if seqlens is None else
                                  attention_mask, batch, seq_len, seqlens, (), tokens, rows_for(tokens))
    return indices, layout, spans, first_real


def back_to_back(model, input_ids: torch.Tensor, seqlens: tuple[int, ...], token_type_ids: torch.Tensor | None,
                 rows_for) -> tuple[torch.Tensor, padding.TokenLayout, list[int]]:
    """Sequences back to back (``inputs.prepare_packed``'s checked input_ids [N], seqlens, token_type_ids [N] or
    None) -> (indices [3, rows] int64, their packed layout, the spans [6]); positions numbered per sequence."""
    tokens = input_ids.shape[0]
    seqlens = tuple(seqlens)
    return _run(model, input_ids, token_type_ids, None, None, len(seqlens), max(seqlens), seqlens, seqlens, tokens,
                rows_for(tokens))


def _run(model, ids, types, positions, mask, batch: int, seq_len: int, seqlens: tuple[int, ...] | None,
         sequences: tuple[int, ...], tokens: int, rows: int):
    """-> (indices [3, rows], the layout: packed where ``seqlens`` are given, else dense; the spans). sequences:
    the sequences' lengths where ids [tokens] come back to back, () for ids [B, S]."""
    rule, base = model.position_numbering()
    ids = ids.contiguous()
    types = None if types is None else types.contiguous()
    positions = None if positions is None else positions.contiguous()
    indices = torch.empty(3, rows, dtype=torch.long)
    layout_indices = torch.empty(tokens, dtype=torch.long) if seqlens is not None else None
    cu_seqlens = torch.empty(batch + 1, dtype=torch.int32) if seqlens is not None else None
    spans = _C.token_indices(
        ids.data_ptr(), CODES[ids.dtype], *_pointer(types), *_pointer(positions),
        1 if positions is None else positions.shape[0], *_pointer(mask), sequences, batch, seq_len,
        NUMBERINGS[rule], base, tokens, indices.data_ptr(), rows, _address(layout_indices), _address(cu_seqlens))
    layout = padding.TokenLayout(batch, seq_len, indices=layout_indices, cu_seqlens=cu_seqlens, seqlens=seqlens,
                                 spare_rows=rows - tokens)
    return indices, layout, spans


def _pointer(t: torch.Tensor | None) -> tuple[int, int]:
    """(address, dtype code) of an integer input; (0, 0) where it was not given."""
    return (0, 0) if t is None else (t.data_ptr(), CODES[t.dtype])


def _address(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()
