"""The LayerNorms of a layer, with what comes before them.

    dense_residual_layer_norm   LayerNorm(dropout(dense(x)) + residual)     post-norm: BERT's SelfOutput and Output
    layer_norm                  norm(x)                                     pre-norm (ModernBERT), nn.Identity passed
    dense_residual              residual + dropout(dense(x))                pre-norm's residual add
    dense_act_layer_norm        LayerNorm(act(dense(x)))                    the MLM head's transform

Reference: ``kernels/layer_norm.py``'s ``layer_norm_ref`` (statistics in fp32). Backends, for the ops ``layer_norm``
and ``act_layer_norm``: triton (the GEMM without its bias, then one kernel adding bias, residual or activation and
normalizing; on a GPU cuBLAS's bias epilogue keeps the GEMM one kernel), cpu-ext (post-norm blocks of a model
``fastbert.quantize`` made int8: the GEMM op, then fastbert._C's LayerNorm, csrc/layer_norm_cpu.h, which also writes
the u8 of its output that the next int8 GEMM reads, ``int8/handoff.py``), torch (the GEMM op, with the residual or the
activation in its epilogue where its backend has one, then F.layer_norm, or the modules where they are not plain).
A pre-norm block's sum and its normalization are two outputs the block needs (the next sub-block reads both): the
GEMM writes the sum and the LayerNorm reads it once, so a kernel storing both from one pass would move the same
bytes.
"""

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from .. import _extension, dispatch, run
from ..int8 import choices as int8, handoff as int8_handoff, linear as int8_linear
from ..dispatch import Backend, ByDesign
# (fastbert.kernels: the repository's top-level kernels/ folder, installed under that name by setup.py)
from ..kernels import layer_norm as layer_norm_kernels
from ..kernels.activation import ACTIVATIONS, BIAS_ACT_KINDS
from ..plain import has_hooks, is_plain
from ..plan import decided
from . import activation_name, dropout_p, gemm, ln_bias, ln_class, ln_eps, why_not_plain
from . import layer_norm as module_layer_norm


@dataclasses.dataclass(frozen=True)
class Call:
    dense: nn.Module | None
    dropout: nn.Module | None
    norm: nn.Module
    act_fn: nn.Module | None
    activation: str | None  # act_fn's name where the kernel computes it
    reasons: tuple[str, ...]  # why only torch's ops and the modules may run it
    device: torch.device
    dtype: torch.dtype
    packed: str | None = None  # why the GEMM before it cannot run prepacked (int8) on this input, or None


def trivial(dropout: nn.Module | None) -> bool:
    """Whether ``dropout`` changes nothing now (none, p = 0 in eval mode, no hooks)."""
    return dropout is None or (dropout_p(dropout) == 0 and not has_hooks(dropout))


def _call(x: torch.Tensor, dense, dropout, norm, act_fn=None, residual=None) -> Call:
    weights = [getattr(m, name, None) for m in (dense, norm) if m is not None for name in ("weight", "bias")]
    reasons = dispatch.needs_reference(x, residual, *weights, dropout_p=dropout_p(dropout))
    activation = None
    if act_fn is not None:
        activation = activation_name(act_fn)
        if ACTIVATIONS.get(activation) not in BIAS_ACT_KINDS:
            reasons = reasons or [f"activation {type(act_fn).__name__} has no fused kernel (HF's activation module "
                                  "runs)"]
    reasons = reasons or why_not_plain(x.device, LayerNorm=(norm, ln_class(norm)))
    packed = "the GEMM's Linear is called as a module" if dense is None or not is_plain(dense, nn.Linear, x.device) \
        else gemm.why_not_packed(x, (dense.weight,))
    return Call(dense, dropout, norm, act_fn, activation, tuple(reasons), x.device, x.dtype, packed)


def _why_not(call: Call) -> list[str]:
    return list(call.reasons)


# --- post-norm: LayerNorm(dropout(dense(x)) + residual) ---------------------------------------------------------------


