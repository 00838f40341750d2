"""Attention with its two matmuls in int8 on the CPU: the quantized variant of ``attention_cpu.attention_cpu``, run in
the layers where ``fastbert.quantize``'s guard judged it (``int8.choose_attention``).

    qkv [T, 3, H, D] float32 -> [T, H, D] float32, sequence b the next ``seqlens[b]`` rows; per sequence and head:
    k, v -> s8 with one scale each (amax / 127), each query row -> s8 with its own; scores from exact int32 dot
    products; softmax's numerators exp(s - max) as u8 (255 at the row's max) and their integer sum as the
    denominator; p v from exact int32 sums.

On an Intel Xeon with AVX-512 VNNI (2 threads, 12 heads of 64, 8 x 128 tokens) the kernel took half the time of the
float32 one. The scales are taken per call from the values themselves (no calibration, nothing saved), so no query
depends on another sequence. Reference: ``attention_int8_ref`` (the same integers; its exp is torch's, so a
probability can sit one level away from the kernel's at a rounding tie). Kernel: csrc/attention_int8_cpu.h. With a
target (``attention_int8_cpu_quantizing``) it also writes the u8 its O projection reads (``int8/handoff.py``).
"""

import functools

import torch

from .. import _extension, run
from ..int8 import handoff as int8_handoff, linear as int8_linear
# (fastbert.kernels: the repository's top-level kernels/ folder, installed under that name by setup.py)
from ..kernels._common import direct_launch, launch_or_op

LEVELS = 255  # softmax's numerators: u8, the row's largest exactly this
MAX_HEAD_DIM = 1024  # (int32 sums of 255 x 127 products per dim stay exact in float32 up to here)
MAX_LENGTH = 65536  # (int32 sums of 255 x 127 products per key fit up to here)


def _symmetric_scale(absmax: torch.Tensor) -> torch.Tensor:
    """amax / 127 (float32, as the kernel divides), at least float32's smallest normal (its inverse stays finite);
    1 where the range is all zero."""
    return torch.where(absmax > 0, (absmax / 127).clamp_min(torch.finfo(torch.float32).tiny), torch.ones_like(absmax))


def _quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """round(x * (1 / scale)) in float32, half to even, as the kernel (float32 -> [-127, 127])."""
    return torch.round(x * (1 / scale))


def attention_int8_ref(qkv: torch.Tensor, seqlens, scale: float | None = None) -> torch.Tensor:
    """The kernel's math in torch: qkv [T, 3, H, D] float32 -> [T, H, D] float32. Integer sums in float64 (exact);
    where the kernel computes in float32, so does this. A (sequence, head) whose k or v holds a NaN or an infinity
    gives NaN rows, as does a query row holding one."""
    head_dim = qkv.shape[-1]
    scale = head_dim ** -0.5 if scale is None else scale
    outputs = []
    for chunk in qkv.float().split(list(seqlens)):  # [L, 3, H, D]
        if chunk.shape[0] == 0:
            continue
        q, k, v = chunk.unbind(1)  # [L, H, D]
        k_max, v_max = k.abs().amax(dim=(0, 2)), v.abs().amax(dim=(0, 2))  # [H]
        q_max = q.abs().amax(dim=2)  # [L, H]
        finite = torch.isfinite(q_max) & torch.isfinite(k_max) & torch.isfinite(v_max)  # [L, H]
        q_max, k_max, v_max = (torch.nan_to_num(m, nan=0.0, posinf=0.0) for m in (q_max, k_max, v_max))
        sq, sk, sv = _symmetric_scale(q_max), _symmetric_scale(k_max), _symmetric_scale(v_max)
        qq = _quantize(torch.nan_to_num(q), sq[..., None])
        kq, vq = _quantize(torch.nan_to_num(k), sk[:, None]), _quantize(torch.nan_to_num(v), sv[:, None])
        dots = torch.einsum("ihd,jhd->hij", qq.double(), kq.double()).float()  # [H, L, L], exact
        scores = dots * ((sq.t() * sk[:, None]) * scale)[..., None]  # [H, L, L]
        levels = torch.round(torch.exp(scores - scores.amax(dim=2, keepdim=True)) * LEVELS)
        sums = torch.einsum("hij,jhd->ihd", levels.double(), vq.double()).float()  # [L, H, D], exact
        out = sums * (sv / levels.sum(dim=2).t())[..., None]
        outputs.append(torch.where(finite[..., None], out, torch.full_like(out, float("nan"))))
    return torch.cat(outputs) if outputs else qkv.new_empty(0, *qkv.shape[2:])


# --- fastbert._C's kernel ---------------------------------------------------------------------------------------------


def unavailable_reasons() -> list[str]:
    """Why the int8 attention cannot run here ([] when it can): a property of this build and CPU, found once."""
    return list(_reasons())


@functools.cache
def _reasons() -> tuple[str, ...]:
    return _extension.cpu_kernel_reasons("attention_int8_cpu", "fastbert's int8 CPU attention",
                                         lambda C: C.attention_int8_cpu_available(),
                                         "an x86-64 CPU with AVX-512 VNNI (u8 x s8 dot products)")


