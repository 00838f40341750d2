"""The ops of an encoder layer, one module each: what the model calls, and the backends each op declares.

    gemm.py        linear: QKV stacked, dense + activation or residual in the epilogue  int8, onednn, native, torch
    embedding.py   LayerNorm(word[ids] + position[pos] + token_type[tt])                cuda-ext, cpu-ext, triton, torch
    attention.py   softmax(q k^T / sqrt(d) + bias) v over each sequence's tokens        cpu-int8, cpu-ext, triton, torch
    attention_int8.py  its q k^T and p v in int8 (the cpu-int8 backend, quantized models)
    rotary.py      RoPE on q and k                                                      triton, torch
    norm.py        LayerNorm(dense(x) + residual), pre-norm LayerNorm, LayerNorm(act)   triton, torch
    activation.py  act(dense(x))                                                        triton, torch
    glu.py         act(gate(x)) * up(x)                                                 triton, torch
    splade_pool.py pool over each sequence of log1p(relu(decoder(x))) (SPLADE's head)   triton, torch

Each op module reads top to bottom: the call it decides on, the implementations fastbert writes outside Triton (the
``_C`` bindings, the torch paths), its backends declared as data (``dispatch.Backend``: a name, the reasons it cannot
run, how it runs) and the function the layers call. The Triton kernels, with the pure-PyTorch references they are
checked against, live in ``kernels/`` (installed as ``fastbert.kernels``); the CPU GEMM libraries in ``cpu_gemm.py``
(oneDNN), ``native_gemm.py`` (fastbert's float32 GEMM) and ``int8/`` (``linear.py``, ``native_gemm.py``). A call's
decision is taken by ``dispatch.decide`` and kept in the forward's plan (``plan.decided``) under its owning module:
every op takes transformers' modules that own the weights, reads their weights only when they are plain
(``plain.is_plain``) and calls them otherwise, so PEFT, hooks, offload and quantization run as in transformers.
"""

import torch
import torch.nn.functional as F
from torch import nn

from .. import derived, run
# (fastbert.kernels: the repository's top-level kernels/ folder, installed under that name by setup.py)
from ..kernels.activation import ACTIVATIONS
from ..plain import has_hooks, is_plain


def _activation_types() -> dict[type, str]:
    from transformers.activations import ACT2FN

    return {type(ACT2FN[name]): name for name in ACTIVATIONS}


# HF's activation module types -> their names (built once: a dict lookup is all a forward, or a compiled graph, does)
_ACTIVATION_TYPES = _activation_types()


def activation_name(act_fn: nn.Module) -> str | None:
    """HF's name for the activation module ``act_fn`` (a key of ``kernels.activation.ACTIVATIONS``: the module the
    model holds decides, not the config it was built from), or None for one fastbert does not compute or one with
    hooks (which must run as a module)."""
    name = _ACTIVATION_TYPES.get(type(act_fn))
    return None if name is None or has_hooks(act_fn) else name


def why_not_plain(device: torch.device, **modules: tuple[nn.Module, type]) -> list[str]:
    """Why a kernel cannot read these modules' weights (the first one that is not plain), or []."""
    for name, (module, cls) in modules.items():
        if not is_plain(module, cls, device):
            return [f"{name} is a {type(module).__name__} with hooks, a wrapper or parameters elsewhere than the "
                    "input, so it is called as a module (as HF does)"]
    return []


# The LayerNorm classes whose math is nn.LayerNorm's over the last dim (biased variance, eps inside the square root,
# weight and bias), by the attribute holding their eps: a fused op reads an exact instance of one of them. A family
# with its own class registers it (DeBERTa v1's DebertaLayerNorm, whose forward is that math in float32).
LAYER_NORMS: dict[type, str] = {nn.LayerNorm: "eps"}


def ln_class(norm: nn.Module) -> type:
    """The LayerNorm class a fused op checks ``norm`` against (``why_not_plain``): its own where registered."""
    return type(norm) if type(norm) in LAYER_NORMS else nn.LayerNorm


def ln_eps(norm: nn.Module) -> float:
    """A plain LayerNorm's eps, whatever its registered class calls it."""
    return getattr(norm, LAYER_NORMS[type(norm)])


def layer_norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``norm(x)`` for x [tokens, hidden]: ``F.layer_norm`` on a plain LayerNorm's weights (no module call), the module
    otherwise."""
    if not is_plain(norm, ln_class(norm), x.device):
        return norm(x)
    shape = norm.normalized_shape if isinstance(norm, nn.LayerNorm) else norm.weight.shape
    return _f_layer_norm(x, tuple(shape), norm.weight, norm.bias, ln_eps(norm))


@run.step
def _f_layer_norm(x: torch.Tensor, shape: tuple[int, ...], weight: torch.Tensor | None, bias: torch.Tensor | None,
                  eps: float) -> torch.Tensor:
    """``F.layer_norm``: one step of a CPU replay."""
    return F.layer_norm(x, shape, weight, bias, eps)


def ln_bias(norm: nn.LayerNorm) -> torch.Tensor:
    """A plain LayerNorm's bias, or zeros for one without (``bias=False``, ModernBERT's): the kernels always add one
    (a cached [hidden] zero vector costs one load per row; a kernel variant would cost a compile)."""
    if norm.bias is not None:
        return norm.bias
    return derived.cached(norm, "zero_bias", (norm.weight,), torch.zeros_like)


def dropout_p(dropout: nn.Module | None) -> float:
    """The probability ``dropout`` applies now (0 in eval mode, or without one)."""
    return getattr(dropout, "p", 0.0) if dropout is not None and dropout.training else 0.0
