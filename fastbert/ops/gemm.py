"""The GEMMs of a layer, with what follows them fused where a backend can.

    linear(x, dense, act_fn, residual)    y = act(x @ W^T + b), or x @ W^T + b + residual        [tokens, out]
    stacked(x, linears)                   [y_1 | y_2 | ...] for Linears reading one input: QKV, GLU's [up; gate]

x: [tokens, in], W: [out, in]. Backends, fastest first:

  int8    a Linear ``fastbert.quantize`` chose, on the CPU: the int8 linear (``int8/linear.py``: fastbert's own
          GEMM for 7-bit weights, oneDNN's quantized linear for 8-bit ones) on its quantized weight (a derived
          cache), the bias, activation or residual in its epilogue; the input's scale per call, per token or
          static, as the guard chose
  onednn  a plain Linear on the CPU, where oneDNN measured faster than torch's F.linear here (``cpu.gemm_figures``):
          the weight prepacked in oneDNN's layout (a derived cache), the epilogue inside the GEMM
  native  a plain float32 Linear on the CPU, where fastbert's own GEMM (``native_gemm``) measured faster than F.linear
          and oneDNN here: the weight prepacked in its panels (a derived cache), the bias, erf GELU or residual in its
          epilogue
  torch   F.linear on a plain Linear's weights (a stacked weight is a derived cache, concatenated per call when
          gradients need to reach the parameters); a module that is not plain is called; the epilogue in torch ops
          and HF's activation module. Always applies: what transformers runs, and cuBLAS on a GPU.

The packed backends need the module's own parameters and eager code (``why_not_packed``); keeping F.linear is never
slower than transformers nor less precise, so it is reported, not warned.
"""

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from .. import cpu, cpu_gemm, derived, dispatch, native_gemm, run
from ..int8 import choices as int8, linear as int8_linear
from ..dispatch import Backend, ByDesign, MeasuredChoice
# (fastbert.kernels: the repository's top-level kernels/ folder, installed under that name by setup.py)
from ..kernels.activation import activation_ref
from ..plain import is_plain
from ..plan import decided
from . import activation_name


@dataclasses.dataclass(frozen=True)
class Call:
    """What a GEMM's decision reads: its Linears (side by side; the first owns the derived caches), the epilogue,
    and the facts about them and the input that choose a backend."""

    linears: tuple[nn.Module, ...]
    act_fn: nn.Module | None  # HF's activation module after the GEMM, or None
    activation: str | None  # its name where an epilogue computes it (kernels.activation.ACTIVATIONS)
    residual: bool  # a residual is added after the GEMM
    plain: bool  # every Linear is a plain nn.Linear (a kernel may read its weights)
    reference: tuple[str, ...]  # why only differentiable torch ops may run it (gradients)
    packed: str | None  # why its weights cannot be used prepacked (compile, export, autocast, torch.func)
    device: torch.device
    dtype: torch.dtype

    @property
    def owner(self) -> nn.Module:
        return self.linears[0]


def why_not_packed(x: torch.Tensor, weights: tuple) -> str | None:
    """Why a CPU GEMM of ``x`` with ``weights`` cannot run on weights prepacked beside their parameters (oneDNN's
    or the native GEMM's packing, int8), or None: compiled and exported graphs, autocast (it would not reach the
    packed op) and torch.func transforms keep F.linear, and a weight that is not the module's parameter has no
    cache."""
    if torch.compiler.is_compiling() or dispatch.exporting():
        return "compiled and exported graphs keep F.linear"
    if torch.is_autocast_enabled("cpu") or torch._C._functorch.is_functorch_wrapped_tensor(x):
        return "autocast and torch.func transforms run F.linear"
    if not all(type(w) is nn.Parameter for w in weights):
        return "a weight that is not the module's parameter has no prepacked copy"
    return None


def parameters(linears: tuple[nn.Module, ...]) -> tuple[torch.Tensor, ...] | None:
    """The weights, then the biases, of Linears whose outputs one GEMM computes side by side; no biases where none
    has one; None where some have a bias and others not (they then run one by one)."""
    weights, biases = tuple(m.weight for m in linears), [m.bias for m in linears]
    if all(b is None for b in biases):
        return weights
    return None if any(b is None for b in biases) else weights + tuple(biases)


