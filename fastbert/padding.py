"""Where the real tokens are: the dense [B, S] layout, or the packed (padding-free) one.

Packing finds the real tokens once per forward, so every layer runs on [total_tokens, hidden] and no GEMM, LayerNorm
or GELU touches padding. It needs the sequence lengths on the host (they size the packed tensor and give the CPU
attention its per-sequence lengths): the model reads them back together with the input range check, the one
host<->device sync of a padded forward; none when the mask comes on the CPU (as tokenizers return it), where the
layout is built on the host and queued to the device. Nothing per layer syncs.

Spare rows: on CPU with oneDNN GEMMs the activations carry a few rows past the N real tokens (``bucket_rows``), so
that oneDNN sees a bounded number of distinct row counts; they hold nothing and are dropped by ``unpack``.
"""

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class TokenLayout:
    """How the [N, hidden] activations map onto the [batch, seq_len] input.

    Dense: N = batch * seq_len, row-major; ``key_padding_mask`` [B, S] bool (True = real token) or None, and with
    it ``key_bounds`` [B] int32: one past each row's last real token (attention skips the keys after it).
    Packed: N = total real tokens in mask order; ``indices`` [N] int64 into the flattened [B * S];
    ``cu_seqlens`` [B + 1] int32 (sequence b is rows cu_seqlens[b]:cu_seqlens[b+1]); ``seqlens`` the same on host.
    ``spare_rows``: rows after the N tokens that carry nothing (the activations are [N + spare_rows, hidden]).
    ``columns``: packed layout of a model with windowed attention or relative positions, whose mask has holes (or
    whose holes were not looked for: GPU, compiled): [N] int32, each token's column in [0, S) (those distances are
    between columns, as in transformers; holes in the mask make them differ from distances between packed rows).
    Geometry only: what positions mean to a model (rotary tables, a relative bias) is ``positions.Positions``.
    """

    batch: int
    seq_len: int
    key_padding_mask: torch.Tensor | None = None
    indices: torch.Tensor | None = None
    cu_seqlens: torch.Tensor | None = None
    seqlens: tuple[int, ...] | None = None
    key_bounds: torch.Tensor | None = None
    spare_rows: int = 0
    columns: torch.Tensor | None = None

    @property
    def packed(self) -> bool:
        return self.indices is not None

    @property
    def tokens(self) -> int:
        """N: the rows that are tokens of the input."""
        return self.indices.shape[0] if self.packed else self.batch * self.seq_len

    def key_mask(self) -> torch.Tensor | None:
        """Dense layout: [B, S] bool, True where a key is a real token (from the mask, or from the bounds alone when
        the mask was a right-padded prefix), or None when every key is."""
        if self.key_padding_mask is not None or self.key_bounds is None:
            return self.key_padding_mask
        return torch.arange(self.seq_len, device=self.key_bounds.device)[None, :] < self.key_bounds[:, None]

    @property
    def max_seqlen(self) -> int:
        return max(self.seqlens, default=0) if self.packed else self.seq_len

    def to(self, device: torch.device) -> "TokenLayout":
        """The layout with its tensors on ``device`` (built on the host from a CPU mask, then queued to the GPU)."""
        def move(t):
            return None if t is None else to_device(t, device)

        return replace(self, key_padding_mask=move(self.key_padding_mask), indices=move(self.indices),
                       cu_seqlens=move(self.cu_seqlens), key_bounds=move(self.key_bounds))


def with_columns(layout: TokenLayout) -> TokenLayout:
    """The layout with ``columns`` (packed: each token's column in the padded batch, [N] int32), for attention that
    measures distances between tokens; a dense layout's columns are its indices, none needed. Nor are they when every
    sequence's columns are consecutive (no hole in the mask: distances between offsets are the same), which a CPU
    layout tells once per forward from host memory (a GPU one would have to sync; a compiled graph keeps them)."""
    if not layout.packed:
        return layout
    columns = torch.remainder(layout.indices, layout.seq_len).to(torch.int32)
    if columns.device.type == "cpu" and not torch.compiler.is_compiling() and not _has_holes(layout, columns):
        return layout
    return replace(layout, columns=columns)


