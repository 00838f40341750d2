"""The one place that decides which implementation runs an op: a loop over the backends the op declares.

Each op's module declares its backends as data, fastest first, and registers them here:

    BACKENDS = dispatch.register("layer_norm", [
        Backend("triton", run=..., unavailable=triton_unavailable, why_not=needs_reference_or_plain),
        Backend("torch", run=...),                      # always applies: transformers' own modules and torch ops
    ])
    decision = dispatch.decide("layer_norm", BACKENDS, call)     # ``call``: this call's modules and tensor facts
    decision(x, residual)                                        # runs the chosen backend

A backend states why it cannot run, twice: ``unavailable(device, dtype)`` for what the machine, the build and the
settings rule out (an extension not built for this GPU, a dtype without a kernel, a library measured slower here),
and ``why_not(call)`` for what this call's inputs rule out (gradients, dropout, a module wrapped by PEFT or hooks, a
head dim past the kernel's limit, an activation without a kernel). ``decide`` takes the first backend without a
reason; it reads nothing but its arguments and the settings, and changes nothing. The forward's plan (``plan.py``)
keeps each decision, a named backend with its call, while nothing it read has changed.

Settings: ``FASTBERT_BACKEND=auto|torch|triton`` (``torch`` runs every op's ``torch`` backend; ``triton`` prefers the
``triton`` backend wherever an op has one and it can run), ``FASTBERT_CPU_GEMM=auto|onednn|native|torch`` and
``FASTBERT_CPU_INT8=auto|on|off`` (read by the GEMM backends), ``FASTBERT_CPU_REPLAY=auto|off`` (``replay/``). The
environment is read once, at the first forward (``reload_settings()`` reads it again). A skipped faster backend is
warned once, with its reasons, unless every reason is a ``MeasuredChoice`` (this machine measured the other faster) or
``ByDesign`` (Triton on a CPU, where torch's ops are the fast path); every reason met reaches ``fastbert.info()``.
"""

import dataclasses
import importlib.util
import os
import threading
from collections.abc import Callable, Sequence

import torch

from . import announce, run

ENV_BACKEND = "FASTBERT_BACKEND"
ENV_CPU_GEMM = "FASTBERT_CPU_GEMM"
ENV_CPU_INT8 = "FASTBERT_CPU_INT8"
ENV_CPU_REPLAY = "FASTBERT_CPU_REPLAY"


# --- settings ---------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Settings:
    backend: str  # FASTBERT_BACKEND: auto, torch or triton
    cpu_gemm: str  # FASTBERT_CPU_GEMM: auto, onednn, native or torch
    cpu_int8: str  # FASTBERT_CPU_INT8: auto (quantized GEMMs in int8 where measured faster), on, or off (float32)
    interpreter: bool  # TRITON_INTERPRET set: Triton may run CPU tensors (through its interpreter)
    cpu_replay: str  # FASTBERT_CPU_REPLAY: auto (replay/) or off


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
            cpu_gemm=_read(ENV_CPU_GEMM, ("auto", "onednn", "native", "torch")),
            cpu_int8=_read(ENV_CPU_INT8, ("auto", "on", "off")),
            interpreter=os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
            cpu_replay=_read(ENV_CPU_REPLAY, ("auto", "off")),
        )
    return _settings


def reload_settings() -> None:
    """Have the next forward read the environment again (after changing ``FASTBERT_BACKEND``, ``FASTBERT_CPU_GEMM``,
    ``FASTBERT_CPU_INT8``, ``FASTBERT_CPU_REPLAY`` or ``TRITON_INTERPRET`` at run time). CUDA graphs captured before
    keep what they captured."""
    global _settings
    _settings = None


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


# --- reasons ----------------------------------------------------------------------------------------------------------


class MeasuredChoice(str):
    """A reason that is this machine's measured choice between two exact implementations: reported, never warned."""


class ByDesign(str):
    """A reason that is the design, not a fallback (Triton on a CPU, where torch's ops are the fast path)."""


_TRITON_MISSING = None if importlib.util.find_spec("triton") else "triton is not installed"
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def triton_unavailable(device: torch.device, dtype: torch.dtype) -> list[str]:
    """Why the Triton kernels cannot run tensors of this device and dtype."""
    if device.type == "cpu" and not settings().interpreter:
        return [ByDesign("on CPU the torch ops are the fast path (Triton only under TRITON_INTERPRET=1)")]
    reasons = [_TRITON_MISSING] if _TRITON_MISSING else []
    if device.type not in ("cpu", "cuda"):
        reasons.append(f"device {device.type} is not supported by Triton here")
    if dtype not in _FLOAT_DTYPES:
        reasons.append(f"dtype {dtype} not supported")
    return reasons


