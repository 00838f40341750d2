"""CPU GEMM with a fused epilogue: ``act(x @ W^T + b)`` or ``x @ W^T + b + residual``, through oneDNN.

x: [tokens, in], W: [out, in] (prepacked by ``pack``), b: [out] or None, residual: [tokens, out] -> [tokens, out].

torch's ``F.linear`` on CPU runs MKL's sgemm (fp32). oneDNN, which every x86 torch build carries, runs the same GEMM
on weights reordered once into its blocked layout and applies bias, GELU (exact erf or tanh), ReLU or a residual add
in the GEMM's epilogue, while the output tile is still in cache. Which library is faster depends on the CPU (seen:
oneDNN 1.05-1.3x MKL on one AMD EPYC with AVX-512, about 2x on another), so ``cpu.gemm_figures`` times both on
bert-base-sized GEMMs of a small and a large batch, once per machine, and the GEMM op (``ops/gemm.py``) keeps
oneDNN only where it wins both (``fastbert.info()`` shows the figures).

Numerics: fp32 accumulation in both; the epilogue applies to the fp32 accumulator before the output is rounded, so in
bf16 the bias, residual and activation see one rounding fewer than ``F.linear`` followed by torch ops.
"""

import functools

import torch
import torch.nn.functional as F

from . import run
# (fastbert.kernels: the repository's top-level kernels/ folder, installed under that name by setup.py)
from .kernels.activation import ACTIVATIONS, activation_ref

# Activation kind (kernels/activation.py's ACTIVATIONS) -> oneDNN's epilogue (attr, algorithm).
EPILOGUE_KINDS = {"gelu_erf": ("gelu", "none"), "gelu_tanh": ("gelu", "tanh"), "relu": ("relu", "")}
# HF activation name -> oneDNN's epilogue, for the names whose kind it computes.
EPILOGUES = {name: EPILOGUE_KINDS[kind] for name, kind in ACTIVATIONS.items() if kind in EPILOGUE_KINDS}
DTYPES = (torch.float32, torch.bfloat16)


def linear_ref(x, weight, bias, activation: str | None = None, residual: torch.Tensor | None = None) -> torch.Tensor:
    """The same math in torch ops (``weight`` unpacked): what HF computes."""
    y = F.linear(x, weight, bias)
    if residual is not None:
        y = y + residual
    return y if activation is None else activation_ref(y, activation)


def unavailable_reasons(dtype: torch.dtype) -> list[str]:
    reasons = []
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        reasons.append("this torch build has no oneDNN linear (torch.ops.mkldnn._linear_pointwise)")
    elif not torch.backends.mkldnn.enabled:
        reasons.append("torch.backends.mkldnn.enabled is False")
    elif dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        reasons.append("oneDNN's bf16 linear needs AVX-512 (BW/VL/DQ) or AMX, which this CPU lacks")
    if dtype not in DTYPES:
        reasons.append(f"oneDNN linear runs float32/bfloat16 here, not {dtype}")
    if not reasons:
        failure = _trial_failure(dtype)
        if failure:
            reasons.append(f"oneDNN's {dtype} linear fails on this CPU and torch build: {failure}")
    if not reasons and dtype == torch.float32:
        errors = _float32_errors()
        if errors[0] > FLOAT32_ERROR_RATIO * errors[1] + 1e-6:
            reasons.append(f"oneDNN's float32 GEMM is less exact than torch's on this CPU (max error {errors[0]:.1e} "
                           f"against {errors[1]:.1e} at 129 x 768 x 768, more than {FLOAT32_ERROR_RATIO}x)")
    return reasons


# oneDNN's float32 GEMM replaces torch's (MKL's) only where its rounding error is within this factor of torch's: the
# outputs then stay as close to transformers' as transformers' own. Seen: within 2x on the AVX-512 CPUs (AMD EPYC
# Zen 4 and 5, Intel Xeon), 2.7x on an AMD EPYC Zen 3 with AVX2 only, at every K from 768 up.
FLOAT32_ERROR_RATIO = 2


@functools.cache
def _float32_errors() -> tuple[float, float]:
    """(oneDNN's, torch's) max error against float64 on one bert-sized float32 GEMM (seeded), in a thread of its
    own (as ``_trial_failure``)."""
    from .threads import in_own_thread

    return in_own_thread(_errors)


def _errors() -> tuple[float, float]:
    generator = torch.Generator().manual_seed(0)
    x, weight = torch.randn(129, 768, generator=generator), torch.randn(768, 768, generator=generator) / 768 ** 0.5
    exact = F.linear(x.double(), weight.double())
    with torch.inference_mode():
        return tuple(float((y.double() - exact).abs().max()) for y in (linear(x, pack(weight), None),
                                                                      F.linear(x, weight)))


@functools.cache
def _trial_failure(dtype: torch.dtype) -> str | None:
    """The error of one tiny packed GEMM with each epilogue in ``dtype``, or None when it runs: the capability
    queries are not the whole story (seen: a torch build whose bf16 query says yes and whose linear then raises "bf16
    path needs avx_ne_convert or avx512bw"). Run in a thread of its own (``fastbert.threads``: a fork later does not
    inherit OpenMP threads)."""
    from .threads import in_own_thread

    return in_own_thread(_trial, dtype)


def _trial(dtype: torch.dtype) -> str | None:
    try:
        x, weight = torch.ones(3, 16, dtype=dtype), torch.ones(8, 16, dtype=dtype)
        packed = pack(weight)
        linear(x, packed, torch.zeros(8, dtype=dtype), "gelu")
        linear(x, packed, None, residual=torch.zeros(3, 8, dtype=dtype))
    except RuntimeError as error:
        return str(error).strip().splitlines()[0]
    return None


def pack(weight: torch.Tensor) -> torch.Tensor:
    """W [out, in] -> oneDNN's blocked layout (an opaque ``torch._mkldnn`` tensor), for any number of tokens."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())


@run.step
def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, activation: str | None = None,
           residual: torch.Tensor | None = None) -> torch.Tensor:
    """act(x @ W^T + b), or x @ W^T + b + residual (one epilogue: oneDNN fuses either, not both). A step of a CPU
    replay (``run.step``)."""
    if x.dim() != 2 or x.dtype != packed.dtype:
        raise ValueError(f"x must be [tokens, in] in the weight's dtype {packed.dtype}, got {tuple(x.shape)} {x.dtype}")
    if residual is not None:
        if activation is not None:
            raise ValueError("oneDNN fuses an activation or a residual add, not both")
        return torch.ops.mkldnn._linear_pointwise.binary(x.contiguous(), residual.contiguous(), packed, bias, "add")
    attr, algorithm = EPILOGUES[activation] if activation is not None else ("none", "")
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, attr, [], algorithm)