def _has_holes(layout: TokenLayout, columns: torch.Tensor) -> bool:
    """Whether some sequence of a packed layout skips columns: its last column minus its first is not its length - 1."""
    starts, ends = layout.cu_seqlens[:-1].long(), layout.cu_seqlens[1:].long()
    real = ends > starts
    span = columns[ends[real] - 1] - columns[starts[real]]
    return bool((span != ends[real] - starts[real] - 1).any())


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor queued to ``device`` without waiting for it. To a GPU through pinned memory of fastbert's own:
    a copy from pageable memory would not overlap, and a caller's pinned tensor (the mask, passed through as it is)
    could be rewritten by the caller while the copy is still queued."""
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device, non_blocking=True)
    staged = t.clone().pin_memory() if t.is_pinned() else t.pin_memory()
    return staged.to(device, non_blocking=True)


def dense_layout(batch: int, seq_len: int, attention_mask: torch.Tensor | None) -> TokenLayout:
    if attention_mask is None:
        return TokenLayout(batch, seq_len)
    keep = attention_mask.bool()
    # One past the last real token of each row, on the device (no sync): every key after it is padding, so the
    # attention's key loop stops there. [B] int32; 0 for a fully padded row.
    positions = torch.arange(1, seq_len + 1, dtype=torch.int32, device=keep.device)
    key_bounds = (keep * positions).amax(dim=1) if seq_len else keep.new_zeros(batch, dtype=torch.int32)
    return TokenLayout(batch, seq_len, key_padding_mask=keep, key_bounds=key_bounds.to(torch.int32))


def bounds_only(layout: TokenLayout) -> TokenLayout:
    """A dense layout whose mask (on the host) is a right-padded prefix, row b real exactly at 0 .. key_bounds[b] - 1,
    as the bounds alone: the attention kernel then skips the keys past each bound and loads no mask at all. Other
    layouts are returned unchanged. One look at host memory; meant for CPU inputs going to a GPU model."""
    keep = layout.key_padding_mask
    if keep is None or keep.device.type != "cpu" or layout.key_bounds is None:
        return layout
    prefix = torch.arange(layout.seq_len)[None, :] < layout.key_bounds[:, None]
    return replace(layout, key_padding_mask=None) if torch.equal(keep, prefix) else layout


def sequence_lengths(attention_mask: torch.Tensor) -> torch.Tensor:
    """attention_mask [B, S] (nonzero = real token) -> [B] int32 real tokens per row, on the mask's device."""
    return attention_mask.bool().sum(dim=1, dtype=torch.int32)


def unpadded_layout(attention_mask: torch.Tensor, seqlens: torch.Tensor | None = None,
                    host_seqlens: tuple[int, ...] | None = None) -> TokenLayout:
    """attention_mask [B, S] (nonzero = real token) -> the packed layout of its real tokens, or the dense layout
    without a mask when there is no padding at all (packing would only cost).

    seqlens / host_seqlens: ``sequence_lengths(attention_mask)`` and its host copy when the caller has them (the
    model reads them back with its range check); otherwise computed here, with one host sync."""
    batch, seq_len = attention_mask.shape
    keep = attention_mask.bool()
    if seqlens is None:
        seqlens = sequence_lengths(attention_mask)  # [B]
    if host_seqlens is None:
        host_seqlens = tuple(seqlens.tolist())  # the sync: sizes the packed tensor
    if all(n == seq_len for n in host_seqlens):
        return dense_layout(batch, seq_len, None)
    # Real tokens in row-major order (row 0's, then row 1's, ...), without a second sync: each real token's packed
    # row is the running count of real tokens before it; padding scatters into one spare slot, dropped after.
    # (torch.nonzero would sync again; nonzero_static has no CUDA kernel before torch 2.6.)
    total, flat = sum(host_seqlens), keep.flatten()
    slot = torch.where(flat, flat.cumsum(0) - 1, total)
    positions = torch.arange(flat.numel(), device=flat.device)
    indices = torch.empty(total + 1, dtype=torch.long, device=flat.device).scatter_(0, slot, positions)[:total]
    cu_seqlens = F.pad(seqlens.cumsum(0, dtype=torch.int32), (1, 0))
    return TokenLayout(batch, seq_len, indices=indices, cu_seqlens=cu_seqlens, seqlens=host_seqlens)