def _check_args(qkv: torch.Tensor, seqlens: list[int]) -> None:
    if qkv.device.type != "cpu" or qkv.dtype != torch.float32 or qkv.dim() != 4 or qkv.shape[1] != 3:
        raise ValueError(f"qkv must be a float32 CPU tensor [tokens, 3, heads, head_dim], got {tuple(qkv.shape)} "
                         f"{qkv.dtype} on {qkv.device}")
    if qkv.shape[3] > MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be <= {MAX_HEAD_DIM} for the int8 attention, got {qkv.shape[3]}")
    if any(length < 0 or length > MAX_LENGTH for length in seqlens) or sum(seqlens) != qkv.shape[0]:
        raise ValueError(f"seqlens must be in [0, {MAX_LENGTH}] and add up to qkv's {qkv.shape[0]} tokens, got "
                         f"{list(seqlens)[:8]}{'...' if len(seqlens) > 8 else ''}")


# What ``run.count`` counts per launch, for whoever watches the forwards (the int8 guard checks that it judged the
# kernel: that every call chosen for it ran it, none declined by dispatch as ``("attention", "cpu-int8", "declined")``)
LAUNCHED = ("attention", "cpu-int8", "launched")
DECLINED = ("attention", "cpu-int8", "declined")


@run.step
def _launch(qkv: torch.Tensor, seqlens: list[int], target: int8_handoff.Target | None = None, spare_rows: int = 0,
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    qkv = qkv.detach().contiguous()
    _check_args(qkv, seqlens)
    hidden = qkv.shape[2] * qkv.shape[3]
    smooth = None if target is None else target.smooth
    if target is not None:
        int8_linear.check_static(target.scale, target.zero_point)
        if smooth is not None and (smooth.device.type != "cpu" or smooth.dtype != torch.float32
                                   or smooth.shape != (hidden,) or not smooth.is_contiguous()):
            raise ValueError(f"the target's smooth must be float32 [{hidden}] on the CPU, got {tuple(smooth.shape)} "
                             f"{smooth.dtype}")
    reasons = unavailable_reasons()
    if reasons:
        raise RuntimeError(reasons[0])
    tokens = qkv.shape[0]
    out = qkv.new_empty(tokens + spare_rows, qkv.shape[2], qkv.shape[3])
    q = None if target is None else torch.empty(out.shape, dtype=torch.uint8)
    if spare_rows:
        out[tokens:] = 0
        if q is not None:
            q[tokens:] = target.zero_point  # (the u8 of a zero: 0 / smooth is 0 for the guard's divisors, all > 0)
    run.count(LAUNCHED)
    _extension._C.attention_int8_cpu(out.data_ptr(), qkv.data_ptr(), list(seqlens), qkv.shape[2], qkv.shape[3],
                                     qkv.shape[3] ** -0.5, torch.get_num_threads(), 0 if q is None else q.data_ptr(),
                                     0 if smooth is None else smooth.data_ptr(),
                                     1.0 if target is None else target.scale,
                                     0 if target is None else target.zero_point)
    return out, q


def _launch_output(qkv: torch.Tensor, seqlens: list[int]) -> torch.Tensor:
    return _launch(qkv, seqlens)[0]


@torch.library.custom_op("fastbert::attention_int8_cpu", mutates_args=())
def _op(qkv: torch.Tensor, seqlens: list[int]) -> torch.Tensor:
    return _launch_output(qkv, seqlens)


@_op.register_fake
def _(qkv, seqlens):
    _check_args(qkv, seqlens)
    return qkv.new_empty(qkv.shape[0], qkv.shape[2], qkv.shape[3])


def attention_int8_cpu(qkv: torch.Tensor, seqlens) -> torch.Tensor:
    """Padding-free attention, q k^T and p v in int8 (module docstring), forward only: qkv [T, 3, H, D] float32 ->
    [T, H, D], sequence b the next ``seqlens[b]`` rows, scale 1 / sqrt(D). Raises ValueError before the kernel runs
    when the arguments do not fit, RuntimeError where ``unavailable_reasons()`` says it cannot run."""
    return launch_or_op(_launch_output, _op, qkv, list(seqlens))


def attention_int8_cpu_quantizing(qkv: torch.Tensor, seqlens, target: int8_handoff.Target | None,
                                  spare_rows: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``attention_int8_cpu``, writing in the same pass the u8 of its output for the int8 GEMM that reads it next
    (``int8/handoff.py``): ``int8_linear.quantize_static``'s bytes of the output viewed [rows, H D] with ``target``'s
    scale, zero point and divisors (``target`` None: no u8, as before the GEMM has taught one). Both have
    ``spare_rows`` rows after the T tokens' (zero, and the u8 of zero): the spare rows of a bucketed layout, so the
    GEMM reads them without a copy. In eager code on plain tensors; elsewhere (torch.compile, export, torch.func) the
    registered op runs and the u8 is None (the GEMM quantizes its input itself)."""
    if spare_rows < 0:
        raise ValueError(f"spare_rows must be >= 0, got {spare_rows}")
    if not direct_launch(qkv):
        out = attention_int8_cpu(qkv, seqlens)
        return (torch.cat([out, out.new_zeros(spare_rows, *out.shape[1:])]) if spare_rows else out), None
    return _launch(qkv, list(seqlens), target, spare_rows)
