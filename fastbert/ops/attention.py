"""Attention over a token layout: softmax(q k^T / sqrt(d) + bias) v per head, over each sequence's real tokens.

    qkv [rows, 3 * hidden] (the fused QKV GEMM's output) -> [rows, hidden]

Reference: ``kernels/attention.py``'s ``attention_ref`` and ``kernels/attention_varlen.py``'s
``attention_varlen_ref``. Backends, fastest first:

  cpu-int8 ``attention_int8.py``: q k^T and p v in int8 (AVX-512 VNNI), for the layers ``fastbert.quantize``'s guard
           judged with it, on sequences no longer than it judged (``int8_attention``); opt-in, and only without a
           window or position terms. It writes the O projection's u8 too, once that GEMM taught its static scale
           (``handoff``)
  cpu-ext  fastbert._C's C++ kernel (``attention_cpu.py``): float32 or bfloat16 (float32 inside) inference on the CPU
           over packed tokens or a batch without padding, where it measured as fast as SDPA on this CPU in that
           dtype and head dim (``cpu.attention_figures``, ``cpu.ATTENTION_NOISE``)
  triton   the flash-attention kernel (``kernels/attention.py``): padded with a key mask and key bounds, or varlen
           over packed tokens (``kernels/attention_varlen.py``); head dims up to ``MAX_HEAD_DIM``; windows and
           MPNet's relative bias inside the kernel
  torch    SDPA: dense with an additive mask; packed per sequence on the CPU, or scattered into one masked SDPA over
           the padded batch on a GPU. Differentiable: gradients and dropout run here.

DeBERTa's disentangled terms (``ops/disentangled.py``) come as per-head tables that the C++ kernel gathers per score;
torch's SDPA takes them as an [H, L, L] bias built from the same tables.

Distances (a window, the relative bias) are between columns, places in the padded [B, S] batch, as transformers
measures them; a packed layout whose mask has holes carries them in ``layout.columns``.
"""

import dataclasses

import torch
import torch.nn.functional as F

from .. import announce, cpu, dispatch, run
from ..int8 import choices as int8, handoff as int8_handoff
from ..dispatch import Backend, ByDesign, MeasuredChoice
# (fastbert.kernels: the repository's top-level kernels/ folder, installed under that name by setup.py)
from ..kernels import attention as triton_attention
from ..kernels import attention_varlen as triton_varlen
from ..padding import TokenLayout
from . import attention_int8
from .attention_cpu import attention_cpu, attention_cpu_replayed, attention_cpu_unavailable_reasons
from . import disentangled as position_terms
from .disentangled import Disentangled, Tables
from ..plan import decided


# --- torch's SDPA -----------------------------------------------------------------------------------------------------


def _every_key_real(layout: TokenLayout) -> bool:
    """Whether a dense CPU layout has no padding: no mask, or one of ones (unpad=False; a host read, so that it runs
    as without the mask, bit for bit). A compiled graph keeps the masked path rather than branch on the data."""
    mask = layout.key_mask()
    return mask is None or (not torch.compiler.is_compiling() and bool(mask.all()))


def _band(columns: torch.Tensor, window: int) -> torch.Tensor:
    """columns [..., S] -> [..., S, S] bool: True where the query's and the key's columns are within ``window``."""
    return (columns[..., :, None] - columns[..., None, :]).abs() <= window


def _relative(relative_bias: torch.Tensor, columns: torch.Tensor | None, length: int,
              dtype: torch.dtype) -> torch.Tensor:
    """relative_bias [H, 2R + 1] -> [H, L, L] in ``dtype``: the bias of each key's distance to each query, clamped to
    [-R, R]. columns: the L tokens' columns [L], or None for a run of consecutive columns (no hole in the mask)."""
    radius = (relative_bias.shape[1] - 1) // 2
    if columns is None:
        # Toeplitz: entry [i, j] depends on j - i only, so every row is a window onto one line of the 2L - 1
        # distances, line[k] = bias of distance (L - 1) - k; row i, column j is line[i + (L - 1 - j)]. Windows and a
        # flip copy [H, L, L] once, about 10x faster than gathering it by an [L, L] index (per layer, per sequence).
        distance = torch.arange(length - 1, -length, -1, device=relative_bias.device)
        line = relative_bias[:, distance.clamp(-radius, radius) + radius]  # [H, 2L - 1]
        return line.unfold(1, length, 1).flip(2).to(dtype)
    distance = columns[None, :] - columns[:, None]  # [L_q, L_k]: key column - query column
    return relative_bias[:, distance.clamp(-radius, radius) + radius].to(dtype)