def needs_reference(*tensors, dropout_p: float = 0.0) -> list[str]:
    """Why a call on ``tensors`` must run the differentiable torch ops instead of a fused kernel ([] when it need
    not): gradients, or active dropout."""
    # (isinstance: a quantized module's ``weight`` is a method, an offloaded one's may be missing)
    if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors):
        return ["gradients are required and the fused kernels are forward-only (same math, differentiable); for "
                "inference wrap the call in torch.inference_mode()"]
    if dropout_p > 0:
        return ["dropout is active (train mode)"]
    return []


# --- backends and decisions -------------------------------------------------------------------------------------------


def _never(*_) -> list[str]:
    return []


@dataclasses.dataclass(frozen=True)
class Backend:
    """One way to run an op. ``run(call, *tensors)``; ``unavailable(device, dtype)`` and ``why_not(call)`` give the
    reasons it cannot (empty lists: it can). ``devices`` and ``dtypes`` (None: any) say where it exists at all (a
    C++ CPU kernel is no candidate for a GPU tensor, and no reason is given for it there). ``opt_in``: it runs only
    calls that asked for it (the Linears ``fastbert.quantize`` chose), so it is never what a device and dtype run by
    default (``report``).

    ``declines(call, *tensors)``: None, or a function that may refuse one call at run time with a reason (what only
    the tensors tell: a dense batch whose padded rows the kernel cannot skip); the decision then runs the next
    backend that can, and counts it. ``steps``: every native call it makes is a replay step (``run.step``), or it
    makes none and only calls other ops, whose decisions are judged in turn: a recorded forward may contain it
    (``replay/``). ``per_call``: what it also depends on per call, where that is a choice (``report`` says it beside
    the backend it names for a device and dtype)."""

    name: str
    run: Callable
    unavailable: Callable[[torch.device, torch.dtype], list[str]] = _never
    why_not: Callable[[object], list[str]] = _never
    devices: tuple[str, ...] | None = None
    dtypes: tuple[torch.dtype, ...] | None = None
    opt_in: bool = False
    declines: Callable[..., str | None] | None = None
    steps: bool = False
    per_call: str | None = None

    def exists_for(self, device: torch.device, dtype: torch.dtype) -> bool:
        return (self.devices is None or device.type in self.devices) and (self.dtypes is None or dtype in self.dtypes)


@dataclasses.dataclass(frozen=True)
class Decision:
    """The backend an op runs for one call site, with that call's facts; called with the tensors. ``after``: the
    backends that can run the call too, in order, where the chosen one may decline a call (``Backend.declines``)."""

    op: str
    backend: Backend
    call: object
    warning: str | None = None
    after: tuple[Backend, ...] = ()

    def __call__(self, *tensors):
        if self.warning is not None:
            announce.fallback(self.warning)  # (warned once, counted each call)
        backend = self.backend
        if backend.declines is not None:
            backend = self._accepting(tensors)
        run.decided(self.op, backend, self.warning)
        return backend.run(self.call, *tensors)

    def _accepting(self, tensors: tuple) -> Backend:
        """The first backend, from the chosen one on, that does not decline this call; each decline counted."""
        for backend in (self.backend, *self.after):
            why = None if backend.declines is None else backend.declines(self.call, *tensors)
            if why is None:
                return backend
            _declined(self.op, backend.name, why)
        raise AssertionError(f"{self.op}: every backend declined (the last, torch, never does)")


_declines: dict[tuple[str, str, str], int] = {}  # (op, backend, why) -> calls it declined in this process


def _declined(op: str, backend: str, why: str) -> None:
    """A backend declined a call: counted for ``info()`` and for whoever watches the forward (the guard), and said
    once unless it is the design (``ByDesign``). Not while torch.compile traces (a graph counts nothing)."""
    if torch.compiler.is_compiling():
        return
    with _seen_lock:
        _declines[op, backend, why] = _declines.get((op, backend, why), 0) + 1
    run.count((op, backend, "declined"))
    if not isinstance(why, ByDesign):
        announce.fallback(f"{op} did not run {backend} on a call: {why}")


def declines() -> dict[str, int]:
    """``"op: backend declined (why)"`` -> the calls so declined in this process (the next backend ran them)."""
    with _seen_lock:
        return {f"{op}: {backend} declined ({why})": n for (op, backend, why), n in _declines.items()}


_registry: dict[str, tuple[Backend, ...]] = {}  # op -> its backends, fastest first
_seen: dict[str, dict[str, tuple[str, ...]]] = {}  # op -> backend -> the input-dependent reasons last met
_seen_lock = threading.Lock()


def register(op: str, backends: Sequence[Backend]) -> tuple[Backend, ...]:
    """Declare ``op``'s backends, fastest first; the last must always apply (``torch``). Returns them."""
    backends = tuple(backends)
    if not backends or backends[-1].name != "torch":
        raise ValueError(f"{op}: the last backend must be 'torch', which always applies")
    _registry[op] = backends
    return backends


