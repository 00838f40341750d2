"""CPU int8 GEMM with a fused epilogue: ``act(x @ W^T + b)`` or ``x @ W^T + b + residual``, with fp32 in and fp32
out: through fastbert._C's int8 GEMM where the weights have 7 bits (``native_gemm``), oneDNN's quantized linear with 8.

x: [tokens, in] fp32, quantized here per call; W: [out, in], quantized once (``quantize_weight``); b: [out] fp32;
residual: [tokens, out] fp32 -> [tokens, out] fp32.

    smooth : [in] or None   per-input-channel divisor (SmoothQuant): x / smooth times W * smooth is x @ W^T, but
                            moves an activation channel's outliers into the weights, which are quantized per row
    x_q    = clamp(round((x / smooth) / s_x) + z_x, 0, 255)      u8, one scale s_x and zero point z_x per call,
                                                                from the min and max of the ``rows`` real tokens,
                                                                or fixed (``static``: calibrated by the guard)
    W_q    = clamp(round((W * smooth) / s_w[o]), -Q, Q)          s8, symmetric, one scale per output row
    y      = epilogue(s_x * s_w[o] * sum_i (x_q - z_x) W_q + b)  int32 accumulation, then fp32

Q is 127 (8 bits) where the CPU has VNNI or AMX (u8 x s8 products summed in int32), and 63 (7 bits) without: AVX2's
``vpmaddubsw`` adds two u8 x s8 products into a saturating int16, and 2 x 255 x 127 = 64,770 overflows it while
2 x 255 x 63 = 32,130 does not, so 7-bit weights are exact there (8-bit ones lose up to half of a large dot product).

Only the ``rows`` first rows set the activation range: rows past them (the spare rows of a bucketed batch, padding)
never widen it, so a sentence's result does not depend on what else is in its batch.
"""

import functools
import math
import threading

import torch
import torch.nn.functional as F

from .. import _extension, run
from ..cpu_gemm import EPILOGUES
# (fastbert.kernels: the repository's top-level kernels/ folder, installed under that name by setup.py)
from ..kernels.activation import activation_ref
from . import handoff as int8_handoff, native_gemm


class QuantizedWeight:
    """W [out, in] as the int8 GEMM's prepacked s8 weight (``native_gemm.PackedWeight``, or oneDNN's packed tensor)
    with its per-row scales (and the smoothing it was built with)."""

    __slots__ = ("packed", "scales", "zero_points", "smooth", "bits", "in_features")

    def __init__(self, packed, scales, zero_points, smooth, bits, in_features):
        self.packed, self.scales, self.zero_points, self.smooth, self.bits = packed, scales, zero_points, smooth, bits
        self.in_features = in_features


def weight_levels(bits: int) -> int:
    """The largest weight magnitude: 127 for 8 bits, 63 for 7."""
    if bits not in (7, 8):
        raise ValueError(f"bits must be 7 or 8, got {bits}")
    return 2 ** (bits - 1) - 1


def quantize_weight_ref(weight: torch.Tensor, bits: int, smooth: torch.Tensor | None = None):
    """W [out, in] -> (s8 W_q [out, in], fp32 scales [out]): symmetric per output row, after ``* smooth``."""
    levels = weight_levels(bits)
    w = weight.detach().float() * (1.0 if smooth is None else smooth)
    scales = (w.abs().amax(dim=1) / levels).clamp_min(torch.finfo(torch.float32).tiny)  # (an all-zero row: scale > 0)
    return torch.round(w / scales[:, None]).clamp_(-levels, levels).to(torch.int8), scales


def gemm_library(bits: int) -> str:
    """Which int8 GEMM multiplies ``bits``-bit weights here: "native" (fastbert._C's, 7 bits on AVX2: exact, and
    2-4x faster than oneDNN's at a sentence's size) or "onednn" (8 bits, where VNNI or AMX sum them in int32: its
    kernels use them; and 7 bits where fastbert._C's does not run)."""
    return "native" if bits == 7 and not native_gemm.unavailable_reasons() else "onednn"


