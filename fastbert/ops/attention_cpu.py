"""fastbert._C's CPU attention (csrc/attention_cpu.h): padding-free, forward only, with MPNet's relative bias,
ModernBERT's windows and DeBERTa's disentangled terms gathered per score; the ``cpu-ext`` backend of
``attention.py``. Reference: ``kernels/attention_varlen.py``'s ``attention_varlen_ref``.

    qkv [T, 3, H, D] float32 or bfloat16 -> [T, H, D] of its dtype, sequence b the next ``seqlens[b]`` rows

bfloat16 runs float32 inside (scores, softmax, sums; q, k, v converted as they are loaded, the output rounded once),
with its relative bias and DeBERTa's tables in float32.

Launcher, registered op (``fastbert::attention_cpu``, what torch.compile sees) and why it cannot run here; whether it
runs is measured once per machine against SDPA (``cpu.attention_figures``).
"""

import functools

import torch

from .. import _extension, run
# (fastbert.kernels: the repository's top-level kernels/ folder, installed under that name by setup.py)
from ..kernels._common import launch_or_op
from . import disentangled as position_terms
from .disentangled import Disentangled


DTYPES = (torch.float32, torch.bfloat16)


def attention_cpu_unavailable_reasons() -> list[str]:
    """Why ``attention_cpu`` cannot run here ([] when it can): a property of this build and CPU, found once."""
    return list(_attention_cpu_reasons())


@functools.cache
def _attention_cpu_reasons() -> tuple[str, ...]:
    return _extension.cpu_kernel_reasons("attention_cpu", "fastbert's CPU attention kernel",
                                         lambda C: bool(C.attention_cpu_isas()), "an x86-64 CPU with AVX2 and FMA")


def attention_cpu_isas() -> list[str]:
    """The instruction sets the CPU attention can run with here, fastest first ("avx512", "avx2")."""
    return [] if attention_cpu_unavailable_reasons() else list(_extension._C.attention_cpu_isas())


def _check_attention_cpu_args(qkv, seqlens, relative_bias, window, columns, isa="", pos_key=None, pos_query=None,
                              index=None):
    if not qkv.is_cpu or qkv.dtype not in DTYPES or qkv.dim() != 4 or qkv.shape[1] != 3:
        raise ValueError(f"qkv must be a float32 or bfloat16 CPU tensor [tokens, 3, heads, head_dim], got "
                         f"{tuple(qkv.shape)} {qkv.dtype} on {qkv.device}")
    if any(length < 0 for length in seqlens) or sum(seqlens) != qkv.shape[0]:
        raise ValueError(f"seqlens must be >= 0 and add up to qkv's {qkv.shape[0]} tokens, got {list(seqlens)}")
    if relative_bias is not None and (relative_bias.dtype not in (torch.float32, qkv.dtype)
                                      or relative_bias.device.type != "cpu" or relative_bias.dim() != 2
                                      or relative_bias.shape[0] != qkv.shape[2] or relative_bias.shape[1] % 2 == 0):
        raise ValueError(f"relative_bias must be a float32 (or qkv's dtype) CPU tensor [heads, 2 * radius + 1] = "
                         f"[{qkv.shape[2]}, odd], got {tuple(relative_bias.shape)} {relative_bias.dtype} on "
                         f"{relative_bias.device}")
    if isa and isa not in attention_cpu_isas():
        raise ValueError(f"isa must be one of {attention_cpu_isas()} on this CPU, or '' for the fastest, got {isa!r}")
    if window is not None and window < 0:
        raise ValueError(f"window must be None or >= 0, got {window}")
    if columns is not None and (columns.dtype != torch.int32 or columns.shape != (qkv.shape[0],)
                                or columns.device.type != "cpu"):
        raise ValueError(f"columns must be an int32 CPU tensor [{qkv.shape[0]}], got {tuple(columns.shape)} "
                         f"{columns.dtype} on {columns.device}")
    position_terms.check_rows(qkv, seqlens, columns, pos_key, pos_query, index)


def _attention_cpu_launch(qkv, seqlens, relative_bias, window, columns, isa="", pos_key=None, pos_query=None,
                          index=None, scale=None, spare_rows: int = 0) -> torch.Tensor:
    tensors = [None if t is None else t.detach().contiguous()
               for t in (qkv, relative_bias, columns, pos_key, pos_query, index)]
    qkv, relative_bias, columns, pos_key, pos_query, index = tensors
    _check_attention_cpu_args(qkv, seqlens, relative_bias, window, columns, isa, pos_key, pos_query, index)
    # (the kernel reads the bias and DeBERTa's tables in float32)
    relative_bias, pos_key, pos_query = (None if t is None else t.float() for t in (relative_bias, pos_key, pos_query))
    reasons = _attention_cpu_reasons()
    if reasons:
        raise RuntimeError(reasons[0])
    if spare_rows < 0:
        raise ValueError(f"spare_rows must be >= 0, got {spare_rows}")
    return _attention_cpu_kernel(qkv, seqlens, relative_bias, window, columns, isa, pos_key, pos_query, index, scale,
                                 spare_rows)


