"""The one place that decides which implementation runs each op.

Backends, fastest first:
- ``cuda-ext`` / ``cpu-ext``: the ``fastbert._C`` extension (the embedding op; on CPU also float32 attention);
- ``triton``: the kernels in ``fastbert.kernels`` (CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``);
- ``onednn``: the CPU GEMMs (op ``gemm``) through oneDNN with prepacked weights and fused epilogues
  (``kernels/cpu_gemm.py``), where it is measured faster than torch's ``F.linear`` on this CPU;
- ``torch``: plain PyTorch (the reference ops, SDPA for attention). Always applies; it is also what runs when
  autograd needs gradients (the fused kernels are forward-only), dropout is active, or an activation has no kernel.

``FASTBERT_BACKEND=auto|torch|triton`` overrides the choice; ``FASTBERT_BACKEND=torch`` also keeps the GEMMs on
``F.linear``, and ``FASTBERT_CPU_GEMM=auto|onednn|torch`` picks the CPU GEMM library alone;
``FASTBERT_CPU_INT8=auto|on|off`` runs a quantized model's GEMMs in int8 where measured faster, wherever they run,
or never (``int8.py``). The environment is read
once, at the first forward (``reload_settings()`` reads it again): an op's choice then costs one dict lookup.
Each backend states why it does not apply; ``fastbert.info()`` reports those reasons, and the first time a faster
backend is skipped for a reason other than the user's own choice, a warning says why.
"""

import importlib.util
import os
from dataclasses import dataclass

import torch

from . import _extension, announce, cpu
from . import cpu_gemm

OPS = ("embedding", "attention", "rotary", "layer_norm", "bias_act", "glu", "act_layer_norm", "gemm")
ENV_BACKEND = "FASTBERT_BACKEND"
ENV_CPU_GEMM = "FASTBERT_CPU_GEMM"
ENV_CPU_INT8 = "FASTBERT_CPU_INT8"
# Dtypes the C++ CPU embedding kernel was written for; fp16 on CPU has no fast path in torch either.
_CPU_EXT_DTYPES = (torch.float32, torch.bfloat16)
_CUDA_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class Settings:
    backend: str  # FASTBERT_BACKEND: auto, torch or triton
    cpu_gemm: str  # FASTBERT_CPU_GEMM: auto, onednn or torch
    cpu_int8: str  # FASTBERT_CPU_INT8: auto (quantized GEMMs in int8 where measured faster), on, or off (float32)
    interpreter: bool  # TRITON_INTERPRET set: Triton may run CPU tensors (through its interpreter)


_settings: Settings | None = None


def _read(name: str, allowed: tuple[str, ...]) -> str:
    value = os.environ.get(name, "auto").strip().lower() or "auto"
    if value not in allowed:
        raise ValueError(f"{name}={value!r}: expected one of {', '.join(allowed)}")
    return value


def settings() -> Settings:
    """The environment's settings, read on first use (an invalid value raises ValueError naming the variable)."""
    global _settings
    if _settings is None:
        _settings = Settings(
            backend=_read(ENV_BACKEND, ("auto", "torch", "triton")),
            cpu_gemm=_read(ENV_CPU_GEMM, ("auto", "onednn", "torch")),
            cpu_int8=_read(ENV_CPU_INT8, ("auto", "on", "off")),
            interpreter=os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
        )
    return _settings


def reload_settings() -> None:
    """Have the next forward read the environment again (after changing ``FASTBERT_BACKEND``, ``FASTBERT_CPU_GEMM``,
    ``FASTBERT_CPU_INT8`` or ``TRITON_INTERPRET`` at run time). CUDA graphs captured before keep what they captured."""
    global _settings
    _settings = None


def requested_backend() -> str:
    return settings().backend


def requested_cpu_gemm() -> str:
    """``FASTBERT_CPU_GEMM=auto|onednn|torch``: the CPU GEMM library (auto: the faster one measured here)."""
    return settings().cpu_gemm


def triton_interpreter() -> bool:
    return settings().interpreter


_TRITON_MISSING = None if importlib.util.find_spec("triton") else "triton is not installed"


def _triton_reasons(device: torch.device, dtype: torch.dtype) -> list[str]:
    reasons = []
    if _TRITON_MISSING:
        reasons.append(_TRITON_MISSING)
    if device.type == "cpu" and not triton_interpreter():
        reasons.append("CPU tensors run Triton only under TRITON_INTERPRET=1")
    elif device.type not in ("cpu", "cuda"):
        reasons.append(f"device {device.type} is not supported by Triton here")
    if dtype not in _CUDA_DTYPES:
        reasons.append(f"dtype {dtype} not supported")
    return reasons