def stack(count: int, *params: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``parameters`` of ``count`` Linears -> (weight [sum of outputs, in], bias [sum of outputs] or None)."""
    return torch.cat(params[:count]), torch.cat(params[count:]) if len(params) > count else None


# --- backends ---------------------------------------------------------------------------------------------------------


def _int8_why_not(call: Call) -> list[str]:
    if not all(int8.chosen(m) is not None for m in call.linears):
        return [ByDesign("not quantized by fastbert.quantize")]
    if call.reference:
        return ["int8 GEMMs run in float32 where gradients are required or dropout is active (training)"]
    if not call.plain:
        return ["a quantized Linear was wrapped or hooked since: it is called as a module"]
    if call.packed:
        return [f"int8 GEMMs run in float32: {call.packed}"]
    if call.dtype != torch.float32:
        return [f"int8 GEMMs run in float32: they take a float32 model, not {call.dtype}"]
    return [f"int8 GEMMs run in float32: {reason}" for reason in int8.unavailable_reasons()]


def int8_weight(linear: nn.Linear) -> int8_linear.QuantizedWeight:
    """A Linear chosen for int8: its quantized, prepacked weight (a derived cache)."""
    choice = int8.chosen(linear)
    return derived.cached(linear, "int8_weight", (linear.weight,), lambda w: int8_linear.quantize_weight(
        w, choice.bits, choice.smooth))


def _int8_run(call: Call, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
    choice, owner = int8.chosen(call.owner), call.owner
    int8.record(call.linears, x)
    if len(call.linears) == 1:
        weight, bias = int8_weight(owner), owner.bias
    else:
        def build(*params):
            weight, bias = stack(len(call.linears), *params)
            return int8_linear.quantize_weight(weight, choice.bits, choice.smooth), bias

        weight, bias = derived.cached(owner, "int8_stacked", parameters(call.linears), build)
    return _epilogue(call, int8_linear.linear(x, weight, bias, call.activation, residual, run.token_rows(x),
                                              choice.per_token, choice.static))


# The CPU GEMM libraries beside F.linear (FASTBERT_CPU_GEMM's values): what they are called, why they cannot run.
LIBRARIES = {"onednn": ("oneDNN", cpu_gemm.unavailable_reasons),
             "native": ("fastbert's CPU GEMM", native_gemm.unavailable_reasons)}


def library_unavailable(library: str, device: torch.device, dtype: torch.dtype) -> list[str]:
    """Why plain Linears' GEMMs of this dtype do not run on ``library`` (of ``LIBRARIES``) here (settings, build,
    measurement); [] if they do."""
    requested = dispatch.settings().cpu_gemm
    name, why_not = LIBRARIES[library]
    reasons = why_not(dtype)
    if requested == library and reasons:  # forced where it cannot run: said
        return [f"{dispatch.ENV_CPU_GEMM}={library}, but {name} cannot run {dtype} GEMMs here "
                f"({'; '.join(reasons)}): torch's F.linear runs them"]
    if requested not in ("auto", library):  # (F.linear is what transformers runs: reported, not warned)
        return [MeasuredChoice(f"{dispatch.ENV_CPU_GEMM}={requested}")]
    if reasons:
        return [MeasuredChoice(reason) for reason in reasons]
    if requested == "auto":
        try:
            slower = cpu.gemm_slower_reason(library, dtype)
        except RuntimeError as error:  # a library refusing this CPU or dtype: keep F.linear, never fail the forward
            return [MeasuredChoice(f"{name}'s linear failed here: {error}")]
        return [MeasuredChoice(slower)] if slower else []
    return []


def onednn_unavailable(device: torch.device, dtype: torch.dtype) -> list[str]:
    return library_unavailable("onednn", device, dtype)


def native_unavailable(device: torch.device, dtype: torch.dtype) -> list[str]:
    return library_unavailable("native", device, dtype)


def _packed_why_not(call: Call) -> list[str]:
    if call.reference or not call.plain:
        return [ByDesign("the GEMM runs as transformers runs it (gradients, or a wrapped Linear)")]
    return [ByDesign(call.packed)] if call.packed else []


def _epilogue(call: Call, y: torch.Tensor) -> torch.Tensor:
    """HF's activation module after a GEMM whose epilogue could not compute it (an activation oneDNN lacks)."""
    return y if call.act_fn is None or call.activation is not None else call.act_fn(y)


def _packed_run(library: str, pack, linear):
    """The run of a backend whose GEMM reads its weight prepacked by ``pack`` (a derived cache named after
    ``library``) and computes the bias and the activation or residual with ``linear``."""

    def run_gemm(call: Call, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        owner = call.owner
        if len(call.linears) == 1:
            packed, bias = derived.cached(owner, f"{library}_weight", (owner.weight,), pack), owner.bias
        else:
            def build(*params):
                weight, bias = stack(len(call.linears), *params)
                return pack(weight), bias

            packed, bias = derived.cached(owner, f"{library}_stacked", parameters(call.linears), build)
        return _epilogue(call, linear(x, packed, bias, call.activation, residual))

    return run_gemm


@run.step
def _f_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor | None,
              activation: str | None) -> torch.Tensor:
    """F.linear, then the residual or the activation (by name: ``activation_ref``, transformers' math): the torch
    backend's inference GEMM as one step of a CPU replay."""
    y = F.linear(x, weight, bias)
    if residual is not None:
        y += residual
    return y if activation is None else activation_ref(y, activation)