def _triton_residual(call: Call, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    # The GEMM with its 1-D bias (cuBLASLt's bias epilogue, one kernel); the kernel adds the residual and normalizes.
    # (addmm(residual, x, W^T) would first copy the residual into the output: one more kernel.)
    norm = call.norm
    return layer_norm_kernels.layer_norm(gemm.linear(x, call.dense), norm.weight, ln_bias(norm), ln_eps(norm),
                                         residual=residual)


def _torch_residual(call: Call, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    if trivial(call.dropout):
        return module_layer_norm(call.norm, gemm.linear(x, call.dense, residual=residual))
    return call.norm(call.dropout(gemm.linear(x, call.dense)) + residual)


# --- fastbert._C's LayerNorm (csrc/layer_norm_cpu.h): float32 on the CPU, writing the next int8 GEMM's u8 too --------


def _layer_norm_cpu_replayed(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float,
                            quantize: int8_handoff.Target | None = None, isa: str = "",
                            out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``layer_norm_cpu`` as a replay calls it (``run.step``): x, out and the settings as the recorded call's, which
    passed its checks; the weight and bias, parameters read anew, checked."""
    _check_affine(x.shape[1], weight, bias, None)
    return _layer_norm_cpu_launch(x.contiguous(), weight, bias, eps, quantize, isa, out)


@run.step(replayed=_layer_norm_cpu_replayed)
def layer_norm_cpu(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float,
                   quantize: int8_handoff.Target | None = None,
                   isa: str = "", out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [rows, cols] float32 -> (LayerNorm(x) * weight + bias [rows, cols], u8 [rows, cols] of that with
    ``quantize``'s static scale, or None): ``int8_linear.quantize_static``'s bytes of the first output. ``isa``:
    "avx2" runs the AVX2 rows where AVX-512 runs too (tests), "" the fastest. ``out``: where the first output is
    written (returned as it): x itself (each row is read whole before it is written) or memory apart from x; None:
    new."""
    if not (x.is_cpu and x.dtype is torch.float32 and x.dim() == 2):
        raise ValueError(f"x must be a float32 CPU tensor [rows, cols], got {tuple(x.shape)} {x.dtype} on {x.device}")
    if out is not None and not (out.is_cpu and out.dtype is torch.float32 and out.shape == x.shape
                                and out.is_contiguous()):
        raise ValueError(f"out must be a contiguous float32 CPU tensor {tuple(x.shape)}, got {tuple(out.shape)} "
                         f"{out.dtype} on {out.device}")
    _check_affine(x.shape[1], weight, bias, None if quantize is None else quantize.smooth)
    return _layer_norm_cpu_launch(x.contiguous(), weight, bias, eps, quantize, isa, out)


def _check_affine(cols: int, weight: torch.Tensor | None, bias: torch.Tensor | None,
                  smooth: torch.Tensor | None) -> None:
    for name, t in (("weight", weight), ("bias", bias), ("smooth", smooth)):
        if t is not None and not (t.is_cpu and t.dtype is torch.float32 and t.shape == (cols,)):
            raise ValueError(f"{name} must be float32 [{cols}] on the CPU, got {tuple(t.shape)} {t.dtype}")


def _layer_norm_cpu_launch(x, weight, bias, eps, quantize, isa, out) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The kernel on checked arguments (x contiguous)."""
    y = torch.empty_like(x) if out is None else out
    q = None if quantize is None else torch.empty(x.shape, dtype=torch.uint8)
    weight = None if weight is None else weight.contiguous()
    bias = None if bias is None else bias.contiguous()
    smooth = None if quantize is None or quantize.smooth is None else quantize.smooth.contiguous()
    _extension._C.layer_norm_cpu(
        x.data_ptr(), y.data_ptr(), 0 if weight is None else weight.data_ptr(), 0 if bias is None else bias.data_ptr(),
        x.shape[0], x.shape[1], eps, 0 if q is None else q.data_ptr(), 0 if smooth is None else smooth.data_ptr(),
        1.0 if quantize is None else quantize.scale, 0 if quantize is None else quantize.zero_point,
        torch.get_num_threads(), isa)
    return y, q


def layer_norm_cpu_unavailable_reasons() -> list[str]:
    """Why fastbert._C's LayerNorm cannot run here ([] when it can): the quantizer's reasons (it writes the
    quantizer's u8 rows, on the CPUs the quantizer runs on), or an extension built before it."""
    reasons = list(int8_linear.quantize_cpu_unavailable_reasons())
    if not reasons and not hasattr(_extension._C, "layer_norm_cpu"):
        return ["fastbert._C predates the CPU LayerNorm; reinstall fastbert"]
    return reasons


def _cpu_unavailable(device: torch.device, dtype: torch.dtype) -> list[str]:
    if device.type != "cpu" or dtype != torch.float32:
        return [ByDesign("fastbert._C's LayerNorm runs float32 on the CPU")]
    return layer_norm_cpu_unavailable_reasons()


def _cpu_why_not(call: Call) -> list[str]:
    if call.dense is None or int8.chosen(call.dense) is None or call.packed or int8.unavailable_reasons():
        return [ByDesign("fastbert._C's LayerNorm runs where the GEMM before it runs int8 (fastbert.quantize; it "
                         "writes the next int8 GEMM's input in the same pass); elsewhere torch's runs")]
    if not trivial(call.dropout):
        return [ByDesign("a dropout with hooks is called as a module: torch's path runs")]
    return list(call.reasons)


def handing_off(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """norm(x) by fastbert._C's LayerNorm (``norm`` plain), with the u8 of it that the int8 GEMM reading it next took
    last time (``int8/handoff.py``). x: the GEMM output the caller just made and nothing else holds, overwritten
    with the result: at 8 x 128 tokens a new [tokens, hidden] per LayerNorm is 3 MB that glibc returns to the
    system and faults back in, page by page, a layer later."""
    target = int8_handoff.target(norm)
    y, q = layer_norm_cpu(x, norm.weight, norm.bias, ln_eps(norm), target, out=x if x.is_contiguous() else None)
    int8_handoff.offer(norm, y, q, target)
    return y


def _cpu_residual(call: Call, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    return handing_off(call.norm, gemm.linear(x, call.dense, residual=residual))


RESIDUAL_BACKENDS = dispatch.register("layer_norm", [
    Backend("triton", run=_triton_residual, unavailable=dispatch.triton_unavailable, why_not=_why_not),
    Backend("cpu-ext", run=_cpu_residual, unavailable=_cpu_unavailable, why_not=_cpu_why_not, devices=("cpu",),
            opt_in=True, steps=True),
    Backend("torch", run=_torch_residual, steps=True),  # (the GEMM op, then a plain LayerNorm's step)
])


def dense_residual_layer_norm(x: torch.Tensor, residual: torch.Tensor, dense: nn.Module, dropout: nn.Module | None,
                              norm: nn.Module) -> torch.Tensor:
    """LayerNorm(dropout(dense(x)) + residual): x [tokens, in], residual [tokens, hidden] -> [tokens, hidden]
    (``dropout`` None: none, as after DistilBERT's attention projection)."""
    decision = decided(norm, "dense_residual_layer_norm", lambda: dispatch.decide(
        "layer_norm", RESIDUAL_BACKENDS, _call(x, dense, dropout, norm, residual=residual)))
    return decision(x, residual)


# --- pre-norm: norm(x), and residual + dropout(dense(x)) --------------------------------------------------------------


def _triton_norm(call: Call, x: torch.Tensor) -> torch.Tensor:
    return layer_norm_kernels.layer_norm(x, call.norm.weight, ln_bias(call.norm), ln_eps(call.norm))


def _torch_norm(call: Call, x: torch.Tensor) -> torch.Tensor:
    return module_layer_norm(call.norm, x)


# (the op "layer_norm", as above: the same reasons, for a call of one tensor)
NORM_BACKENDS = (
    Backend("triton", run=_triton_norm, unavailable=dispatch.triton_unavailable, why_not=_why_not),
    Backend("torch", run=_torch_norm, steps=True),
)


def layer_norm(x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    """norm(x) for x [tokens, hidden]: a plain LayerNorm (with or without bias) fused, nn.Identity (ModernBERT's layer
    0) passed through, anything else called."""
    if type(norm) is nn.Identity and not has_hooks(norm):
        return x
    return decided(norm, "layer_norm", lambda: dispatch.decide("layer_norm", NORM_BACKENDS, _call(x, None, None,
                                                                                                  norm)))(x)


def dense_residual(x: torch.Tensor, residual: torch.Tensor, dense: nn.Module, dropout: nn.Module | None,
                   ) -> torch.Tensor:
    """residual + dropout(dense(x)): x [tokens, in], residual [tokens, out]; the add in the GEMM's epilogue where its
    backend has one (oneDNN, int8). ``dropout``: nn.Dropout, nn.Identity or None."""
    if trivial(dropout):
        return gemm.linear(x, dense, residual=residual)
    return dropout(gemm.linear(x, dense)) + residual


# --- the MLM head's transform: LayerNorm(act(dense(x))) ---------------------------------------------------------------


def _triton_act(call: Call, x: torch.Tensor) -> torch.Tensor:
    norm, dense = call.norm, call.dense
    if is_plain(dense, nn.Linear, x.device):  # (the bias, like the activation, in the kernel)
        return layer_norm_kernels.layer_norm(F.linear(x, dense.weight), norm.weight, ln_bias(norm), ln_eps(norm),
                                             bias=dense.bias, activation=call.activation)
    return layer_norm_kernels.layer_norm(dense(x), norm.weight, ln_bias(norm), ln_eps(norm), activation=call.activation)


def _torch_act(call: Call, x: torch.Tensor) -> torch.Tensor:
    return module_layer_norm(call.norm, gemm.linear(x, call.dense, call.act_fn))


ACT_BACKENDS = dispatch.register("act_layer_norm", [
    Backend("triton", run=_triton_act, unavailable=dispatch.triton_unavailable, why_not=_why_not),
    Backend("torch", run=_torch_act, steps=True),
])


def dense_act_layer_norm(x: torch.Tensor, dense: nn.Module, act_fn: nn.Module, norm: nn.Module) -> torch.Tensor:
    """LayerNorm(act(dense(x))): the MLM head's transform (BertPredictionHeadTransform); ``act_fn`` HF's module."""
    decision = decided(norm, "dense_act_layer_norm", lambda: dispatch.decide(
        "act_layer_norm", ACT_BACKENDS, _call(x, dense, None, norm, act_fn)))
    return decision(x)
