"""A post-norm layer's MLP: LayerNorm(dense_out(act(dense_in(x))) + x), BertIntermediate then BertOutput.

    mlp(x, intermediate, output)    x [tokens, hidden] -> [tokens, hidden]

Backends, as the op ``mlp``:

  int8   both GEMMs int8 (``fastbert.quantize``) and the second one's input with a static scale and no SmoothQuant
         divisor: the first GEMM writes that input as u8, quantized in its epilogue after its activation, so the
         [tokens, intermediate] activations are neither written in float32 nor read again to be quantized (at
         1024 x 768 -> 3072 on an Intel Xeon: 4.0 against 6.1 ms); then the second GEMM with the residual in its
         epilogue, and fastbert._C's LayerNorm handing its u8 to the next int8 GEMM (``norm.handing_off``).
         Reference: ``int8_linear.linear_ref`` of each GEMM, the first with ``output``; the epilogue rounds the
         activation in float32 before quantizing it, so a u8 may be a level from the float64 one where that crosses
         a tie (fastbert's int8 GEMM: the static quantizer's bytes of its float32 result).
  torch  the two ops, ``activation.dense_act`` then ``norm.dense_residual_layer_norm``, each on its own backends.
"""

import dataclasses

import torch
from torch import nn

from .. import dispatch, run
from ..int8 import choices as int8, linear as int8_linear
from ..cpu_gemm import EPILOGUES
from ..dispatch import Backend, ByDesign
from ..plan import decided
from . import activation_name, dropout_p, gemm, ln_class, norm, why_not_plain


@dataclasses.dataclass(frozen=True)
class Call:
    intermediate: nn.Module  # .dense, .intermediate_act_fn
    output: nn.Module  # .dense, .dropout, .LayerNorm
    activation: str | None  # the activation's name where oneDNN's epilogue computes it
    reasons: tuple[str, ...]  # why the int8 backend does not run it
    device: torch.device
    dtype: torch.dtype


def _int8_reasons(x: torch.Tensor, intermediate: nn.Module, output: nn.Module, activation: str | None) -> list[str]:
    dense_in, dense_out, layer_norm = intermediate.dense, output.dense, output.LayerNorm
    first, second = int8.chosen(dense_in), int8.chosen(dense_out)
    if first is None or second is None:
        return ["not both GEMMs quantized by fastbert.quantize"]
    if second.static is None or second.smooth is not None:
        return ["the second GEMM's input has no static scale of its own (per call, per token or SmoothQuant's)"]
    if first.per_token:
        return ["the first GEMM's input is scaled per token (its epilogue runs after the GEMM)"]
    if x.dtype != torch.float32:
        return [f"int8 GEMMs take a float32 model, not {x.dtype}"]
    if activation is None:
        return [f"no oneDNN epilogue computes {type(intermediate.intermediate_act_fn).__name__}"]
    weights = (dense_in.weight, dense_out.weight)
    return (dispatch.needs_reference(x, *weights, dense_in.bias, dense_out.bias, dropout_p=dropout_p(output.dropout))
            or why_not_plain(x.device, dense_in=(dense_in, nn.Linear), dense_out=(dense_out, nn.Linear),
                             LayerNorm=(layer_norm, ln_class(layer_norm)))
            or ([] if norm.trivial(output.dropout) else ["a dropout with hooks is called as a module"])
            or ([reason] if (reason := gemm.why_not_packed(x, weights)) else [])
            or int8.unavailable_reasons() or norm.layer_norm_cpu_unavailable_reasons())


def _int8_declines(call: Call, x: torch.Tensor) -> str | None:
    if int8.is_recording():
        return ByDesign("the int8 guard records the GEMM inputs' ranges, which needs the float32 activations")
    return None


def _int8_run(call: Call, x: torch.Tensor) -> torch.Tensor:
    dense_in, dense_out = call.intermediate.dense, call.output.dense
    first, second = int8.chosen(dense_in), int8.chosen(dense_out)
    h = int8_linear.linear(x, gemm.int8_weight(dense_in), dense_in.bias, call.activation, rows=run.token_rows(x),
                           static=first.static, output=second.static)  # u8 [tokens, intermediate]
    y = int8_linear.linear(h, gemm.int8_weight(dense_out), dense_out.bias, residual=x, static=second.static)
    return norm.handing_off(call.output.LayerNorm, y)


def _torch_run(call: Call, x: torch.Tensor) -> torch.Tensor:
    return call.output.fused(call.intermediate.fused(x), x)


BACKENDS = dispatch.register("mlp", [
    Backend("int8", run=_int8_run, why_not=lambda call: [ByDesign(r) for r in call.reasons], devices=("cpu",),
            opt_in=True, declines=_int8_declines, steps=True),
    Backend("torch", run=_torch_run, steps=True),  # (the ops bias_act and layer_norm, whose decisions are judged)
])


def _decide(x: torch.Tensor, intermediate: nn.Module, output: nn.Module):
    name = activation_name(intermediate.intermediate_act_fn)
    activation = name if name in EPILOGUES else None
    reasons = _int8_reasons(x, intermediate, output, activation) if x.device.type == "cpu" else []
    return dispatch.decide("mlp", BACKENDS, Call(intermediate, output, activation, tuple(reasons), x.device, x.dtype))


def mlp(x: torch.Tensor, intermediate: nn.Module, output: nn.Module) -> torch.Tensor:
    """LayerNorm(dense_out(act(dense_in(x))) + x): ``intermediate`` BertIntermediate-shaped (``dense``,
    ``intermediate_act_fn``), ``output`` BertOutput-shaped (``dense``, ``dropout``, ``LayerNorm``), both fastbert's."""
    return decided(output, "mlp", _decide, x, intermediate, output)(x)