def _torch_run(call: Call, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
    linears = call.linears
    if call.plain and not call.reference and (call.act_fn is None or call.activation is not None):
        weight, bias = (linears[0].weight, linears[0].bias) if len(linears) == 1 else derived.cached(
            call.owner, "stacked", parameters(linears), lambda *params: stack(len(linears), *params))
        return _f_linear(x, weight, bias, residual, call.activation)
    if not call.plain:
        y = linears[0](x) if len(linears) == 1 else torch.cat([m(x) for m in linears], dim=-1)
    elif len(linears) == 1:
        y = F.linear(x, linears[0].weight, linears[0].bias)
    else:
        # Training: the weights are about to change, possibly through buffers that alias them (ZeRO, FSDP) where no
        # version counter sees it: the inference caches go, and gradients reach the parameters through the cat.
        for library in ("", *(f"{name}_" for name in LIBRARIES)):
            derived.discard(call.owner, f"{library}stacked")
        y = F.linear(x, *stack(len(linears), *parameters(linears)))
    if residual is not None:
        y = y + residual
    return y if call.act_fn is None else call.act_fn(y)


BACKENDS = dispatch.register("gemm", [
    Backend("int8", run=_int8_run, why_not=_int8_why_not, devices=("cpu",), opt_in=True, steps=True),
    Backend("onednn", run=_packed_run("onednn", cpu_gemm.pack, cpu_gemm.linear), unavailable=onednn_unavailable,
            why_not=_packed_why_not, devices=("cpu",), steps=True),
    Backend("native", run=_packed_run("native", native_gemm.pack, native_gemm.linear), unavailable=native_unavailable,
            why_not=_packed_why_not, devices=("cpu",), steps=True),
    # (steps in inference on plain Linears; a module it calls, or the ops of training, fail a replay's capture)
    Backend("torch", run=_torch_run, steps=True),
])


def _decide(x: torch.Tensor, linears: tuple[nn.Module, ...], act_fn: nn.Module | None, residual: bool):
    plain = all(is_plain(m, nn.Linear, x.device) for m in linears)
    params = parameters(linears) if plain else None
    plain = params is not None
    activation = None if act_fn is None else activation_name(act_fn)
    call = Call(linears, act_fn, activation if activation in cpu_gemm.EPILOGUES else None, residual, plain,
                tuple(dispatch.needs_reference(x, *(params or ()))), why_not_packed(x, params) if plain else None,
                x.device, x.dtype)
    return dispatch.decide("gemm", BACKENDS, call)


def linear(x: torch.Tensor, dense: nn.Module, act_fn: nn.Module | None = None,
           residual: torch.Tensor | None = None) -> torch.Tensor:
    """``act_fn(dense(x))``, or ``dense(x) + residual`` (not both): x [tokens, in] -> [tokens, out]."""
    decision = decided(dense, ("gemm", act_fn is not None, residual is not None), _decide, x, (dense,), act_fn,
                       residual is not None)
    return decision(x, residual)


def stacked(x: torch.Tensor, linears: tuple[nn.Module, ...]) -> torch.Tensor:
    """[tokens, in] -> [tokens, sum of outputs]: ``linears`` (reading the same input) side by side, one GEMM where
    they are plain and all have a bias or none does, each called otherwise."""
    return decided(linears[0], "stacked gemm", _decide, x, linears, None, False)(x)


def packed(x: torch.Tensor, linears: tuple[nn.Module, ...]) -> bool:
    """Whether the GEMM of ``linears`` (side by side) runs prepacked here (oneDNN, native or int8): then one GEMM on
    their stacked weight is the fast way, where F.linear may prefer them one by one (``ops/glu.py``)."""
    if len(linears) == 1:
        decision = decided(linears[0], ("gemm", False, False), _decide, x, linears, None, False)
    else:
        decision = decided(linears[0], "stacked gemm", _decide, x, linears, None, False)
    return decision.backend.name in ("int8", "onednn", "native")


def onednn_runs(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether oneDNN runs plain Linears' GEMMs of this device and dtype here (settings, build, measurement)."""
    return device.type == "cpu" and dispatch.settings().backend != "torch" and not onednn_unavailable(device, dtype)