def quantize_weight(weight: torch.Tensor, bits: int, smooth: torch.Tensor | None = None,
                    library: str | None = None) -> QuantizedWeight:
    """W [out, in] (fp32) -> the prepacked weight ``linear`` multiplies by, for ``library`` (None:
    ``gemm_library(bits)``; "native" takes 7 bits)."""
    library = gemm_library(bits) if library is None else library
    if library not in ("native", "onednn") or (library == "native" and bits != 7):
        raise ValueError(f"library must be 'onednn', or 'native' with 7-bit weights; got {library!r}, {bits} bits")
    if library == "native" and native_gemm.unavailable_reasons():
        raise ValueError(f"library 'native' does not run here: {'; '.join(native_gemm.unavailable_reasons())}")
    quantized, scales = quantize_weight_ref(weight, bits, smooth)
    packed = (native_gemm.pack(quantized, scales) if library == "native"
              else torch.ops.onednn.qlinear_prepack(quantized, None))
    zero_points = torch.zeros(scales.shape, dtype=torch.int32)
    smooth = None if smooth is None else smooth.float().contiguous()
    return QuantizedWeight(packed, scales, zero_points, smooth, bits, weight.shape[1])


def qparams(low: float, high: float) -> tuple[float, int]:
    """(s_x, z_x) of u8 covering [min(low, 0), max(high, 0)] (0 is exact, so is a zero activation)."""
    low, high = min(low, 0.0), max(high, 0.0)
    scale = (high - low) / 255.0
    if scale == 0.0 or not math.isfinite(scale):
        return 1.0, 0
    return scale, int(min(255, max(0, round(-low / scale))))


def _as_u8(q: torch.Tensor) -> torch.Tensor:
    """Integral float32 values in [-128, 127] -> uint8 of value + 128: through int8 (torch converts float32 to int8
    vectorized, to uint8 about 3x slower), then the sign bit flipped (two's complement v + 128 is v ^ 0x80)."""
    return q.to(torch.int8).view(torch.uint8).bitwise_xor_(0x80)


# The float32 temporary of a quantization is written into the same memory on every call of a thread, up to this
# size: a fresh allocation of a few MB pays its page faults on every call (scaling a 1024 x 3072 activation here:
# 0.77 ms into new memory, 0.35 ms into reused memory).
SCRATCH_BYTES = 64 << 20
_scratch = threading.local()


def _scratch_like(x: torch.Tensor) -> torch.Tensor:
    """An uninitialized float32 tensor of x's shape: this thread's scratch memory where it fits."""
    numel = x.numel()
    if numel * 4 > SCRATCH_BYTES:
        return torch.empty(x.shape, dtype=torch.float32, device="cpu")
    buffer = getattr(_scratch, "buffer", None)
    if buffer is None or buffer.numel() < numel:
        with torch.inference_mode(False):  # (a normal tensor: usable as out= in and outside inference mode)
            buffer = _scratch.buffer = torch.empty(numel, dtype=torch.float32, device="cpu")
    return buffer[:numel].view(x.shape)


# --- fastbert._C's one-pass quantizer (csrc/quantize_cpu.h) -----------------------------------------------------------


@functools.cache
def quantize_cpu_unavailable_reasons() -> tuple[str, ...]:
    """Why the one-pass int8 activation quantizer (csrc/quantize_cpu.h) cannot run here (() when it can)."""
    return _extension.cpu_kernel_reasons("quantize_cpu_available", "fastbert's int8 activation quantizer",
                                         lambda C: C.quantize_cpu_available(), "an x86-64 CPU with AVX2 and FMA",
                                         threaded=False)


def _quantize_inputs(x: torch.Tensor, smooth: torch.Tensor | None, isa: str = ""):
    if isa not in ("", "avx2"):
        raise ValueError(f"isa must be '' (the fastest this CPU runs) or 'avx2', got {isa!r}")
    if x.device.type != "cpu" or x.dtype != torch.float32 or x.dim() != 2:
        raise ValueError(f"x must be a float32 CPU tensor [tokens, in], got {tuple(x.shape)} {x.dtype} on {x.device}")
    if smooth is not None and (smooth.dtype != torch.float32 or smooth.shape != (x.shape[1],)):
        raise ValueError(f"smooth must be float32 [{x.shape[1]}], got {tuple(smooth.shape)} {smooth.dtype}")
    return x.contiguous(), None if smooth is None else smooth.contiguous()


