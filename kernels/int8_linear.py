"""CPU int8 GEMM with a fused epilogue: ``act(x @ W^T + b)`` or ``x @ W^T + b + residual``, through oneDNN's
quantized linear, with fp32 in and fp32 out.

x: [tokens, in] fp32, quantized here per call; W: [out, in], quantized once (``quantize_weight``); b: [out] fp32;
residual: [tokens, out] fp32 -> [tokens, out] fp32.

    smooth : [in] or None   per-input-channel divisor (SmoothQuant): x / smooth times W * smooth is x @ W^T, but
                            moves an activation channel's outliers into the weights, which are quantized per row
    x_q    = clamp(round((x / smooth) / s_x) + z_x, 0, 255)      u8, one scale s_x and zero point z_x per call,
                                                                from the min and max of the ``rows`` real tokens
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

from . import cpu_linear
from .activation import activation_ref
from .cpu_linear import EPILOGUES


class QuantizedWeight:
    """W [out, in] as oneDNN's prepacked s8 weight with its per-row scales (and the smoothing it was built with)."""

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


def quantize_weight(weight: torch.Tensor, bits: int, smooth: torch.Tensor | None = None) -> QuantizedWeight:
    """W [out, in] (fp32) -> the prepacked weight ``linear`` multiplies by."""
    quantized, scales = quantize_weight_ref(weight, bits, smooth)
    packed = torch.ops.onednn.qlinear_prepack(quantized, None)
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
        return torch.empty(x.shape)
    buffer = getattr(_scratch, "buffer", None)
    if buffer is None or buffer.numel() < numel:
        with torch.inference_mode(False):  # (a normal tensor: usable as out= in and outside inference mode)
            buffer = _scratch.buffer = torch.empty(numel)
    return buffer[:numel].view(x.shape)


def quantize_activation(x: torch.Tensor, rows: int | torch.Tensor, smooth: torch.Tensor | None = None):
    """x [tokens, in] fp32 -> (u8 x_q [tokens, in], s_x, z_x), the range taken from the first ``rows`` rows (or the
    rows indexed by ``rows``, [R] int64): fastbert._C's one-pass quantizer (csrc/quantize_cpu.h) where it runs, the
    same bytes as ``quantize_activation_ref``."""
    from .._extension import quantize_cpu_unavailable_reasons, quantize_per_call

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
    # x_q - 128 = clamp(round(x / s_x + z_x - 128), -128, 127); the scaling and the shift in one pass
    torch.add(torch.tensor(zero_point - 128.0), x, alpha=1.0 / scale, out=scaled).round_().clamp_(-128, 127)
    return _as_u8(scaled), scale, zero_point


def quantize_activation_per_token(x: torch.Tensor, smooth: torch.Tensor | None = None):
    """x [tokens, in] fp32 -> (u8 x_q [tokens, in], s_x [tokens, 1]): symmetric per row, x_q = round(x / s_x) + 128
    (one zero point for every row, so the GEMM takes it; each row's scale is applied to its output row after).
    fastbert._C's one-pass quantizer where it runs, the same bytes as ``quantize_activation_per_token_ref``."""
    from .._extension import quantize_cpu_unavailable_reasons, quantize_per_token

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
               per_token: bool = False) -> torch.Tensor:
    """The same quantized math in float64 torch ops: what ``linear`` must compute up to fp32 rounding."""
    if per_token:
        q, scale = quantize_activation_per_token_ref(x, smooth)
        zero_point, scale = 128, scale.double()
    else:
        q, scale, zero_point = quantize_activation_ref(x, x.shape[0] if rows is None else rows, smooth)
    weight_q, weight_scales = quantize_weight_ref(weight, bits, smooth)
    y = ((q.double() - zero_point) @ weight_q.double().t()) * (scale * weight_scales.double())
    if bias is not None:
        y = y + bias.double()
    if residual is not None:
        y = y + residual.double()
    return y if activation is None else activation_ref(y, activation)


