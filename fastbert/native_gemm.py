"""fastbert._C's float32 CPU GEMM (csrc/gemm_cpu.h): ``act(x @ W^T + b)`` or ``x @ W^T + b + residual`` on a weight
prepacked once into column panels; the ``native`` backend of ``ops/gemm.py``.

x: [tokens, in] float32, W: [out, in] (``pack``: [ceil(out / 16), in, 16] panels, a derived cache), b: [out] or None,
residual: [tokens, out] -> [tokens, out].

Why a GEMM of our own: on CPUs with AVX2 but not AVX-512, torch's F.linear (MKL's sgemm) reaches ~60 % of the FMA
units' peak on bert-sized GEMMs of one sequence, and oneDNN's float32 is less exact there (``cpu_gemm``). Its register
tiles of 6 rows x 16 columns reach 1.1-1.4x MKL at 128 rows on an AMD EPYC Zen 3 (2 threads), about what ONNX
Runtime's own GEMM reaches. Whether it replaces F.linear is measured once per machine beside torch and oneDNN
(``cpu.gemm_figures``): on CPUs with AVX-512 the libraries' wider kernels usually win.

Numerics: float32 FMAs, each output summed 64 inputs at a time from zero and then added to its running sum, the
bias first: its error against float64 stays within torch's (the tests check 2x on odd shapes). The bias, the
residual and the erf GELU (BERT's, MPNet's, MiniLM's ``hidden_act="gelu"``; its error within torch's F.gelu's) are
the kernel's epilogue, applied to the sums in registers: a GELU as its own pass read and wrote the FFN's widest
activation again (on a Zen 3 at 1,280 x 384 -> 1536: 1.3 ms after a 10.3 ms GEMM, 1.0 ms in its epilogue). Other
activations run after it in torch ops (``activation_ref``, transformers' math).
"""

import functools

import torch

from . import _extension, run
# (fastbert.kernels: the repository's top-level kernels/ folder, installed under that name by setup.py)
from .kernels.activation import ACTIVATIONS, activation_ref

PANEL = 16  # output columns per panel (csrc/gemm_cpu.h)


def unavailable_reasons(dtype: torch.dtype = torch.float32) -> list[str]:
    """Why the native GEMM cannot run ``dtype`` GEMMs here ([] when it can): float32 only, on this build and CPU
    (found once); as ``cpu_gemm.unavailable_reasons``."""
    if dtype != torch.float32:
        return [f"fastbert's CPU GEMM runs float32, not {dtype}"]
    return list(_reasons())


@functools.cache
def _reasons() -> tuple[str, ...]:
    return _extension.cpu_kernel_reasons("gemm_cpu", "fastbert's CPU GEMM", lambda C: C.gemm_cpu_available(),
                                         "an x86-64 CPU with AVX2 and FMA")


class PackedWeight:
    """A weight [out, in] as the kernel reads it: ``panels`` [ceil(out / 16), in, 16] float32, zero past ``out``."""

    __slots__ = ("panels", "out")

    def __init__(self, panels: torch.Tensor, out: int):
        if (panels.dtype != torch.float32 or panels.device.type != "cpu" or panels.dim() != 3
                or panels.shape[0] != -(-out // PANEL) or panels.shape[2] != PANEL or not panels.is_contiguous()):
            raise ValueError(f"panels must be a contiguous float32 CPU tensor [ceil(out / {PANEL}), in, {PANEL}] "
                             f"for out={out}, got {tuple(panels.shape)} {panels.dtype} on {panels.device}")
        self.panels, self.out = panels, out


def pack(weight: torch.Tensor) -> PackedWeight:
    """W [out, in] float32 -> its panels (``panels[p, i, j] = W[16 p + j, i]``), for any number of tokens."""
    if weight.dtype != torch.float32 or weight.dim() != 2 or weight.device.type != "cpu":
        raise ValueError(f"weight must be a float32 CPU tensor [out, in], got {tuple(weight.shape)} {weight.dtype} "
                         f"on {weight.device}")
    out, in_features = weight.shape
    count = -(-out // PANEL)
    padded = weight.detach().new_zeros(count * PANEL, in_features)
    padded[:out] = weight.detach()
    return PackedWeight(padded.view(count, PANEL, in_features).transpose(1, 2).contiguous(), out)


def check_epilogue(rows: int, out: int, bias: torch.Tensor | None, residual: torch.Tensor | None) -> None:
    """ValueError unless bias is None or float32 [out] and residual None or float32 [rows, out], on the CPU (the
    epilogue of this GEMM and of the int8 one, ``int8/native_gemm.py``)."""
    if bias is not None and not (bias.is_cpu and bias.dtype is torch.float32 and bias.shape == (out,)):
        raise ValueError(f"bias must be float32 [{out}] on the CPU, got {tuple(bias.shape)} {bias.dtype} on "
                         f"{bias.device}")
    if residual is not None and not (residual.is_cpu and residual.dtype is torch.float32
                                     and residual.shape == (rows, out)):
        raise ValueError(f"residual must be float32 [{rows}, {out}] on the CPU, got {tuple(residual.shape)} "
                         f"{residual.dtype} on {residual.device}")


def _launch(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None, activation: str | None,
            residual: torch.Tensor | None) -> torch.Tensor:
    """The kernel on checked arguments (bias and residual: None or contiguous), x copied where it cannot read it."""
    row_stride, column_stride = x.stride()
    if column_stride != 1 or (x.shape[0] > 1 and row_stride < x.shape[1]):
        x = x.contiguous()
        row_stride = x.stride(0)
    rows, out = x.shape[0], packed.out
    fused_gelu = residual is None and ACTIVATIONS.get(activation) == "gelu_erf"  # (the kernel's own epilogue)
    y = x.new_empty((rows, out))
    # (one row: torch calls it contiguous whatever its row stride, which the kernel never reads)
    _extension._C.gemm_cpu(x.data_ptr(), row_stride if rows > 1 else x.shape[1], packed.panels.data_ptr(),
                           0 if bias is None else bias.data_ptr(), 0 if residual is None else residual.data_ptr(),
                           y.data_ptr(), rows, x.shape[1], out, torch.get_num_threads(), fused_gelu)
    return y if activation is None or fused_gelu else activation_ref(y, activation)


def _replayed(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None, activation: str | None = None,
              residual: torch.Tensor | None = None) -> torch.Tensor:
    """``linear`` as a replay calls it (``run.step``): x and residual as the recorded call's; the bias, a parameter
    read anew, checked."""
    check_epilogue(x.shape[0], packed.out, bias, None)
    return _launch(x, packed, None if bias is None else bias.contiguous(), activation,
                   None if residual is None else residual.contiguous())


@run.step(replayed=_replayed)
def linear(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None, activation: str | None = None,
           residual: torch.Tensor | None = None) -> torch.Tensor:
    """act(x @ W^T + b), or x @ W^T + b + residual. A step of a CPU replay (``run.step``)."""
    # (is_cpu, `is`: a tenth of a microsecond each, for every GEMM of every forward)
    if not (x.is_cpu and x.dtype is torch.float32 and x.dim() == 2 and x.shape[1] == packed.panels.shape[1]):
        raise ValueError(f"x must be a float32 CPU tensor [tokens, {packed.panels.shape[1]}], got {tuple(x.shape)} "
                         f"{x.dtype} on {x.device}")
    check_epilogue(x.shape[0], packed.out, bias, residual)
    return _launch(x, packed, None if bias is None else bias.contiguous(), activation,
                   None if residual is None else residual.contiguous())