def quantize_per_call(x: torch.Tensor, rows, smooth: torch.Tensor | None = None, isa: str = ""):
    """x [tokens, in] float32 -> (u8 [tokens, in], scale, zero point): one scale from the range of the first ``rows``
    rows (an int) or of the rows ``rows`` indexes ([R] int64), in one pass (``quantize_activation`` calls it).
    ``isa`` (each of these kernels): "avx2" runs the AVX2 rows where AVX-512 runs too (tests), "" the fastest."""
    x, smooth = _quantize_inputs(x, smooth, isa)
    index = native_gemm.range_rows(x, rows)
    out = torch.empty(x.shape, dtype=torch.uint8, device="cpu")
    scale, zero_point = _extension._C.quantize_per_call_cpu(
        x.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], 0 if smooth is None else smooth.data_ptr(),
        0 if index is None else index.data_ptr(), rows if index is None else index.numel(), torch.get_num_threads(),
        isa)
    return out, scale, zero_point


@run.step
def quantize_static(x: torch.Tensor, scale: float, zero_point: int, smooth: torch.Tensor | None = None,
                    isa: str = ""):
    """x [tokens, in] float32 -> u8 [tokens, in] with the given scale and zero point (no range taken), in one pass
    of fastbert._C where it runs, the same bytes as ``quantize_static_ref``."""
    x, smooth = _quantize_inputs(x, smooth, isa)  # (the kernel checks scale and zero point as check_static does)
    if quantize_cpu_unavailable_reasons():
        return quantize_static_ref(x, scale, zero_point, smooth)
    out = torch.empty(x.shape, dtype=torch.uint8, device="cpu")
    _extension._C.quantize_static_cpu(x.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1],
                                      0 if smooth is None else smooth.data_ptr(), scale, zero_point,
                                      torch.get_num_threads(), isa)
    return out


def quantize_per_token(x: torch.Tensor, smooth: torch.Tensor | None = None, isa: str = ""):
    """x [tokens, in] float32 -> (u8 [tokens, in], scales [tokens, 1]): a symmetric scale per row, in one pass."""
    x, smooth = _quantize_inputs(x, smooth, isa)
    out = torch.empty(x.shape, dtype=torch.uint8, device="cpu")
    scales = torch.empty(x.shape[0], 1, dtype=torch.float32, device="cpu")
    _extension._C.quantize_per_token_cpu(x.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1],
                                         0 if smooth is None else smooth.data_ptr(), scales.data_ptr(),
                                         torch.get_num_threads(), isa)
    return out, scales


# --- activations ------------------------------------------------------------------------------------------------------


def quantize_activation(x: torch.Tensor, rows: int | torch.Tensor, smooth: torch.Tensor | None = None):
    """x [tokens, in] fp32 -> (u8 x_q [tokens, in], s_x, z_x), the range taken from the first ``rows`` rows (or the
    rows indexed by ``rows``, [R] int64): fastbert._C's one-pass quantizer (csrc/quantize_cpu.h) where it runs, the
    same bytes as ``quantize_activation_ref``."""
    if quantize_cpu_unavailable_reasons():
        return quantize_activation_ref(x, rows, smooth)
    return quantize_per_call(x, rows, smooth)


def quantize_activation_ref(x: torch.Tensor, rows: int | torch.Tensor, smooth: torch.Tensor | None = None):
    """``quantize_activation`` in torch ops (five passes over x)."""
    scaled = _scratch_like(x)
    if smooth is not None:
        x = torch.div(x, smooth, out=scaled)
    real = x[:rows] if isinstance(rows, int) else x.index_select(0, rows)
    scale, zero_point = qparams(*(float(v) for v in torch.aminmax(real))) if real.numel() else (1.0, 0)
    return _quantized(x, scale, zero_point, scaled), scale, zero_point


def quantize_static_ref(x: torch.Tensor, scale: float, zero_point: int, smooth: torch.Tensor | None = None):
    """``quantize_static`` in torch ops."""
    check_static(scale, zero_point)
    scaled = _scratch_like(x)
    if smooth is not None:
        x = torch.div(x, smooth, out=scaled)
    return _quantized(x, scale, zero_point, scaled)