def _ext_reasons(device: torch.device, dtype: torch.dtype) -> list[str]:
    if device.type == "cuda":
        reasons = list(_extension.cuda_unavailable_reasons(device))
        if dtype not in _CUDA_DTYPES:
            reasons.append(f"dtype {dtype} not supported")
        return reasons
    if device.type == "cpu":
        reasons = list(_extension.cpu_unavailable_reasons())
        if dtype not in _CPU_EXT_DTYPES:
            reasons.append(f"the C++ CPU kernel takes float32/bfloat16, not {dtype}")
        return reasons
    return [f"device {device.type} is not supported by the extension"]


def _attention_ext_reasons() -> list[str]:
    """Why the C++ CPU attention does not run here: unavailable, or measured slower than SDPA on this CPU."""
    reasons = _extension.attention_cpu_unavailable_reasons()
    if not reasons:
        try:
            slower = cpu.attention_slower_reason()
        except RuntimeError as error:  # the kernel refusing this CPU: SDPA, never a failed forward
            return [f"the C++ CPU attention failed here: {error}"]
        if slower:
            reasons.append(MeasuredChoice(slower))
    return reasons


class MeasuredChoice(str):
    """A reason that is this machine's measured choice between two exact implementations, not a fallback: reported
    by ``fastbert.info()``, never warned."""


def candidates(op: str, device: torch.device, dtype: torch.dtype) -> dict[str, list[str]]:
    """backend -> reasons it does not apply (empty list: it applies), fastest first, ignoring overrides."""
    ext = "cuda-ext" if device.type == "cuda" else "cpu-ext"
    options: dict[str, list[str]] = {}
    if op == "gemm":
        # The GEMMs themselves: cuBLAS through F.linear on a GPU; on CPU oneDNN with prepacked weights and fused
        # epilogues where it is available and measured faster than torch's default (MKL) here.
        if device.type == "cpu":
            options["onednn"] = _onednn_reasons(dtype)
        options["torch"] = []
        return options
    if op == "embedding":
        options[ext] = _ext_reasons(device, dtype)
    if op == "attention" and device.type == "cpu" and dtype == torch.float32:
        # (bfloat16 takes torch's flash SDPA, which keeps its scores in float32 too)
        options[ext] = _attention_ext_reasons()
    if device.type == "cpu" and op != "embedding" and not triton_interpreter():
        # On CPU, torch's own ops (oneDNN GEMMs, SDPA, fused LayerNorm) are the fast path for everything but the
        # embedding gather; Triton runs on CPU only through its interpreter, for testing.
        options["triton"] = ["on CPU the torch ops are the fast path (Triton only under TRITON_INTERPRET=1)"]
    else:
        options["triton"] = _triton_reasons(device, dtype)
    options["torch"] = []
    return options


def _onednn_reasons(dtype: torch.dtype) -> list[str]:
    reasons = cpu_gemm.unavailable_reasons(dtype)
    requested = requested_cpu_gemm()
    if requested == "torch":
        reasons.append(f"{ENV_CPU_GEMM}=torch")
    elif not reasons and requested == "auto":
        try:
            slower = cpu.onednn_slower_reason(dtype)
        except RuntimeError as error:  # oneDNN refusing this CPU or dtype: keep F.linear, never fail the forward
            return [f"oneDNN linear failed here: {error}"]
        if slower:
            reasons.append(slower)
    return reasons


def choose(op: str, tensor: torch.Tensor, needs_reference: str | None = None) -> str:
    """Backend for ``op`` on tensors like ``tensor``. ``needs_reference`` says why this call must run the torch
    reference ops (gradients, dropout, an activation without a kernel), if it must. A fallback from a faster backend
    is announced (warned once, counted every time). A dict lookup after the first call with the same arguments and
    settings (no device sync)."""
    backend, warning = resolve(op, tensor, needs_reference)
    if warning:
        announce.fallback(warning)
    return backend


def why_reference(*tensors, dropout_p: float = 0.0) -> str | None:
    """Why a call on ``tensors`` must run the torch reference ops instead of a fused kernel, or None."""
    # (isinstance: a quantized module's ``weight`` is a method, an offloaded one's may be missing)
    if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors):
        return ("gradients are required and the fused kernels are forward-only (same math, differentiable); "
                "for inference wrap the call in torch.inference_mode()")
    if dropout_p > 0:
        return "dropout is active (train mode)"
    return None


def why_not_prepacked(x: torch.Tensor, weights: tuple) -> str | None:
    """Why a CPU GEMM of ``x`` with ``weights`` cannot run on weights prepacked beside their parameters (oneDNN's
    fp32 packing, int8), or None: compiled and exported graphs, autocast (it would not reach the packed op) and
    torch.func transforms keep F.linear, and a weight that is not the module's parameter has no cache."""
    if torch.compiler.is_compiling() or exporting():
        return "compiled and exported graphs keep F.linear"
    if torch.is_autocast_enabled("cpu") or torch._C._functorch.is_functorch_wrapped_tensor(x):
        return "autocast and torch.func transforms run F.linear"
    if not all(type(w) is torch.nn.Parameter for w in weights):
        return "a weight that is not the module's parameter has no prepacked copy"
    return None


