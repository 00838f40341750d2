"""The GLU MLP's first half: one GEMM computing both halves, then act(one half) * the other, by the act-and-mul
kernel (``kernels/glu.py``) or the torch reference (HF's activation module on one half, times the other).

- ``dense_glu``: act(gate(x)) * up(x) with gate and up two Linears (GTE, NomicBERT), run for the kernel (and
  oneDNN) as one GEMM on their weights stacked [up; gate] (a derived cache, as the QKV projection's): the second half
  activated.
- ``linear_glu``: act(a) * b for [a | b] = Wi(x), one Linear of twice the width (ModernBERT): the first half
  activated; Wi's bias, where it has one, is added by the kernel.
With torch's F.linear (CPU without oneDNN, or gradients) both run two GEMMs with contiguous outputs instead.
"""

import torch
import torch.nn.functional as F
from torch import nn

from . import derived, dispatch, int8
from . import cpu_gemm
from .kernels import glu as glu_kernels
from .ops import counted, linear, onednn_applies, stack_linears, stacked_parameters
from .plain import has_hooks, is_plain
from .plan import decided


def _glu_activations() -> dict[type, str]:
    from transformers.activations import ACT2FN

    return {type(ACT2FN[name]): name for name in glu_kernels.GLU_ACTIVATIONS}


# HF's activation module types -> the GLU kernel's name for them (the module the model holds decides).
_ACTIVATION_NAMES = _glu_activations()


def dense_glu(x: torch.Tensor, up: nn.Module, gate: nn.Module, act_fn: nn.Module) -> torch.Tensor:
    """x [N, hidden] -> act_fn(gate(x)) * up(x) [N, intermediate] (GTE's and NomicBERT's MLP before ``down``)."""
    return decided(gate, "dense_glu", _how_dense_glu, x, up, gate, act_fn)(x)


def _how_dense_glu(x: torch.Tensor, up: nn.Module, gate: nn.Module, act_fn: nn.Module):
    plain = is_plain(up, nn.Linear, x.device) and is_plain(gate, nn.Linear, x.device)
    params = stacked_parameters(up, gate) if plain else None
    if params is None:
        # A wrapper (LoRA) may later merge into the Linear it wraps through ``.data``: the stacked copy goes now.
        derived.clear(gate)
        return lambda x: act_fn(gate(x)) * up(x)
    why = dispatch.why_reference(x, *params)
    act_and_mul, warning = _act_and_mul(x, act_fn, 1, why)  # h [N, 2 * I] = [up | gate]
    if act_and_mul.kernel:
        def run(x):
            return act_and_mul(F.linear(x, *derived.cached(gate, "glu_weight", stacked_parameters(up, gate), _stack)))
    elif why is None and x.device.type == "cpu" and (quantized := int8.stacked_gemm(
            x, gate, (up, gate), lambda: stacked_parameters(up, gate), _stack)):
        def run(x):
            return act_and_mul(quantized(x))
    elif why is None and x.device.type == "cpu" and onednn_applies(x, params):
        def run(x):
            weight, bias = derived.cached(gate, "glu_onednn", stacked_parameters(up, gate), _stack_and_pack)
            return act_and_mul(cpu_gemm.linear(x, weight, bias))
    else:
        # F.linear (CPU), or gradients: two GEMMs as transformers runs them. On CPU their contiguous outputs also
        # run the activation vectorized (a half of one [N, 2I] output is strided: 3x slower for SiLU on Zen 4), and
        # MKL ran [I, hidden] twice faster than [2I, hidden] once (52.7 vs 55.8 ms at 1024 x 768 -> 3072, 2 threads).
        derived.discard(gate, "glu_weight")
        derived.discard(gate, "glu_onednn")

        def run(x):
            return _mul(act_fn(F.linear(x, gate.weight, gate.bias)), F.linear(x, up.weight, up.bias), why)

    return counted(run, warning)


def linear_glu(x: torch.Tensor, wi: nn.Module, act_fn: nn.Module, activated_half: int = 0) -> torch.Tensor:
    """x [N, hidden] -> act(a) * b [N, intermediate], [a | b] = wi(x) [N, 2 * intermediate] with a the half number
    ``activated_half`` (ModernBERT's ``input, gate = Wi(h).chunk(2); act(input) * gate``: 0)."""
    return decided(wi, "linear_glu", _how_linear_glu, x, wi, act_fn, activated_half)(x)


def _how_linear_glu(x, wi, act_fn, activated_half):
    bias = getattr(wi, "bias", None)
    why = dispatch.why_reference(x, getattr(wi, "weight", None), bias)
    act_and_mul, warning = _act_and_mul(x, act_fn, activated_half, why)
    plain = is_plain(wi, nn.Linear, x.device)
    if act_and_mul.kernel and plain:  # the GEMM without its bias: the kernel adds it
        return counted(lambda x: act_and_mul(F.linear(x, wi.weight), wi.bias), warning)
    one_gemm = why is None and (onednn_applies(x, (wi.weight,)) or int8.gemm(x, wi) is not None)
    if not act_and_mul.kernel and plain and not one_gemm:
        # F.linear: one GEMM per half, on row views of Wi (no copy), for the reasons ``_how_dense_glu`` gives
        def run(x):
            weights, biases = wi.weight.chunk(2), (None, None) if wi.bias is None else wi.bias.chunk(2)
            halves = [F.linear(x, w, b) for w, b in zip(weights, biases)]
            return _mul(act_fn(halves[activated_half]), halves[1 - activated_half], why)

        return counted(run, warning)
    return counted(lambda x: act_and_mul(linear(x, wi)), warning)


def _mul(activated: torch.Tensor, other: torch.Tensor, why: str | None) -> torch.Tensor:
    """activated * other, in place into ``activated`` (the activation's fresh output) unless autograd records it."""
    return activated * other if why is not None else activated.mul_(other)


def _act_and_mul(x: torch.Tensor, act_fn: nn.Module, activated_half: int, why: str | None):
    """(run(h, bias=None) -> act(half ``activated_half`` of h + bias) * the other half, with ``run.kernel`` telling
    whether the Triton kernel runs it; the fallback warning to announce, or None)."""
    activation = None if has_hooks(act_fn) else _ACTIVATION_NAMES.get(type(act_fn))
    backend, warning = dispatch.resolve("glu", x, why or (
        None if activation else f"activation {type(act_fn).__name__} has no GLU kernel (HF's module runs)"))

    def run(h, bias=None):
        if backend == "triton":
            return glu_kernels.glu(h, bias, activation, activated_half)
        halves = (h if bias is None else h + bias).chunk(2, dim=-1)
        return act_fn(halves[activated_half]) * halves[1 - activated_half]

    run.kernel = backend == "triton"
    return run, warning


def _stack(*params) -> tuple[torch.Tensor, torch.Tensor | None]:
    return stack_linears(2, *params)  # [up; gate]: weight [2 * I, hidden], bias [2 * I] or None


def _stack_and_pack(*params) -> tuple[torch.Tensor, torch.Tensor | None]:
    weight, bias = stack_linears(2, *params)
    return cpu_gemm.pack(weight), bias