def check_static(scale: float, zero_point: int) -> None:
    """A static (scale, zero point) is a finite positive float and an int in [0, 255], or ValueError."""
    if not (isinstance(zero_point, int) and 0.0 < float(scale) < math.inf and 0 <= zero_point <= 255):
        raise ValueError(f"a static scale must be finite and > 0, its zero point in [0, 255]; got {scale}, "
                         f"{zero_point}")


def _quantized(x: torch.Tensor, scale: float, zero_point: int, scaled: torch.Tensor) -> torch.Tensor:
    """u8 of x with scale and zero point, through ``scaled`` (float32 memory of x's shape, x itself allowed)."""
    # x_q - 128 = clamp(round(x / s_x + z_x - 128), -128, 127); the scaling and the shift in one pass
    torch.add(torch.tensor(zero_point - 128.0), x, alpha=1.0 / scale, out=scaled).round_().clamp_(-128, 127)
    return _as_u8(scaled)


def quantize_activation_per_token(x: torch.Tensor, smooth: torch.Tensor | None = None):
    """x [tokens, in] fp32 -> (u8 x_q [tokens, in], s_x [tokens, 1]): symmetric per row, x_q = round(x / s_x) + 128
    (one zero point for every row, so the GEMM takes it; each row's scale is applied to its output row after).
    fastbert._C's one-pass quantizer where it runs, the same bytes as ``quantize_activation_per_token_ref``."""
    if quantize_cpu_unavailable_reasons():
        return quantize_activation_per_token_ref(x, smooth)
    return quantize_per_token(x, smooth)


def quantize_activation_per_token_ref(x: torch.Tensor, smooth: torch.Tensor | None = None):
    """``quantize_activation_per_token`` in torch ops."""
    scaled = _scratch_like(x)
    if smooth is not None:
        x = torch.div(x, smooth, out=scaled)
    largest = torch.linalg.vector_norm(x, float("inf"), dim=1, keepdim=True)  # max |x| per row, [tokens, 1]
    scales = largest.clamp_min(torch.finfo(torch.float32).tiny) / 127
    torch.div(x, scales, out=scaled).round_()  # (|x / s_x| <= 127)
    return _as_u8(scaled), scales


def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, bits: int,
               activation: str | None = None, residual: torch.Tensor | None = None,
               smooth: torch.Tensor | None = None, rows: int | torch.Tensor | None = None,
               per_token: bool = False, static: tuple[float, int] | None = None,
               output: tuple[float, int] | None = None) -> torch.Tensor:
    """The same quantized math in float64 torch ops: what ``linear`` must compute up to fp32 rounding (with
    ``output``: the u8 of that, a level apart at most where float32's rounding crosses a tie)."""
    if per_token and static is not None:
        raise ValueError("an input is quantized per token or with a static scale, not both")
    if x.dtype == torch.uint8:
        (scale, zero_point), q = static, x
    elif per_token:
        q, scale = quantize_activation_per_token_ref(x, smooth)
        zero_point, scale = 128, scale.double()
    elif static is not None:
        (scale, zero_point), q = static, quantize_static_ref(x, *static, smooth)
    else:
        q, scale, zero_point = quantize_activation_ref(x, x.shape[0] if rows is None else rows, smooth)
    weight_q, weight_scales = quantize_weight_ref(weight, bits, smooth)
    y = ((q.double() - zero_point) @ weight_q.double().t()) * (scale * weight_scales.double())
    if bias is not None:
        y = y + bias.double()
    if residual is not None:
        y = y + residual.double()
    y = y if activation is None else activation_ref(y, activation)
    if output is None:
        return y
    return (torch.round(y / output[0]) + output[1]).clamp_(0, 255).to(torch.uint8)