def _attention_cpu_kernel(qkv, seqlens, relative_bias, window, columns, isa, pos_key, pos_query, index, scale,
                          spare_rows: int) -> torch.Tensor:
    """The kernel on checked arguments: contiguous tensors, the bias and DeBERTa's tables in float32."""
    heads, head_dim = qkv.shape[2], qkv.shape[3]
    out = qkv.new_empty(qkv.shape[0] + spare_rows, heads, head_dim)
    if spare_rows:
        out[qkv.shape[0]:] = 0  # (the packed layout's spare rows are zeros)
    rows = pos_key if pos_key is not None else pos_query
    _extension._C.attention_cpu(out.data_ptr(), qkv.data_ptr(), list(seqlens), heads, head_dim,
                                0 if relative_bias is None else relative_bias.data_ptr(),
                                0 if relative_bias is None else (relative_bias.shape[1] - 1) // 2,
                                -1 if window is None else window, 0 if columns is None else columns.data_ptr(),
                                head_dim ** -0.5 if scale is None else scale, torch.get_num_threads(), isa,
                                0 if pos_key is None else pos_key.data_ptr(),
                                0 if pos_query is None else pos_query.data_ptr(),
                                0 if rows is None else rows.shape[0], 0 if index is None else index.data_ptr(),
                                0 if index is None else (index.shape[0] - 1) // 2, qkv.dtype == torch.bfloat16)
    return out


@torch.library.custom_op("fastbert::attention_cpu", mutates_args=())
def _attention_cpu_op(qkv: torch.Tensor, seqlens: list[int], relative_bias: torch.Tensor | None,
                      window: int | None, columns: torch.Tensor | None, isa: str,
                      pos_key: torch.Tensor | None = None, pos_query: torch.Tensor | None = None,
                      index: torch.Tensor | None = None, scale: float | None = None,
                      spare_rows: int = 0) -> torch.Tensor:
    return _attention_cpu_launch(qkv, seqlens, relative_bias, window, columns, isa, pos_key, pos_query, index, scale,
                                 spare_rows)


@_attention_cpu_op.register_fake
def _(qkv, seqlens, relative_bias, window, columns, isa, pos_key=None, pos_query=None, index=None, scale=None,
      spare_rows=0):
    _check_attention_cpu_args(qkv, seqlens, relative_bias, window, columns, isa)  # (the tables' values: when it runs)
    return qkv.new_empty(qkv.shape[0] + spare_rows, qkv.shape[2], qkv.shape[3])


def attention_cpu_replayed(qkv: torch.Tensor, seqlens, relative_bias: torch.Tensor | None = None,
                           window: int | None = None, columns: torch.Tensor | None = None, isa: str = "",
                           disentangled: Disentangled | None = None, spare_rows: int = 0) -> torch.Tensor:
    """``attention_cpu`` as a replay calls it (``run.step``): qkv as the recorded call's, which passed the checks, on
    a layout's sequences (``padding.TokenLayout``'s lengths, which add up to its tokens); a replay runs eager code on
    plain tensors (``plan.plannable``), where ``launch_or_op`` launches directly. A relative bias, columns or
    DeBERTa's tables are checked as in every call (they may be read from parameters)."""
    if relative_bias is not None or columns is not None or disentangled is not None:
        return attention_cpu(qkv, seqlens, relative_bias, window, columns, isa, disentangled, spare_rows)
    return _attention_cpu_kernel(qkv.contiguous(), seqlens, None, window, None, isa, None, None, None, None,
                                 spare_rows)


@run.step(replayed=attention_cpu_replayed)
def attention_cpu(qkv: torch.Tensor, seqlens, relative_bias: torch.Tensor | None = None, window: int | None = None,
                  columns: torch.Tensor | None = None, isa: str = "",
                  disentangled: Disentangled | None = None, spare_rows: int = 0) -> torch.Tensor:
    """Padding-free attention on the CPU, forward only (csrc/attention_cpu.h; reference:
    ``kernels/attention_varlen.py``'s ``attention_varlen_ref``): qkv [T, 3, H, D] float32 or bfloat16 (float32 inside)
    -> [T, H, D] of its dtype, sequence b the next ``seqlens[b]`` rows. relative_bias: None or [H, 2R + 1] (float32;
    of qkv's dtype for bfloat16) by distance j - i clamped to [-R, R]; window:
    None or the largest distance a query sees; columns: None (distances between offsets) or int32 [T], the tokens'
    columns (a mask with holes); isa: one of ``attention_cpu_isas()``, "" for the fastest (tests run each);
    disentangled: DeBERTa's projected relative rows, their index by distance and the scale (``ops/disentangled.py``):
    each sequence's and head's dot products with them formed in cache and gathered per score. spare_rows: zero rows
    after the T (the packed layout's), so that the result is the very tensor the next GEMM reads. Raises ValueError
    before the kernel runs when the arguments do not fit. A step of a CPU replay (``run.step``)."""
    d = disentangled
    return launch_or_op(_attention_cpu_launch, _attention_cpu_op, qkv, list(seqlens), relative_bias, window, columns,
                        isa, None if d is None else d.pos_key, None if d is None else d.pos_query,
                        None if d is None else d.index, None if d is None else d.scale, spare_rows)