def _additive(keep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bool keep mask -> additive float mask with the dtype's most negative finite value where False (as HF does): a
    fully masked row then averages its values instead of producing NaN, and cannot poison other rows."""
    return torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill_(~keep, torch.finfo(dtype).min)


def _attention_sdpa(heads: torch.Tensor, layout: TokenLayout, dropout_p: float, window: int | None = None,
                    relative_bias: torch.Tensor | None = None,
                    disentangled: Tables | None = None) -> torch.Tensor:
    """Dense layout through torch SDPA. heads: [B*S, 3, H, D] -> [B, S, H, D]."""
    q, k, v = heads.view(layout.batch, layout.seq_len, *heads.shape[1:]).permute(2, 0, 3, 1, 4)  # [B, H, S, D] each
    keep, keys = None, layout.key_mask()
    if keys is not None:
        keep = keys[:, None, None, :]  # [B, 1, 1, S]
    mask = None if keep is None else _additive(keep, q.dtype)
    if window is not None:
        # A bool mask: a padding query with no real key in its window gets zeros (SDPA's safe softmax), as with
        # transformers' masks and the Triton kernel; it is what a head reading position 0 of a left-padded row sees
        # with unpad=False.
        band = _band(torch.arange(layout.seq_len, device=q.device), window)  # [S, S]
        mask = band if keep is None else keep & band
    if relative_bias is not None:  # [1, H, S, S] added to the scores; a window, where given, masks after it
        bias = _relative(relative_bias, None, layout.seq_len, q.dtype)[None]
        mask = bias if mask is None else (bias + mask if mask.dtype != torch.bool
                                          else bias.masked_fill(~mask, torch.finfo(q.dtype).min))
    scale = None
    if disentangled is not None:  # [B, H, S, S], scaled as the scores are
        scale, bias = disentangled.scale, position_terms.batch_bias(disentangled, layout.batch, layout.seq_len)
        if bias is not None:
            bias = bias.to(q.dtype) * scale
            mask = bias if mask is None else bias + mask
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale)  # [B, H, S, D]
    if disentangled is not None and keys is not None:
        # DeBERTa masks queries too ([B, 1, S, S] = mask_i mask_j in transformers): a padding query's scores are all
        # the dtype's minimum there, so it averages every value
        out = torch.where(keys[:, None, :, None], out, v.mean(dim=2, keepdim=True))
    return out.transpose(1, 2)


def _attention_varlen_sdpa(heads: torch.Tensor, layout: TokenLayout, dropout_p: float, window: int | None = None,
                           relative_bias: torch.Tensor | None = None,
                           disentangled: Tables | None = None) -> torch.Tensor:
    """Packed layout on CPU through torch: SDPA on each sequence's rows (views, no padding back to the max).

    heads: [T, 3, H, D] -> [T, H, D]. One SDPA per sequence: on CPU each call is large enough that the loop costs
    little, and no FLOP is spent on padding. With a window or a relative bias, each sequence gets a mask from its
    tokens' ``layout.columns`` [T] (or their offsets); DeBERTa's terms come as a bias built from their tables.
    """
    outputs, seqlens = [], list(layout.seqlens)
    positional = window is not None or relative_bias is not None or disentangled is not None
    columns = layout.columns if positional else None
    chunks = columns.split(seqlens) if columns is not None else [None] * len(seqlens)
    start, scale = 0, None if disentangled is None else disentangled.scale
    for chunk, cols in zip(heads.split(seqlens), chunks):
        q, k, v = chunk.permute(1, 2, 0, 3)[:, None]  # [1, H, L, D] each
        length, mask = chunk.shape[0], None
        if disentangled is not None:
            tokens, start = slice(start, start + length), start + length
            offsets = torch.arange(length, device=chunk.device) if cols is None else cols.long()
            mask = position_terms.bias(disentangled, tokens, offsets)  # [H, L, L] or None
            mask = None if mask is None else mask.to(q.dtype)[None] * scale
        if window is not None:  # (every query sees itself: no row is fully masked)
            mask = _band(torch.arange(length, device=chunk.device) if cols is None else cols, window)  # [L, L] bool
        if relative_bias is not None:
            bias = _relative(relative_bias, cols, length, q.dtype)[None]  # [1, H, L, L]
            mask = bias if mask is None else bias.masked_fill(~mask, torch.finfo(q.dtype).min)
        outputs.append(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale)[0]
                       .transpose(0, 1))
    return torch.cat(outputs) if outputs else heads.new_empty(0, *heads.shape[2:])


def _attention_packed_via_padded_sdpa(heads: torch.Tensor, layout: TokenLayout, dropout_p: float,
                                      window: int | None = None, relative_bias: torch.Tensor | None = None,
                                      disentangled: Tables | None = None) -> torch.Tensor:
    """Packed layout through one masked SDPA over the padded batch (GPU training, or a head dim the Triton kernel
    does not take): heads [T, 3, H, D] -> [T, H, D]. Differentiable: the scatter into the padded buffer and the gather
    back are index ops; every other op of the layer still runs on the T real tokens only."""
    batch, seq_len = layout.batch, layout.seq_len
    padded = heads.new_zeros(batch * seq_len, *heads.shape[1:]).index_copy(0, layout.indices, heads)
    real = torch.zeros(batch * seq_len, dtype=torch.bool, device=heads.device).index_fill_(0, layout.indices, True)
    dense = TokenLayout(batch, seq_len, key_padding_mask=real.view(batch, seq_len))
    if disentangled is not None:  # its tables' rows follow the tokens to their places
        def scattered(table):
            return None if table is None else table.new_zeros(table.shape[0], batch * seq_len, table.shape[2]) \
                .index_copy(1, layout.indices, table)

        disentangled = dataclasses.replace(disentangled, c2p=scattered(disentangled.c2p),
                                           p2c=scattered(disentangled.p2c))
    out = _attention_sdpa(padded, dense, dropout_p, window, relative_bias, disentangled)  # [B, S, H, D] (by column)
    return out.reshape(batch * seq_len, *out.shape[2:]).index_select(0, layout.indices)


# --- backends ---------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Call:
    head_dim: int
    reasons: tuple[str, ...]  # why only torch's differentiable SDPA may run it (gradients, dropout, a trainable bias)
    device: torch.device
    dtype: torch.dtype
    quantized: bool = False  # int8 for this layer and these lengths (``int8.choose_attention``, ``attention``)


def _int8_why_not(call: Call) -> list[str]:
    if not call.quantized:
        return [ByDesign("not chosen by fastbert.quantize, or sequences longer than its guard judged")]
    if call.head_dim > attention_int8.MAX_HEAD_DIM:
        return [f"the int8 attention runs in float32: head_dim {call.head_dim} > {attention_int8.MAX_HEAD_DIM}"]
    return [f"the int8 attention runs in float32: {reason}" for reason in
            list(call.reasons) or int8.unavailable_reasons() or attention_int8.unavailable_reasons()]


def _padded_rows(call, heads, layout, *rest) -> str | None:
    """Why the CPU kernels decline a call: a dense batch with padded rows (``unpad=False`` keeps them), which they
    cannot skip; the next backend (torch's SDPA) runs it. The int8 guard counts these (``run.count``)."""
    if not layout.packed and not _every_key_real(layout):
        return ByDesign("a dense batch with padded rows (unpad=False): torch's SDPA runs it")
    return None


def _int8_run(call, heads, layout, dropout_p, window, relative_bias, disentangled, handoff):
    seqlens = _sequences(layout)
    # The O projection reads the result: its u8, written in the same pass, once that GEMM has taught its scale.
    # [rows, H, D] with the layout's spare rows (zero; their u8 the zero point): no copy to add them after, and the
    # tensor the GEMM reads is the one offered even without a target (so that the GEMM can teach it)
    target = None if handoff is None else int8_handoff.target(handoff)
    out, q = attention_int8.attention_int8_cpu_quantizing(heads, seqlens, target, layout.spare_rows)
    out = out.view(out.shape[0], -1)  # [rows, H D]: the very tensor ``attention`` returns and the GEMM reads
    if handoff is not None:
        int8_handoff.offer(handoff, out, None if q is None else q.view(out.shape), None if q is None else target)
    return out


def _triton_why_not(call: Call) -> list[str]:
    if call.reasons:
        return list(call.reasons)
    if call.head_dim > triton_attention.MAX_HEAD_DIM:
        return [f"head_dim {call.head_dim} exceeds the Triton attention kernel's {triton_attention.MAX_HEAD_DIM}"]
    return []


def _triton_run(call, heads, layout, dropout_p, window, relative_bias, disentangled, handoff):
    positional = window is not None or relative_bias is not None or disentangled is not None
    columns = layout.columns if positional else None
    t = None if disentangled is None else position_terms.tables(heads, disentangled)
    tables = () if t is None else (t.c2p, t.p2c, None if t.c2p is None and t.p2c is None else t.index, t.scale)
    if layout.packed:
        return triton_varlen.attention_varlen(heads, layout.cu_seqlens, layout.max_seqlen, window, columns,
                                              relative_bias, *tables)
    padded = heads.view(layout.batch, layout.seq_len, *heads.shape[1:])
    if disentangled is not None:  # (DeBERTa masks padding queries too: the kernel reads the mask, not the bounds)
        return triton_attention.attention(padded, layout.key_mask(), None, window, relative_bias, *tables,
                                          mask_queries=True)
    return triton_attention.attention(padded, layout.key_padding_mask, layout.key_bounds, window, relative_bias)


_measured_choices: dict[tuple, list[str]] = {}  # (dtype, head dim) -> why eager calls found the kernel not to run


def _cpu_why_not(call: Call) -> list[str]:
    """Gradients and the like (``call.reasons``), else this CPU's measured choice at the call's dtype and head dim
    (a head dim of 32 and one of 64 choose differently on some CPUs: ``cpu.ATTENTION_SEQUENCES``). While
    torch.compile traces, what an eager call found (a trace reads no store and takes no lock), or SDPA where no eager
    call has asked yet."""
    if call.reasons:
        return list(call.reasons)
    key = (call.dtype, call.head_dim)
    if torch.compiler.is_compiling():
        return _measured_choices.get(key, [MeasuredChoice("not measured in this process before torch.compile "
                                                          "traced the model")])
    try:
        slower = cpu.attention_slower_reason(attention_cpu, call.dtype, call.head_dim)
    except RuntimeError as error:  # the kernel refusing this CPU: SDPA, never a failed forward
        slower = f"the C++ CPU attention failed here: {error}"
    _measured_choices[key] = reasons = [MeasuredChoice(slower)] if slower else []
    return reasons


def _cpu_run(call, heads, layout, dropout_p, window, relative_bias, disentangled, handoff):
    positional = window is not None or relative_bias is not None or disentangled is not None
    return _cpu_rows(heads, layout, relative_bias, window, layout.columns if positional else None, disentangled)


def _sequences(layout: TokenLayout) -> tuple[int, ...]:
    """Each sequence's rows: the packed layout's lengths, or a dense batch with every token real (``_padded_rows``
    declines the rest) as ``batch`` sequences of ``seq_len`` rows."""
    return layout.seqlens if layout.packed else (layout.seq_len,) * layout.batch


# (Both steps take the layout itself, which a replay passes anew: a program recorded for a number of rows serves
# every packed batch of that many rows, whatever its sequences, ``replay/``.)
def _cpu_rows_replayed(heads: torch.Tensor, layout: TokenLayout, relative_bias, window, columns, disentangled
                       ) -> torch.Tensor:
    """``_cpu_rows`` as a replay calls it (``run.step``)."""
    out = attention_cpu_replayed(heads, _sequences(layout), relative_bias, window, columns, disentangled=disentangled,
                                 spare_rows=layout.spare_rows)
    return out.view(out.shape[0], out.shape[1] * out.shape[2])


@run.step(replayed=_cpu_rows_replayed)
def _cpu_rows(heads: torch.Tensor, layout: TokenLayout, relative_bias, window, columns, disentangled) -> torch.Tensor:
    """The C++ CPU attention on the layout's sequences: heads [T, 3, H, D] -> [T + spare rows, H D], the spare rows
    zero (what the O projection reads). One step of a CPU replay."""
    out = attention_cpu(heads, _sequences(layout), relative_bias, window, columns, disentangled=disentangled,
                        spare_rows=layout.spare_rows)
    return out.view(out.shape[0], out.shape[1] * out.shape[2])


@run.step
def _sdpa_rows(heads: torch.Tensor, layout: TokenLayout) -> torch.Tensor:
    """heads [T, 3, H, D] (the layout's sequences back to back, every token real) -> [T + spare rows, H D]: SDPA on
    each sequence's rows, written where the next GEMM reads them, the spare rows zero. One step of a CPU replay
    (bf16 models: torch's flash SDPA, which keeps its scores in float32)."""
    tokens, _, num_heads, head_dim = heads.shape
    out = heads.new_empty(tokens + layout.spare_rows, num_heads, head_dim)
    out[tokens:] = 0
    start = 0
    for length in _sequences(layout):
        q, k, v = heads[start:start + length].permute(1, 2, 0, 3)[:, None]  # [1, H, L, D] each
        out[start:start + length] = F.scaled_dot_product_attention(q, k, v)[0].transpose(0, 1)
        start += length
    return out.view(out.shape[0], num_heads * head_dim)


def _torch_run(call, heads, layout, dropout_p, window, relative_bias, disentangled, handoff):
    plain = not (dropout_p or window is not None or relative_bias is not None or disentangled is not None)
    if plain and heads.device.type == "cpu" and (layout.packed or _every_key_real(layout)):
        return _sdpa_rows(heads, layout)
    if disentangled is not None:  # (the bias SDPA adds is built from the tables)
        disentangled = position_terms.tables(heads, disentangled)
    if not layout.packed:
        return _attention_sdpa(heads, layout, dropout_p, window, relative_bias, disentangled)
    if heads.device.type == "cuda":  # (a loop of small SDPA calls would be host-bound on a GPU)
        return _attention_packed_via_padded_sdpa(heads, layout, dropout_p, window, relative_bias, disentangled)
    return _attention_varlen_sdpa(heads, layout, dropout_p, window, relative_bias, disentangled)


# (cpu-ext before triton: on a CPU the C++ kernel, and Triton only where asked for, FASTBERT_BACKEND=triton under
# its interpreter; on a GPU cpu-ext never applies)
BACKENDS = dispatch.register("attention", [
    Backend("cpu-int8", run=_int8_run, why_not=_int8_why_not, devices=("cpu",), dtypes=(torch.float32,), opt_in=True,
            declines=_padded_rows, steps=True),
    # (bfloat16 too: float32 inside, as torch's flash SDPA keeps its scores; each dtype and head dim measured against
    # SDPA)
    Backend("cpu-ext", run=_cpu_run, unavailable=lambda device, dtype: attention_cpu_unavailable_reasons(),
            why_not=_cpu_why_not, devices=("cpu",), dtypes=(torch.float32, torch.bfloat16), declines=_padded_rows,
            steps=True,
            per_call=f"where it measured as fast as SDPA (within {cpu.ATTENTION_NOISE:.0%}) at the model's dtype and "
                     "head dim, else torch"),
    Backend("triton", run=_triton_run, unavailable=dispatch.triton_unavailable, why_not=_triton_why_not),
    # (steps where ``_sdpa_rows`` runs it; elsewhere its torch ops fail a replay's capture)
    Backend("torch", run=_torch_run, steps=True),
])
# DeBERTa's attention (the same op with the disentangled tables): torch's path first builds each sequence's [H, L, L]
# bias from the tables, so the C++ kernel, which gathers them per score, runs wherever it can without a measurement
# (docs/benchmarks.md has the figures).
DISENTANGLED_BACKENDS = dispatch.register("disentangled_attention", [
    Backend("cpu-ext", run=_cpu_run, unavailable=lambda device, dtype: attention_cpu_unavailable_reasons(),
            why_not=lambda call: list(call.reasons), devices=("cpu",), dtypes=(torch.float32, torch.bfloat16),
            declines=_padded_rows),
    Backend("triton", run=_triton_run, unavailable=dispatch.triton_unavailable, why_not=_triton_why_not),
    Backend("torch", run=_torch_run),
])


def _decide(qkv: torch.Tensor, relative_bias: torch.Tensor | None, dropout_p: float, head_dim: int,
            disentangled: Disentangled | None, quantized: bool):
    tables = () if disentangled is None else (disentangled.pos_key, disentangled.pos_query)
    reasons = dispatch.needs_reference(qkv, relative_bias, *tables, dropout_p=dropout_p)
    op, backends = ("attention", BACKENDS) if disentangled is None else ("disentangled_attention",
                                                                         DISENTANGLED_BACKENDS)
    return dispatch.decide(op, backends, Call(head_dim, tuple(reasons), qkv.device, qkv.dtype, quantized))


def attention(qkv: torch.Tensor, layout: TokenLayout, num_heads: int, dropout_p: float = 0.0,
              window: int | None = None, relative_bias: torch.Tensor | None = None,
              disentangled: Disentangled | None = None, int8_attention: int | None = None,
              handoff: torch.nn.Module | None = None) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) + bias) v per head, over each sequence's real tokens.

    qkv: [rows, 3 * hidden] -> [rows, hidden] (rows: the layout's tokens, then its spare rows, which come out zero).
    window: None, or the largest distance between a query and a key it attends to (ModernBERT's local layers).
    relative_bias: None or float32 [H, 2R + 1], the bias of the distance j - i clamped to [-R, R] (MPNet's relative
    positions, shared by every layer).
    disentangled: None, or DeBERTa's position terms over the layout's tokens (``ops/disentangled.py``), with the
    scale they and the scores share.
    int8_attention: None, or the longest sequence whose q k^T and p v run in int8 (``attention_int8.py``; the
    layer's choice, made by ``fastbert.quantize``'s guard on sequences up to that long): a batch with a longer one
    runs in float32, said once. Without a window or position terms only.
    handoff: the module whose output this is (the self-attention), for the int8 GEMM that reads it next: where the
    int8 attention runs, it writes that GEMM's u8 in the same pass (``int8/handoff.py``).
    """
    if int8_attention is not None and (window is not None or relative_bias is not None or disentangled is not None):
        raise ValueError("the int8 attention (int8_attention) takes no window, relative bias or position terms")
    quantized = int8_attention is not None and layout.max_seqlen <= int8_attention
    if int8_attention is not None and not quantized:
        announce.note(f"the int8 attention runs sequences of up to {int8_attention} tokens, the longest its guard "
                      "judged; batches with longer ones run it in float32")
    tokens, hidden = layout.tokens, qkv.shape[1] // 3
    head_dim = hidden // num_heads
    # (the same decision for every layer with the same arguments; a trainable bias needs the differentiable path too)
    decision = decided(None, ("attention", qkv.requires_grad, relative_bias is not None and relative_bias.requires_grad,
                              dropout_p, head_dim, None if disentangled is None else disentangled.requires_grad(),
                              quantized),
                       _decide, qkv, relative_bias, dropout_p, head_dim, disentangled, quantized)
    real = qkv[:tokens] if layout.spare_rows else qkv
    out = decision(real.view(tokens, 3, num_heads, head_dim), layout, dropout_p, window, relative_bias, disentangled,
                   handoff)
    if out.shape == (tokens + layout.spare_rows, hidden):
        return out  # (every row already, spare ones zero: the very tensor whose u8 may have been handed on with it)
    out = out.reshape(tokens, hidden)  # (SDPA's math backend, for dropout and float64, returns [B, H, S, D] memory)
    return torch.cat([out, out.new_zeros(layout.spare_rows, hidden)]) if layout.spare_rows else out