def linear(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None, activation: str | None = None,
           residual: torch.Tensor | None = None, rows: int | torch.Tensor | None = None,
           per_token: bool = False, static: tuple[float, int] | None = None,
           output: tuple[float, int] | None = None) -> torch.Tensor:
    """act(x @ W^T + b), or x @ W^T + b + residual, x quantized with the range of its ``rows`` (a count of leading
    rows, or [R] indices, or a ``padding.TokenLayout``: its ``tokens`` leading rows; None: all), or with one scale
    per token (``per_token``: finer, and every row's result is its own alone; with oneDNN's GEMM the bias, activation
    and residual then run after it instead of in its epilogue), or with the fixed (scale, zero point) ``static``
    (no range taken: one pass less over x). A u8 x is the input already quantized with ``static``. ``output``:
    (scale, zero point) of a u8 result, quantized in the GEMM's epilogue after the activation (the next GEMM's static
    input: no float32 result is written), float32 otherwise."""
    if x.dim() != 2 or x.dtype not in (torch.float32, torch.uint8) or x.shape[1] != weight.in_features:
        raise ValueError(f"x must be float32 (or u8, quantized) [tokens, {weight.in_features}], got {tuple(x.shape)} "
                         f"{x.dtype}")
    if residual is not None and activation is not None:
        raise ValueError("the int8 linear fuses an activation or a residual add, not both")
    if per_token and static is not None:
        raise ValueError("an input is quantized per token or with a static scale, not both")
    if x.dtype == torch.uint8 and static is None:
        raise ValueError("a u8 x is an input already quantized: give its static (scale, zero point)")
    if output is not None:
        check_static(*output)
        if per_token or residual is not None:
            raise ValueError("a u8 output takes an input quantized per call or statically, and no residual")
    if per_token:
        return _per_token(x, weight, bias, activation, residual)
    if x.dtype == torch.uint8:
        return _linear_u8(x.contiguous(), *static, weight, bias, activation, residual, output)
    if static is None:
        return _per_call(x, x.shape[0] if rows is None else rows, weight, bias, activation, residual, output)
    # (the u8 the op producing x wrote in the same pass, where it did: int8/handoff.py)
    scale, zero_point = static
    q = int8_handoff.take(x, scale, zero_point, weight.smooth)
    q = quantize_static(x, scale, zero_point, weight.smooth) if q is None else q
    return _linear_u8(q, scale, zero_point, weight, bias, activation, residual, output)


def _linear_u8(q: torch.Tensor, scale: float, zero_point: int, weight: QuantizedWeight, bias: torch.Tensor | None,
               activation: str | None, residual: torch.Tensor | None, output: tuple[float, int] | None):
    """The GEMM of the u8 q (with its scale and zero point) and its epilogue: the bias and the activation, or the
    residual; the result float32, or u8 with ``output``."""
    if isinstance(weight.packed, native_gemm.PackedWeight):
        if output is not None and not native_gemm.epilogue_quantizes(activation):
            # (an activation the kernel's epilogue lacks runs in torch ops: quantized after it, the same bytes)
            y = native_gemm.linear(q, scale, zero_point, weight.packed, bias, activation)
            return quantize_static(y, *output)
        return native_gemm.linear(q, scale, zero_point, weight.packed, bias, activation, residual, output)
    if residual is not None:
        return _gemm_residual(
            q, scale, zero_point, weight.packed, weight.scales, weight.zero_points, residual.contiguous(), bias,
            1.0, 0, torch.float32, 1.0, 0, "add", 1.0, "none", [], "")
    attr, algorithm = EPILOGUES[activation] if activation is not None else ("none", "")
    out_scale, out_zero_point, out_dtype = (1.0, 0, torch.float32) if output is None else (*output, torch.uint8)
    return _gemm(q, scale, zero_point, weight.packed, weight.scales, weight.zero_points, bias, out_scale,
                 out_zero_point, out_dtype, attr, [], algorithm)


def _quantized_per_call(linear_quantizing, x: torch.Tensor, rows, weight: QuantizedWeight, bias: torch.Tensor | None,
                        activation: str | None, residual: torch.Tensor | None, output: tuple[float, int] | None):
    """``_per_call`` whose native GEMM runs ``linear_quantizing`` (checked, or as a replay calls it)."""
    rows = rows if isinstance(rows, (int, torch.Tensor)) else rows.tokens
    # (a native weight is built only where fastbert._C's quantizer runs too: the same CPU and build checks)
    if type(weight.packed) is native_gemm.PackedWeight and (
            output is None or native_gemm.epilogue_quantizes(activation)):
        return linear_quantizing(x, rows, weight.smooth, weight.packed, bias, activation, residual, output)
    q, scale, zero_point = quantize_activation(x, rows, weight.smooth)
    return _linear_u8(q, scale, zero_point, weight, bias, activation, residual, output)