def linear(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None, activation: str | None = None,
           residual: torch.Tensor | None = None, rows: int | torch.Tensor | None = None,
           per_token: bool = False) -> torch.Tensor:
    """act(x @ W^T + b), or x @ W^T + b + residual, x quantized with the range of its ``rows`` (a count of leading
    rows, or [R] indices; None: all), or with one scale per token (``per_token``: finer, and every row's result is
    its own alone; the bias, activation and residual then run after the GEMM instead of in its epilogue)."""
    if x.dim() != 2 or x.dtype != torch.float32 or x.shape[1] != weight.in_features:
        raise ValueError(f"x must be float32 [tokens, {weight.in_features}], got {tuple(x.shape)} {x.dtype}")
    if residual is not None and activation is not None:
        raise ValueError("the int8 linear fuses an activation or a residual add, not both")
    if per_token:
        q, scales = quantize_activation_per_token(x, weight.smooth)
        y = torch.ops.onednn.qlinear_pointwise(q, 1.0, 128, weight.packed, weight.scales, weight.zero_points, None,
                                               1.0, 0, torch.float32, "none", [], "").mul_(scales)
        y = y if bias is None else y.add_(bias)
        y = y if residual is None else y.add_(residual)
        return y if activation is None else activation_ref(y, activation)
    q, scale, zero_point = quantize_activation(x, x.shape[0] if rows is None else rows, weight.smooth)
    if residual is not None:
        return torch.ops.onednn.qlinear_pointwise.binary(
            q, scale, zero_point, weight.packed, weight.scales, weight.zero_points, residual.contiguous(), bias,
            1.0, 0, torch.float32, 1.0, 0, "add", 1.0, "none", [], "")
    attr, algorithm = EPILOGUES[activation] if activation is not None else ("none", "")
    return torch.ops.onednn.qlinear_pointwise(q, scale, zero_point, weight.packed, weight.scales, weight.zero_points,
                                              bias, 1.0, 0, torch.float32, attr, [], algorithm)


def unavailable_reasons() -> list[str]:
    """Why the int8 linear cannot run in this torch build or on this CPU (empty: it can)."""
    if not all(hasattr(torch.ops.onednn, op) for op in ("qlinear_prepack", "qlinear_pointwise")):
        return ["this torch build has no oneDNN quantized linear (torch.ops.onednn.qlinear_prepack/qlinear_pointwise)"]
    if not torch.backends.mkldnn.is_available():
        return ["this torch build has no oneDNN"]
    failure = _trial_failure()
    return [f"oneDNN's int8 linear fails on this CPU and torch build: {failure}"] if failure else []


@functools.cache
def _trial_failure() -> str | None:
    """The error of one tiny int8 GEMM with each epilogue, or None when they run and give the exact result (in a
    thread of its own, as ``cpu_linear._trial_failure``)."""
    from ..threads import in_own_thread

    return in_own_thread(_trial)


def _trial() -> str | None:
    try:
        x, weight = torch.ones(3, 16), torch.ones(8, 16)
        packed = quantize_weight(weight, 7)
        y = linear(x, packed, torch.zeros(8), "gelu")
        linear(x, packed, None, residual=torch.zeros(3, 8))
    except RuntimeError as error:
        return str(error).strip().splitlines()[0]
    return None if torch.allclose(y, F.gelu(torch.full((3, 8), 16.0))) else "a GEMM of ones came back wrong"


# bert-base's four GEMM shapes (in, out) at a small and a large batch: int8 must win where the model spends its time.
MEASURED_SHAPES = ((768, 2304), (768, 768), (768, 3072), (3072, 768))
MEASURED_TOKENS = (128, 1024)


def measure(bits: int) -> dict[str, dict[int, float]]:
    """Effective GFLOP/s over bert-base's four GEMM shapes, per token count, of the fp32 GEMMs (torch's F.linear, and
    oneDNN's packed linear where it runs) and of the int8 linear, quantization of x included: {"torch": {tokens:
    gflops}, "onednn": {...}, "int8": {...}} (median of 11 after 2 warm-ups, interleaved; ~2 s, once per machine)."""
    generator = torch.Generator().manual_seed(0)
    figures = {"torch": {}, "onednn": {}, "int8": {}}
    with torch.inference_mode():
        weights = [torch.randn(n_out, n_in, generator=generator) / n_in ** 0.5 for n_in, n_out in MEASURED_SHAPES]
        biases = [torch.zeros(w.shape[0]) for w in weights]
        quantized = [quantize_weight(w, bits) for w in weights]
        packed = None if cpu_linear.unavailable_reasons(torch.float32) else [cpu_linear.pack(w) for w in weights]
        for tokens in MEASURED_TOKENS:
            xs = [torch.randn(tokens, w.shape[1], generator=generator) for w in weights]
            calls = {
                "torch": lambda: [F.linear(x, w, b) for x, w, b in zip(xs, weights, biases)],
                "int8": lambda: [linear(x, q, b) for x, q, b in zip(xs, quantized, biases)],
            }
            if packed is not None:
                calls["onednn"] = lambda: [cpu_linear.linear(x, p, b) for x, p, b in zip(xs, packed, biases)]
            gflop = sum(2 * tokens * w.numel() for w in weights) / 1e9
            for name, seconds in cpu_linear.median_seconds(calls, warmup=2, reps=11).items():
                figures[name][tokens] = round(gflop / seconds, 1)
    return figures
