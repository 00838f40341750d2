"""The MLP's first GEMM and its activation: ``act(dense(x))`` (BertIntermediate), x [tokens, hidden] -> [tokens, I].

Reference: ``kernels/activation.py``'s ``bias_act_ref``. Backends, as the op ``bias_act``:

  triton  the GEMM without its bias, then one kernel adding the bias and applying the activation (exact erf GELU,
          tanh GELU, ReLU); on a GPU, ReLU and the tanh GELU in cuBLASLt's epilogue instead, the output written once
  torch   the GEMM op (``gemm.linear``) with the activation in its epilogue where its backend has one (oneDNN,
          int8; the native GEMM's has the erf GELU, other activations run after it in transformers' math), else
          HF's activation module after it
"""

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from .. import dispatch
from ..dispatch import Backend
# (fastbert.kernels: the repository's top-level kernels/ folder, installed under that name by setup.py)
from ..kernels import activation as activation_kernels
from ..plain import is_plain
from ..plan import decided
from . import activation_name, gemm


def gemm_epilogue(activation: str | None, device: torch.device) -> bool | None:
    """``use_gelu`` for ``torch._addmm_activation`` where its epilogue computes exactly the model's activation, else
    None. ReLU everywhere; its GELU is the tanh approximation on CUDA (cuBLASLt's epilogue, or gelu(approximate="tanh")
    where cuBLASLt does not apply) but exact erf on CPU: tanh models (gelu_new, gelu_pytorch_tanh) fuse on CUDA only,
    and erf models (BERT's "gelu") keep the Triton bias+GELU kernel."""
    kind = activation_kernels.ACTIVATIONS.get(activation)
    if kind == "relu":
        return False
    if kind == "gelu_tanh" and device.type == "cuda":
        return True
    return None


@dataclasses.dataclass(frozen=True)
class Call:
    dense: nn.Module
    act_fn: nn.Module
    activation: str | None  # act_fn's name where the kernel computes it
    reasons: tuple[str, ...]
    device: torch.device
    dtype: torch.dtype


def _triton_run(call: Call, x: torch.Tensor) -> torch.Tensor:
    dense, activation = call.dense, call.activation
    if not is_plain(dense, nn.Linear, x.device):
        return activation_kernels.bias_act(dense(x), None, activation)
    use_gelu = gemm_epilogue(activation, x.device)
    if use_gelu is not None and dense.bias is not None:
        # bias + activation in the GEMM's epilogue (cuBLASLt): the [tokens, intermediate] output is written once
        return torch._addmm_activation(dense.bias, x, dense.weight.t(), use_gelu=use_gelu)
    return activation_kernels.bias_act(F.linear(x, dense.weight), dense.bias, activation)


def _torch_run(call: Call, x: torch.Tensor) -> torch.Tensor:
    return gemm.linear(x, call.dense, call.act_fn)


BACKENDS = dispatch.register("bias_act", [
    Backend("triton", run=_triton_run, unavailable=dispatch.triton_unavailable, why_not=lambda c: list(c.reasons)),
    Backend("torch", run=_torch_run, steps=True),  # (the GEMM op's decision is judged in turn)
])


def _decide(x: torch.Tensor, dense: nn.Module, act_fn: nn.Module):
    activation = activation_name(act_fn)
    reasons = dispatch.needs_reference(x, getattr(dense, "weight", None), getattr(dense, "bias", None))
    if activation_kernels.ACTIVATIONS.get(activation) not in activation_kernels.BIAS_ACT_KINDS:
        reasons = reasons or [f"activation {type(act_fn).__name__} has no fused kernel (HF's activation module runs)"]
    return dispatch.decide("bias_act", BACKENDS, Call(dense, act_fn, activation, tuple(reasons), x.device, x.dtype))


def dense_act(x: torch.Tensor, dense: nn.Module, act_fn: nn.Module) -> torch.Tensor:
    """act(dense(x)): BertIntermediate. ``act_fn`` is HF's activation module (the one the model holds decides)."""
    return decided(dense, "dense_act", _decide, x, dense, act_fn)(x)