@run.step(replayed=functools.partial(_quantized_per_call, native_gemm.linear_quantizing_replayed))
def _per_call(x: torch.Tensor, rows, weight: QuantizedWeight, bias: torch.Tensor | None,
              activation: str | None, residual: torch.Tensor | None, output: tuple[float, int] | None):
    """x quantized with the range of its ``rows``, then ``_linear_u8`` (one step of a CPU replay: the scale is the
    data's; given the layout, the step reads the token count of the layout each replay passes)."""
    return _quantized_per_call(native_gemm.linear_quantizing, x, rows, weight, bias, activation, residual, output)


def _quantized_per_token(linear_quantizing, x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None,
                         activation: str | None, residual: torch.Tensor | None) -> torch.Tensor:
    """``_per_token`` whose native GEMM runs ``linear_quantizing`` (checked, or as a replay calls it)."""
    if type(weight.packed) is native_gemm.PackedWeight:
        return linear_quantizing(x, x.shape[0], weight.smooth, weight.packed, bias, activation, residual,
                                 per_token=True)
    q, scales = quantize_activation_per_token(x, weight.smooth)
    y = _linear_u8(q, 1.0, 128, weight, None, None, None, None).mul_(scales)
    y = y if bias is None else y.add_(bias)
    y = y if residual is None else y.add_(residual)
    return y if activation is None else activation_ref(y, activation)


@run.step(replayed=functools.partial(_quantized_per_token, native_gemm.linear_quantizing_replayed))
def _per_token(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None, activation: str | None,
               residual: torch.Tensor | None) -> torch.Tensor:
    """x quantized with one scale per token, the GEMM, then its bias, residual and activation (one step; fastbert's
    int8 GEMM scales each row and runs the rest in its epilogue)."""
    return _quantized_per_token(native_gemm.linear_quantizing, x, weight, bias, activation, residual)


@run.step
def _gemm(*args) -> torch.Tensor:
    """oneDNN's int8 linear, ``torch.ops.onednn.qlinear_pointwise`` (a step of a CPU replay)."""
    return torch.ops.onednn.qlinear_pointwise(*args)


@run.step
def _gemm_residual(*args) -> torch.Tensor:
    """The same with a residual added in its epilogue, ``qlinear_pointwise.binary``."""
    return torch.ops.onednn.qlinear_pointwise.binary(*args)


def unavailable_reasons(bits: int) -> list[str]:
    """Why the int8 linear of ``bits``-bit weights cannot run in this torch build or on this CPU (empty: it can): the
    reasons of the GEMM ``gemm_library(bits)`` picks, or the error of a trial GEMM with it."""
    library = gemm_library(bits)
    if library == "native":
        name = "fastbert's int8 GEMM"
    elif not all(hasattr(torch.ops.onednn, op) for op in ("qlinear_prepack", "qlinear_pointwise")):
        return ["this torch build has no oneDNN quantized linear (torch.ops.onednn.qlinear_prepack/qlinear_pointwise)"]
    elif not torch.backends.mkldnn.is_available():
        return ["this torch build has no oneDNN"]
    else:
        name = "oneDNN's int8 linear"
    failure = _trial_failure(library)
    return [f"{name} fails on this CPU and torch build: {failure}"] if failure else []


@functools.cache
def _trial_failure(library: str) -> str | None:
    """The error of one tiny int8 GEMM of ``library`` with each epilogue, or None when they run and give the exact
    result (in a thread of its own, as ``cpu_gemm._trial_failure``)."""
    from ..threads import in_own_thread

    return in_own_thread(_trial, library)


def _trial(library: str) -> str | None:
    try:
        x, weight = torch.ones(3, 16), torch.ones(8, 16)
        packed = quantize_weight(weight, 7, library=library)
        y = linear(x, packed, torch.zeros(8), "gelu")
        linear(x, packed, None, residual=torch.zeros(3, 8))
    except RuntimeError as error:
        return str(error).strip().splitlines()[0]
    return None if torch.allclose(y, F.gelu(torch.full((3, 8), 16.0))) else "a GEMM of ones came back wrong"
