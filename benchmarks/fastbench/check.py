"""The output check that runs before anything is timed: a provider's last_hidden_state against hf-sdpa's, on real
tokens only (fastbert returns zeros at padding, HF meaningless values).

fp32: max |out - hf-sdpa| <= FP32_ATOL. When that fails (deep models accumulate fp32 rounding), or for fp16/bf16
always, the flash-attention rule: max |out - ref| <= 2 * max |hf-sdpa - ref| + ATOL[dtype], where ref is HF in a wider
dtype on the same weights (fp64 for fp32, fp32 for fp16/bf16): a provider may be at most twice as far from the exact
result as HF's own rounding.

int8 providers change the numbers by design: they are checked by what users keep of the output, each sequence's
mean-pooled embedding, whose cosine to hf-sdpa's must be at least INT8_MIN_COSINE (fastbert.quantize's guard rule).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

FP32_ATOL = 1e-4
ATOL = {"fp32": 1e-5, "fp16": 1e-3, "bf16": 1e-2}
REFERENCE_DTYPE = {"fp32": "fp64", "fp16": "fp32", "bf16": "fp32"}
INT8_MIN_COSINE = 0.99


class OutputMismatch(AssertionError):
    """A provider's output differs from HF's by more than the tolerance: the run stops (without --keep-going)."""


@dataclass(frozen=True)
class Check:
    ok: bool
    max_err: float  # the error the rule compares (vs hf-sdpa, or vs the reference)
    tol: float
    rule: str


def _max_abs_diff(a: torch.Tensor, b: torch.Tensor, real: torch.Tensor) -> float:
    a, b = a.to(real.device), b.to(real.device)
    return (a.double() - b.double())[real].abs().max().item() if bool(real.any()) else 0.0


def check_outputs(out: torch.Tensor, hf: torch.Tensor, mask: torch.Tensor, dtype: str,
                  ref: torch.Tensor | None = None) -> Check:
    """Compare last_hidden_state [B, S, H] of a provider (``out``) with hf-sdpa's (``hf``) on real tokens (mask != 0).

    ``ref``: HF's output in REFERENCE_DTYPE[dtype]; required for fp16/bf16, optional for fp32 (used only when the
    absolute rule fails). ``out`` may live on another device than ``hf`` (onnxruntime returns CPU tensors).
    """
    real = mask.bool().to(hf.device)
    if out.shape != hf.shape:
        return Check(False, math.inf, 0.0, f"shape {tuple(out.shape)} != {tuple(hf.shape)}")
    direct = _max_abs_diff(out, hf, real)
    if not math.isfinite(direct):
        return Check(False, direct, 0.0, "non-finite output")
    if dtype == "fp32" and direct <= FP32_ATOL:
        return Check(True, direct, FP32_ATOL, "abs vs hf-sdpa")
    if ref is None:
        return Check(False, direct, FP32_ATOL if dtype == "fp32" else 0.0, "abs vs hf-sdpa (no reference given)")
    err = _max_abs_diff(out, ref, real)
    hf_err = _max_abs_diff(hf, ref, real)
    tol = 2 * hf_err + ATOL[dtype]
    return Check(err <= tol, err, tol, f"vs {REFERENCE_DTYPE[dtype]} ref <= 2*hf_err+{ATOL[dtype]:g}")


def check_quantized(out: torch.Tensor, hf: torch.Tensor, mask: torch.Tensor) -> Check:
    """An int8 provider's last_hidden_state [B, S, H] against hf-sdpa's: the lowest cosine of the sequences'
    mean-pooled embeddings (real tokens only) must reach INT8_MIN_COSINE; ``max_err`` is 1 - that cosine."""
    if out.shape != hf.shape:
        return Check(False, math.inf, 0.0, f"shape {tuple(out.shape)} != {tuple(hf.shape)}")
    real = mask.to(hf.device).unsqueeze(-1).double()  # [B, S, 1]
    pooled = [(t.to(hf.device).double() * real).sum(1) / real.sum(1).clamp_min(1) for t in (out, hf)]
    cosine = torch.nn.functional.cosine_similarity(*pooled, dim=-1).min().item()
    if not math.isfinite(cosine):
        return Check(False, math.inf, 0.0, "non-finite output")
    return Check(cosine >= INT8_MIN_COSINE, 1.0 - cosine, 1.0 - INT8_MIN_COSINE,
                 f"int8: pooled cosine vs hf-sdpa >= {INT8_MIN_COSINE}")
