"""The GLU MLP's first half: act(one half) * the other half of one GEMM's output, or of two GEMMs'.

    dense_glu(x, up, gate, act_fn)     act(gate(x)) * up(x), gate and up two Linears (GTE, NomicBERT): the stacked
                                       GEMM's output is [up | gate], the second half activated
    linear_glu(x, wi, act_fn, half)    act(a) * b for [a | b] = wi(x) (ModernBERT: the first half activated)

x [tokens, hidden] -> [tokens, intermediate]. Reference: ``kernels/glu.py``'s ``glu_ref``. Backends, as the op
``glu``:

  triton  one GEMM on the stacked weight [up; gate] (a derived cache), or on Wi without its bias, then the act-and-mul
          kernel (which adds the bias)
  torch   one GEMM where the GEMM op runs it prepacked (oneDNN, native, int8: ``gemm.packed``), then HF's activation
          module on one half times the other; otherwise two GEMMs with contiguous outputs, as transformers runs them
          (on a CPU the activation of a contiguous half runs vectorized, of a strided one 3x slower for SiLU on Zen 4,
          and MKL ran [I, hidden] twice faster than [2I, hidden] once: 52.7 vs 55.8 ms at 1024 x 768 -> 3072, 2
          threads); a wrapped Linear is called
"""

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from .. import derived, dispatch
from ..dispatch import Backend
# (fastbert.kernels: the repository's top-level kernels/ folder, installed under that name by setup.py)
from ..kernels import glu as glu_kernels
from ..plain import is_plain
from ..plan import decided
from . import activation_name, gemm


@dataclasses.dataclass(frozen=True)
class Call:
    linears: tuple[nn.Module, ...]  # (up, gate), or (wi,)
    act_fn: nn.Module
    activation: str | None  # act_fn's name where the kernel computes it
    activated_half: int  # 1 for [up | gate], 0 for ModernBERT's [input | gate]
    plain: bool
    reasons: tuple[str, ...]  # why only the modules and torch's ops may run it (gradients, no kernel)
    device: torch.device
    dtype: torch.dtype


def _mul(activated: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """activated * other, in place into ``activated`` (the activation's fresh output) unless autograd records it."""
    return activated * other if torch.is_grad_enabled() and (activated.requires_grad or other.requires_grad) \
        else activated.mul_(other)


def _halves(call: Call, h: torch.Tensor) -> torch.Tensor:
    halves = h.chunk(2, dim=-1)
    return call.act_fn(halves[call.activated_half]) * halves[1 - call.activated_half]


def _triton_run(call: Call, x: torch.Tensor) -> torch.Tensor:
    if len(call.linears) == 2:
        weight, bias = derived.cached(call.linears[1], "glu_stacked", gemm.parameters(call.linears),
                                      lambda *params: gemm.stack(2, *params))
        return glu_kernels.glu(F.linear(x, weight), bias, call.activation, 1)
    wi = call.linears[0]  # (the GEMM without its bias: the kernel adds it)
    return glu_kernels.glu(F.linear(x, wi.weight), wi.bias, call.activation, call.activated_half)


def _torch_run(call: Call, x: torch.Tensor) -> torch.Tensor:
    if not call.plain:
        if len(call.linears) == 2:
            up, gate = call.linears
            return call.act_fn(gate(x)) * up(x)
        return _halves(call, call.linears[0](x))
    if gemm.packed(x, call.linears):  # one GEMM, prepacked
        h = gemm.stacked(x, call.linears) if len(call.linears) == 2 else gemm.linear(x, call.linears[0])
        return _halves(call, h)
    if len(call.linears) == 2:
        up, gate = call.linears
        return _mul(call.act_fn(F.linear(x, gate.weight, gate.bias)), F.linear(x, up.weight, up.bias))
    wi = call.linears[0]  # one GEMM per half, on row views of Wi (no copy)
    weights, biases = wi.weight.chunk(2), (None, None) if wi.bias is None else wi.bias.chunk(2)
    halves = [F.linear(x, w, b) for w, b in zip(weights, biases)]
    return _mul(call.act_fn(halves[call.activated_half]), halves[1 - call.activated_half])


def _triton_why_not(call: Call) -> list[str]:
    if call.reasons:
        return list(call.reasons)
    return [] if call.plain else ["a wrapped up/gate Linear is called as a module"]


BACKENDS = dispatch.register("glu", [
    Backend("triton", run=_triton_run, unavailable=dispatch.triton_unavailable, why_not=_triton_why_not),
    Backend("torch", run=_torch_run),
])


def _decide(x: torch.Tensor, linears: tuple[nn.Module, ...], act_fn: nn.Module, activated_half: int):
    plain = all(is_plain(m, nn.Linear, x.device) for m in linears) and gemm.parameters(linears) is not None
    activation = activation_name(act_fn)
    weights = [getattr(m, name, None) for m in linears for name in ("weight", "bias")]
    reasons = dispatch.needs_reference(x, *weights)
    if activation not in glu_kernels.GLU_ACTIVATIONS:
        reasons = reasons or [f"activation {type(act_fn).__name__} has no GLU kernel (HF's module runs)"]
    return dispatch.decide("glu", BACKENDS, Call(linears, act_fn, activation, activated_half, plain, tuple(reasons),
                                                 x.device, x.dtype))


def dense_glu(x: torch.Tensor, up: nn.Module, gate: nn.Module, act_fn: nn.Module) -> torch.Tensor:
    """x [N, hidden] -> act_fn(gate(x)) * up(x) [N, intermediate] (GTE's and NomicBERT's MLP before ``down``)."""
    return decided(gate, "dense_glu", _decide, x, (up, gate), act_fn, 1)(x)


def linear_glu(x: torch.Tensor, wi: nn.Module, act_fn: nn.Module, activated_half: int = 0) -> torch.Tensor:
    """x [N, hidden] -> act(a) * b [N, intermediate], [a | b] = wi(x) [N, 2 * intermediate] with a the half number
    ``activated_half`` (ModernBERT's ``input, gate = Wi(h).chunk(2); act(input) * gate``: 0)."""
    return decided(wi, "linear_glu", _decide, x, (wi,), act_fn, activated_half)(x)
