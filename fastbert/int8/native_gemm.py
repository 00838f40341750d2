"""fastbert._C's int8 CPU GEMM for CPUs without VNNI (csrc/gemm_int8_cpu.h): ``epilogue((x_q - z_x) @ W_q^T * s_x
* s_w + b)`` on a 7-bit weight prepacked once; the backend of ``int8/linear.py`` where its weights have 7 bits.

x_q: [tokens, in] u8 with (s_x, z_x); W_q: [out, in] s8 in [-63, 63] with per-row scales s_w [out] (``pack``:
[ceil(out / 16), ceil(in / 4), 16, 4], the column sums of W_q and s_w, a derived cache); b: [out] or None; residual:
[tokens, out] -> [tokens, out] float32, or u8 quantized with ``output``'s (scale, zero point).

Why a GEMM of our own: on an AVX2 CPU without VNNI, oneDNN's int8 linear (``torch.ops.onednn.qlinear_pointwise``)
costs ~56 us a call whatever its size, and at bert's sizes runs barely faster than the float32 GEMM (on an AMD EPYC
Zen 3, 2 threads: 24 x 384 x 384 154 us against F.linear's 86; 128 x 768 x 768 868 us). This kernel's
vpmaddubsw/vpmaddwd tiles do the same sums exactly (7-bit weights: no int16 saturation) in 39 us and ~580 us there.

Reference: ``int8_linear.linear_ref`` (float64 torch ops of the same quantized math); the kernel's results are its
within float32 rounding, a u8 output a level apart at most where float32's rounding crosses a tie.
"""

import functools

import torch

from .. import _extension, native_gemm as float32_gemm, run
# (fastbert.kernels: the repository's top-level kernels/ folder, installed under that name by setup.py)
from ..kernels.activation import ACTIVATIONS, activation_ref

PANEL = 16  # output columns per panel (csrc/gemm_int8_cpu.h)
GROUP = 4  # inputs per group: 4 u8 broadcast as one int32
LEVELS = 63  # the largest weight magnitude the kernel sums exactly (7 bits)
MAX_IN = (2 ** 31 - 1) // (255 * LEVELS)  # inputs whose u8 x s8 products sum within int32 (133,676)


@functools.cache
def unavailable_reasons() -> tuple[str, ...]:
    """Why the native int8 GEMM cannot run here (() when it can): found once."""
    return _extension.cpu_kernel_reasons("gemm_int8_cpu", "fastbert's int8 CPU GEMM",
                                         lambda C: C.gemm_int8_cpu_available(), "an x86-64 CPU with AVX2 and FMA")