def decide(op: str, backends: Sequence[Backend], call) -> Decision:
    """The first of ``backends`` that can run ``call`` (which has ``device`` and ``dtype``), as the settings allow."""
    requested = settings().backend
    if requested == "torch" or exporting():
        # (exporters trace plain torch ops: no custom op reaches an ONNX graph or an ExportedProgram)
        return Decision(op, backends[-1], call)
    if requested == "triton":  # (Triton first, where the op has it)
        backends = sorted(backends, key=lambda backend: backend.name != "triton")
    reasons: dict[str, list[str]] = {}
    chosen, rest = None, ()
    for at, backend in enumerate(backends):
        if not backend.exists_for(call.device, call.dtype):
            continue
        static = _unavailable(op, backend, call.device, call.dtype)
        dynamic = backend.why_not(call) if not static else []
        if dynamic and not all(isinstance(reason, ByDesign) for reason in dynamic) \
                and not torch.compiler.is_compiling():  # (a trace takes no lock: eager calls note the same)
            with _seen_lock:
                _seen.setdefault(op, {})[backend.name] = tuple(dynamic)
        if not static and not dynamic:
            chosen, rest = backend, backends[at + 1:]
            break
        reasons[backend.name] = static + dynamic
    after = () if chosen.declines is None else _able(op, rest, call)
    if requested == "triton" and "triton" in reasons:  # forced where it cannot run: the best that can, said
        return Decision(op, chosen, call, f"{ENV_BACKEND}=triton, but Triton cannot run {op} on "
                                          f"{call.device.type} {call.dtype} here ({'; '.join(reasons['triton'])}): "
                                          f"{chosen.name} runs it", after)
    skipped = [(name, why) for name, why in reasons.items()
               if not all(isinstance(reason, (MeasuredChoice, ByDesign)) for reason in why)]
    warning = f"{op} is not using {skipped[0][0]}: {'; '.join(skipped[0][1])}" if skipped else None
    return Decision(op, chosen, call, warning, after)


def _able(op: str, backends: Sequence[Backend], call) -> tuple[Backend, ...]:
    """Those of ``backends`` that can run ``call`` too (what a declining backend leaves it to), in order."""
    return tuple(b for b in backends if b.exists_for(call.device, call.dtype)
                 and not _unavailable(op, b, call.device, call.dtype) and not b.why_not(call))


_static: dict[tuple, list[str]] = {}  # what eager calls found each backend's ``unavailable`` to say, for compiled ones


def _unavailable(op: str, backend: Backend, device: torch.device, dtype: torch.dtype) -> list[str]:
    """``backend.unavailable(device, dtype)``; while torch.compile traces, what an eager call found it to say (a graph
    traces no store read or library query; without an eager call before, it is asked, as eagerly)."""
    current = settings()
    key = (op, backend.name, device.type, device.index, dtype, current.backend, current.cpu_gemm, current.cpu_int8,
           current.interpreter, torch.backends.mkldnn.enabled)
    if torch.compiler.is_compiling():
        return _static[key] if key in _static else backend.unavailable(device, dtype)
    _static[key] = reasons = backend.unavailable(device, dtype)
    return reasons


def report(device: torch.device, dtype: torch.dtype) -> tuple[dict[str, str], dict[str, list[str]]]:
    """(op -> the backend it runs on tensors of this device and dtype, op -> why faster backends were skipped: what
    the machine, build and settings rule out, and the input-dependent reasons met in this process)."""
    requested = settings().backend
    backends, reasons = {}, {}
    for op, declared in _registry.items():
        if requested == "torch":
            backends[op], reasons[op] = "torch", [f"{ENV_BACKEND}=torch"]
            continue
        order = [(b.name, b.unavailable(device, dtype)) for b in declared
                 if not b.opt_in and b.exists_for(device, dtype)]
        if requested == "triton":
            order.sort(key=lambda item: item[0] != "triton" or bool(item[1]))
        chosen = next(name for name, why in order if not why)
        backends[op] = chosen
        reasons[op] = [f"{name}: {'; '.join(why)}" for name, why in order[: [n for n, _ in order].index(chosen)]]
        per_call = next(b.per_call for b in declared if b.name == chosen)
        reasons[op] += [f"{chosen}: {per_call}"] if per_call else []
    with _seen_lock:
        for op, met in _seen.items():
            reasons.setdefault(op, [])
            reasons[op] += [f"{name} (some calls): {'; '.join(why)}" for name, why in met.items()]
    return backends, reasons


def ops() -> tuple[str, ...]:
    """The ops declared so far (every op of the fused layers once ``fastbert`` is imported)."""
    return tuple(_registry)