def packed_layout(seqlens: tuple[int, ...], device: torch.device) -> TokenLayout:
    """The packed layout of sequences that come back to back without padding (``seqlens`` >= 1 each, on the host):
    sequence b is rows cu_seqlens[b]:cu_seqlens[b + 1], placed as row b of a [B, max(seqlens)] batch. Built from the
    lengths alone: no padded tensor exists."""
    lengths = torch.tensor(seqlens, dtype=torch.long)
    batch, seq_len, total = len(seqlens), max(seqlens), int(lengths.sum())
    starts = torch.cumsum(lengths, 0) - lengths  # [B]
    offsets = torch.arange(total) - torch.repeat_interleave(starts, lengths)  # [N]: each token's place in its row
    indices = torch.repeat_interleave(torch.arange(batch) * seq_len, lengths) + offsets
    cu_seqlens = F.pad(torch.cumsum(lengths, 0).to(torch.int32), (1, 0))
    layout = TokenLayout(batch, seq_len, indices=indices, cu_seqlens=cu_seqlens, seqlens=tuple(seqlens))
    return layout.to(device) if device.type != "cpu" else layout


def bucket_rows(tokens: int) -> int:
    """How many rows to run ``tokens`` tokens as when oneDNN runs the GEMMs: ``tokens`` rounded up to a multiple of
    16, and above 256 to one of 16 sizes per octave (at most 1/16 more rows, ~3% on average).

    oneDNN builds a GEMM primitive, with a scratchpad of its own, per distinct row count and caches 1024 of them: a
    server whose every padding-free batch has its own token count grows by a set of primitives per new count (seen:
    a 4-layer model from 462 to 1,416 MB RSS over 2,000 varied batches, still growing; transformers 911 MB). With the
    row counts bucketed the same workload stays at ~640 MB."""
    granule = 16 if tokens <= 256 else 2 ** (tokens.bit_length() - 5)
    return -(-tokens // granule) * granule


def with_spare_rows(indices: torch.Tensor, layout: TokenLayout, rows: int) -> tuple[torch.Tensor, TokenLayout]:
    """indices [3, N] and their layout -> the same as ``rows`` rows: the spare ones embed index 0 (valid in every
    table) and are never read back."""
    spare = rows - layout.tokens
    if spare <= 0:
        return indices, layout
    return F.pad(indices, (0, spare)), replace(layout, spare_rows=spare)


def pack(x: torch.Tensor, layout: TokenLayout) -> torch.Tensor:
    """[B, S, ...] -> [N + spare rows, ...] in the layout's token order (spare rows zero)."""
    flat = x.flatten(0, 1)
    flat = flat.index_select(0, layout.indices) if layout.packed else flat
    if layout.spare_rows:
        flat = torch.cat([flat, flat.new_zeros(layout.spare_rows, *flat.shape[1:])])
    return flat


def unpack(x: torch.Tensor, layout: TokenLayout) -> torch.Tensor:
    """[N + spare rows, ...] -> [B, S, ...]; padding positions of a packed layout are zeros."""
    if layout.spare_rows:
        x = x[: layout.tokens]
    if not layout.packed:
        return x.view(layout.batch, layout.seq_len, *x.shape[1:])
    out = x.new_zeros(layout.batch * layout.seq_len, *x.shape[1:])
    out.index_copy_(0, layout.indices, x)
    return out.view(layout.batch, layout.seq_len, *x.shape[1:])


def rows_where(x: torch.Tensor, layout: TokenLayout, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of ``x`` [N + spare rows, ...] (in ``layout``) at the positions ``keep`` [B, S] (bool, positions the
    layout holds) -> (those rows [M, ...] in row-major order: row 0's, then row 1's, ...; cu_seqlens [B + 1] int32,
    row b's kept positions being rows cu_seqlens[b]:cu_seqlens[b + 1]). Where every row is kept (a packed layout's
    real tokens kept), x's rows come back without a copy."""
    cu_seqlens = F.pad(keep.sum(dim=1, dtype=torch.int32).cumsum(0, dtype=torch.int32), (1, 0))
    flat = keep.flatten()
    kept = flat.index_select(0, layout.indices) if layout.packed else flat  # [N]: whether row n is kept
    x = x[: layout.tokens]
    return (x, cu_seqlens) if bool(kept.all()) else (x[kept], cu_seqlens)