class PackedWeight:
    """A 7-bit weight [out, in] as the kernel reads it: ``panels`` [ceil(out / 16), ceil(in / 4), 16, 4] s8 and
    ``column_sums`` [ceil(out / 16) * 16] int32, zero past ``out`` and ``in``, with its row ``scales`` [out]."""

    __slots__ = ("panels", "column_sums", "scales", "out", "in_features")

    def __init__(self, panels: torch.Tensor, column_sums: torch.Tensor, scales: torch.Tensor, out: int,
                 in_features: int):
        count, groups = -(-out // PANEL), -(-in_features // GROUP)
        if not (panels.dtype == torch.int8 and panels.is_cpu and panels.is_contiguous()
                and panels.shape == (count, groups, PANEL, GROUP)):
            raise ValueError(f"panels must be a contiguous int8 CPU tensor [{count}, {groups}, {PANEL}, {GROUP}], "
                             f"got {tuple(panels.shape)} {panels.dtype} on {panels.device}")
        if not (column_sums.dtype == torch.int32 and column_sums.is_cpu and column_sums.is_contiguous()
                and column_sums.shape == (count * PANEL,)):
            raise ValueError(f"column_sums must be contiguous int32 [{count * PANEL}] on the CPU, got "
                             f"{tuple(column_sums.shape)} {column_sums.dtype}")
        if not (scales.dtype == torch.float32 and scales.is_cpu and scales.is_contiguous() and scales.shape == (out,)):
            raise ValueError(f"scales must be contiguous float32 [{out}] on the CPU, got {tuple(scales.shape)} "
                             f"{scales.dtype}")
        if in_features > MAX_IN:
            raise ValueError(f"the int8 GEMM sums at most {MAX_IN} inputs in int32, got {in_features}")
        self.panels, self.column_sums, self.scales = panels, column_sums, scales
        self.out, self.in_features = out, in_features


def pack(quantized: torch.Tensor, scales: torch.Tensor) -> PackedWeight:
    """W_q [out, in] int8 in [-63, 63] and its row scales [out] -> its panels (``panels[p, g, j, k] = W_q[16 p + j,
    4 g + k]``) and column sums, for any number of tokens."""
    if quantized.dtype != torch.int8 or quantized.dim() != 2 or quantized.device.type != "cpu":
        raise ValueError(f"the weight must be an int8 CPU tensor [out, in], got {tuple(quantized.shape)} "
                         f"{quantized.dtype} on {quantized.device}")
    if scales.dtype != torch.float32 or scales.shape != quantized.shape[:1] or scales.device.type != "cpu":
        raise ValueError(f"scales must be float32 [{quantized.shape[0]}] on the CPU, got {tuple(scales.shape)} "
                         f"{scales.dtype} on {scales.device}")
    if quantized.numel() and (int(quantized.min()) < -LEVELS or int(quantized.max()) > LEVELS):  # (abs(-128) wraps)
        raise ValueError(f"the native int8 GEMM sums 7-bit weights exactly: |W_q| must be <= {LEVELS}")
    out, in_features = quantized.shape
    panels, groups = -(-out // PANEL), -(-in_features // GROUP)
    padded = quantized.new_zeros(panels * PANEL, groups * GROUP)
    padded[:out, :in_features] = quantized
    column_sums = padded.sum(dim=1, dtype=torch.int32)
    packed = padded.view(panels, PANEL, groups, GROUP).transpose(1, 2).contiguous()
    return PackedWeight(packed, column_sums, scales.contiguous(), out, in_features)


@run.step
def linear(q: torch.Tensor, scale: float, zero_point: int, packed: PackedWeight, bias: torch.Tensor | None,
           activation: str | None = None, residual: torch.Tensor | None = None,
           output: tuple[float, int] | None = None) -> torch.Tensor:
    """act((q - zero_point) @ W_q^T * scale * W's scales + bias), or that + residual; float32, or u8 with ``output``
    (its scale and zero point; only with the erf GELU or no activation). A step of a CPU replay (``run.step``)."""
    if not (q.is_cpu and q.dtype is torch.uint8 and q.dim() == 2 and q.shape[1] == packed.in_features):
        raise ValueError(f"q must be a u8 CPU tensor [tokens, {packed.in_features}], got {tuple(q.shape)} {q.dtype} "
                         f"on {q.device}")
    _check_epilogue(q.shape[0], packed, bias, activation, residual, output)
    q = q.contiguous()
    # (held: the tensors the kernel reads, alive until it returns)
    y, held, args = _epilogue_args(q.shape[0], packed, bias, activation, residual, output)
    _extension._C.gemm_int8_cpu(q.data_ptr(), q.shape[1], packed.panels.data_ptr(), packed.column_sums.data_ptr(),
                                packed.scales.data_ptr(), scale, zero_point, *args)
    return y if activation is None or args[-1] else activation_ref(y, activation)


def linear_quantizing(x: torch.Tensor, rows: int | torch.Tensor, smooth: torch.Tensor | None, packed: PackedWeight,
                      bias: torch.Tensor | None, activation: str | None = None, residual: torch.Tensor | None = None,
                      output: tuple[float, int] | None = None, per_token: bool = False) -> torch.Tensor:
    """``linear`` of float32 x quantized in the same native call: per call (``int8_linear.quantize_per_call``'s bytes:
    the range of its first ``rows`` rows, or of the rows ``rows`` indexes, of x / smooth), or ``per_token``
    (``quantize_per_token``'s bytes, each row's result times its scale before the bias; ``rows`` unread). No u8
    tensor, no second call. Called inside the steps of ``int8/linear.py`` (``_per_call``, ``_per_token``), which a
    CPU replay records: no step of its own."""
    if not (x.is_cpu and x.dtype is torch.float32 and x.dim() == 2 and x.shape[1] == packed.in_features):
        raise ValueError(f"x must be a float32 CPU tensor [tokens, {packed.in_features}], got {tuple(x.shape)} "
                         f"{x.dtype} on {x.device}")
    if smooth is not None and not (smooth.is_cpu and smooth.dtype is torch.float32 and smooth.shape == (x.shape[1],)):
        raise ValueError(f"smooth must be float32 [{x.shape[1]}], got {tuple(smooth.shape)} {smooth.dtype}")
    if per_token and output is not None:
        raise ValueError("a u8 output takes an input quantized per call or statically")
    _check_epilogue(x.shape[0], packed, bias, activation, residual, output)
    return _quantizing(x, range_rows(x, rows), rows, smooth, packed, bias, activation, residual, output, per_token)


def linear_quantizing_replayed(x: torch.Tensor, rows: int | torch.Tensor, smooth: torch.Tensor | None,
                               packed: PackedWeight, bias: torch.Tensor | None, activation: str | None = None,
                               residual: torch.Tensor | None = None, output: tuple[float, int] | None = None,
                               per_token: bool = False) -> torch.Tensor:
    """``linear_quantizing`` in a step as a replay calls it (``run.step``): x, smooth, residual and the settings as
    the recorded call's, which passed its checks; ``rows`` a count of leading rows that the replay's layout gives (its
    tokens: at most x's rows) or indexes, checked; the bias, a parameter read anew, checked."""
    float32_gemm.check_epilogue(x.shape[0], packed.out, bias, None)
    index = range_rows(x, rows) if isinstance(rows, torch.Tensor) else None  # (indexes: this call's own)
    return _quantizing(x, index, rows, smooth, packed, bias, activation, residual, output, per_token)


def _quantizing(x, index, rows, smooth, packed, bias, activation, residual, output, per_token) -> torch.Tensor:
    """The kernel of ``linear_quantizing`` on checked arguments (``index``: ``range_rows``'s)."""
    x = x.contiguous()
    smooth = None if smooth is None else smooth.contiguous()
    # (held: the tensors the kernel reads, alive until it returns)
    y, held, args = _epilogue_args(x.shape[0], packed, bias, activation, residual, output)
    _extension._C.gemm_int8_quantizing_cpu(
        x.data_ptr(), 0 if smooth is None else smooth.data_ptr(), 0 if index is None else index.data_ptr(),
        rows if index is None else index.numel(), per_token, packed.panels.data_ptr(), packed.column_sums.data_ptr(),
        packed.scales.data_ptr(), *args)
    return y if activation is None or args[-1] else activation_ref(y, activation)


def range_rows(x: torch.Tensor, rows: int | torch.Tensor) -> torch.Tensor | None:
    """The rows of x [tokens, in] whose range quantizes it per call, checked: None for a count of leading rows
    (``rows``, in [0, tokens]), or ``rows`` as contiguous int64 indexes into x's rows (the quantizer's arguments)."""
    if isinstance(rows, torch.Tensor):
        index = rows.to(torch.int64).contiguous()
        if index.numel() and (int(index.min()) < 0 or int(index.max()) >= x.shape[0]):
            raise ValueError(f"rows indexes outside x's {x.shape[0]} rows")
        return index
    if not 0 <= rows <= x.shape[0]:
        raise ValueError(f"rows must be in [0, {x.shape[0]}], got {rows}")
    return None


def epilogue_quantizes(activation: str | None) -> bool:
    """Whether the kernel's epilogue can write a u8 result after ``activation``: none, or the erf GELU it computes
    (others run in torch ops after it, on a float32 result)."""
    return activation is None or ACTIVATIONS.get(activation) == "gelu_erf"


def _check_epilogue(rows: int, packed: PackedWeight, bias, activation, residual, output) -> None:
    """ValueError unless the epilogue's arguments fit a GEMM of ``rows`` rows (before ``_epilogue_args``)."""
    float32_gemm.check_epilogue(rows, packed.out, bias, residual)
    if activation is not None and (activation not in ACTIVATIONS or residual is not None):
        raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, without a residual; got {activation!r}")
    if output is not None and not epilogue_quantizes(activation):
        raise ValueError(f"a u8 output takes the erf GELU or no activation, got {activation!r}")


def _epilogue_args(rows: int, packed: PackedWeight, bias, activation, residual, output) -> tuple:
    """The epilogue of a GEMM of ``rows`` rows, its arguments checked (``_check_epilogue``): its result y, the tensors
    the kernel reads (the caller holds them until the kernel returns: a contiguous copy made here has no other
    reference) and the kernel's arguments from the bias on (bias, residual, y, y_u8, y_scale, y_zero_point, rows, in,
    out, threads, gelu)."""
    out = packed.out
    fused_gelu = activation is not None and epilogue_quantizes(activation)  # (the kernel's own epilogue)
    bias = None if bias is None else bias.contiguous()
    residual = None if residual is None else residual.contiguous()
    y = torch.empty(rows, out, dtype=torch.float32 if output is None else torch.uint8)
    y_scale, y_zero_point = (1.0, 0) if output is None else output
    args = (0 if bias is None else bias.data_ptr(), 0 if residual is None else residual.data_ptr(),
            y.data_ptr() if output is None else 0, 0 if output is None else y.data_ptr(), y_scale, y_zero_point, rows,
            packed.in_features, out, torch.get_num_threads(), fused_gelu)
    return y, (bias, residual), args