def resolve(op: str, tensor: torch.Tensor, needs_reference: str | None = None) -> tuple[str, str | None]:
    """``choose``'s answer without announcing: (backend, the fallback to announce on each call that runs it, or
    None). For callers that keep the decision and announce when they run it (``ops.py``)."""
    if exporting() or (op == "gemm" and torch.compiler.is_compiling()):
        return "torch", None  # exporters trace plain torch ops: no custom op reaches an ONNX or ExportedProgram graph
    env = _settings or settings()
    key = (op, tensor.device, tensor.dtype, needs_reference, env.backend, env.interpreter,
           (env.cpu_gemm, torch.backends.mkldnn.enabled) if op == "gemm" else None)
    if key not in _decisions:
        _decisions[key] = _decide(*key)
    return _decisions[key]


def exporting() -> bool:
    """Whether the forward is being exported (``torch.export``, either ``torch.onnx.export``, ``torch.jit.trace``)."""
    is_exporting = getattr(torch.compiler, "is_exporting", None)
    return bool(
        (is_exporting is not None and is_exporting())
        or torch.jit.is_tracing()
        or torch.onnx.is_in_onnx_export()
    )


def capturing() -> bool:
    """Whether a CUDA graph is being captured on the current stream (reading device data is then an error)."""
    # (not while compiling: dynamo would trace the query into the graph, and a capture never compiles)
    return not torch.compiler.is_compiling() and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


_decisions: dict[tuple, tuple[str, str | None]] = {}  # resolve()'s key -> (backend, warning to announce)


def _decide(op, device, dtype, needs_reference, requested, interpreter, cpu_gemm) -> tuple[str, str | None]:
    """cpu_gemm: (FASTBERT_CPU_GEMM, torch.backends.mkldnn.enabled) for the gemm op, else None."""
    if requested == "torch":
        return "torch", None
    options = candidates(op, device, dtype)
    if op == "gemm":  # FASTBERT_BACKEND=triton selects kernels for the other ops; the GEMM library is measured
        best = next(b for b, reasons in options.items() if not reasons)
        if needs_reference:
            return "torch", None
        if cpu_gemm[0] == "onednn" and best != "onednn":  # forced where it cannot run: F.linear there, said
            return best, (f"{ENV_CPU_GEMM}=onednn, but oneDNN cannot run {dtype} GEMMs here ("
                          + "; ".join(options["onednn"]) + "): torch's F.linear runs them")
        # Keeping F.linear (what transformers runs) is never slower than HF nor less precise: reported by
        # fastbert.info(), not warned.
        return best, None
    best = next(b for b, reasons in options.items() if not reasons)
    if requested == "triton" and options["triton"]:  # forced where it cannot run: the best that can, said
        return best, (f"{ENV_BACKEND}=triton, but Triton cannot run {op} on {device.type} {dtype} here ("
                      + "; ".join(options["triton"]) + f"): {best} runs it")
    if requested == "triton":
        best = "triton"
    if needs_reference and best != "torch":
        return "torch", f"{op} runs the torch reference ops instead of {best}: {needs_reference}"
    # On CPU, skipping Triton is the design (torch ops are the fast path there), not a fallback to report.
    skipped = [b for b in list(options)[: list(options).index(best)] if (b != "triton" or device.type == "cuda")
               and not all(isinstance(reason, MeasuredChoice) for reason in options[b])]
    if requested == "auto" and skipped:
        return best, f"{op} is not using {skipped[0]}: {'; '.join(options[skipped[0]])}"
    return best, None


def report(device: torch.device, dtype: torch.dtype) -> tuple[dict[str, str], dict[str, list[str]]]:
    """(op -> backend that runs, op -> why faster backends were skipped) for tensors of this device and dtype."""
    backends, reasons = {}, {}
    requested = requested_backend()
    for op in OPS:
        options = candidates(op, device, dtype)
        if requested == "torch":
            backends[op], reasons[op] = "torch", [f"{ENV_BACKEND}=torch"]
            continue
        if requested == "triton" and op != "gemm" and not options["triton"]:
            backends[op], reasons[op] = "triton", [f"{ENV_BACKEND}=triton"]
            continue
        order = list(options)
        chosen = next(b for b in order if not options[b])
        backends[op] = chosen
        reasons[op] = [f"{b}: {'; '.join(options[b])}" for b in order[: order.index(chosen)]]
    return backends, reasons

