"""Launch settings of the attention kernel (``attention.py``): block sizes per GPU arch, head dim and dtype, the
interpreter's, and the tl.dot precision. Static tables, no runtime autotuning: it would benchmark on the first call
of every shape, inside a CUDA-graph capture too."""

import functools

import torch

from ._common import interpreting, triton


# GPU launch settings: (arch family, dtype class, BLOCK_D) -> (BLOCK_M, BLOCK_N, num_warps, num_stages).
# sm90 (compute capability 9.x and above): picked so the sm_90 build needs no register spills (checked by compiling
# ahead of time with the specialization a launch uses and reading the cubin's resource usage:
# tests/test_kernels_attention.py). 16-bit inputs: 128 query rows per program (one program per head for BERT's usual
# 128 tokens), 64 keys per step up to D = 64, 32 above. fp32 operands take twice the registers and shared memory:
# 32 x 32 with 8 warps for every D (64 x 32 spilled up to 24 bytes per thread with "ieee" products, and 32 x 32 with
# 4 warps 656 bytes for D > 64 with a key padding mask).
# sm80 (8.x; older GPUs get these too): the same values unless shared memory exceeds 160 KiB (A100: 164 KiB per
# SM). Estimate: q tile BLOCK_M*BLOCK_D*elt + stages * (k and v tiles 2*BLOCK_N*BLOCK_D*elt); the largest entries
# are 16-bit D = 64: 16 + 3 * 16 = 64 KiB, 16-bit D = 128: 32 + 2 * 16 = 64 KiB, fp32 D = 128: 16 + 2 * 32 = 80 KiB.
# All fit, so no sm80 entry differs yet.
_ATTENTION_CONFIGS = {
    ("sm90", "16bit", 16): (128, 64, 8, 3),  # 16 KiB of shared memory by the estimate
    ("sm90", "16bit", 32): (128, 64, 8, 3),  # 32 KiB
    ("sm90", "16bit", 64): (128, 64, 8, 3),  # 64 KiB
    ("sm90", "16bit", 128): (128, 32, 8, 2),  # 64 KiB
    ("sm90", "fp32", 16): (32, 32, 8, 2),  # 10 KiB
    ("sm90", "fp32", 32): (32, 32, 8, 2),  # 20 KiB
    ("sm90", "fp32", 64): (32, 32, 8, 2),  # 40 KiB
    ("sm90", "fp32", 128): (32, 32, 8, 2),  # 80 KiB
    ("sm80", "16bit", 16): (128, 64, 8, 3),
    ("sm80", "16bit", 32): (128, 64, 8, 3),
    ("sm80", "16bit", 64): (128, 64, 8, 3),
    ("sm80", "16bit", 128): (128, 32, 8, 2),
    ("sm80", "fp32", 16): (32, 32, 8, 2),
    ("sm80", "fp32", 32): (32, 32, 8, 2),
    ("sm80", "fp32", 64): (32, 32, 8, 2),
    ("sm80", "fp32", 128): (32, 32, 8, 2),
}


@functools.lru_cache(maxsize=None)
def _gpu_arch(device_index: int) -> str:
    """The table's arch family of a CUDA device: asked at its first launch (never at import), once per index."""
    major, _ = torch.cuda.get_device_capability(device_index)
    return "sm90" if major >= 9 else "sm80"


def _block_d(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))  # a power of two >= 16 (tl.dot's minimum)


def _gpu_config(arch: str, head_dim: int, dtype: torch.dtype, positional: bool = False,
                gathers: bool = False) -> dict:
    """``positional``: a launch with a window or a relative bias (distances between tokens). fp32 at D = 128 then
    takes 4 warps: with 8, the sm_90 build spills 8 bytes per thread in some of those variants (window with "ieee"
    products, bias with "tf32"); with 4, none does (140-160 registers). ``gathers``: DeBERTa's tables, three gathers
    per score (a row index, c2p, p2c): 16-bit then takes 32 keys per step (with 64 the sm_90 build spilled 312 bytes
    per thread at 255 registers), fp32 16 keys with 4 warps (32 x 32 with 8 warps spilled 8 bytes at D = 64 and 840
    at D = 128 with "ieee" products; 32 x 16 with 4 warps: 96 and 164 registers, no spill)."""
    block_d, dtype_class = _block_d(head_dim), "fp32" if dtype == torch.float32 else "16bit"
    block_m, block_n, num_warps, num_stages = _ATTENTION_CONFIGS[arch, dtype_class, block_d]
    if positional and dtype_class == "fp32" and block_d == 128:
        num_warps = 4
    if gathers:
        block_n, num_warps = (min(block_n, 32), num_warps) if dtype_class == "16bit" else (16, 4)
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, num_warps=num_warps, num_stages=num_stages)


def _attention_config(head_dim: int, dtype: torch.dtype, device: torch.device, positional: bool = False,
                      gathers: bool = False) -> dict:
    """Block sizes and launch options. No runtime autotuning: it would benchmark on the first call of every shape,
    inside a CUDA-graph capture too. GPU values come from the static table ``_ATTENTION_CONFIGS`` and are not yet
    timed on a GPU. The interpreter takes 16 x 16 blocks (tl.dot's minimum): cheap programs, and short test
    sequences cross blocks."""
    if interpreting(device):
        return dict(BLOCK_M=16, BLOCK_N=16, BLOCK_D=_block_d(head_dim), num_warps=1, num_stages=1)
    index = torch.cuda.current_device() if device.index is None else device.index
    return _gpu_config(_gpu_arch(index), head_dim, dtype, positional, gathers)


def _cuda_fp32_matmul_allows_tf32() -> bool:
    """Whether torch lets fp32 CUDA matmuls use TF32: ``torch.backends.cuda.matmul.fp32_precision`` (torch >= 2.9;
    it reflects every way of setting it, ``allow_tf32`` and ``torch.set_float32_matmul_precision`` included, while
    reading ``allow_tf32`` raises once the new API was used), else the legacy ``allow_tf32``."""
    precision = getattr(torch.backends.cuda.matmul, "fp32_precision", None)
    if precision is None:
        return bool(torch.backends.cuda.matmul.allow_tf32)
    return precision == "tf32"


def _input_precision(dtype: torch.dtype, device: torch.device) -> str:
    """tl.dot precision. fp32 on CUDA follows torch's setting for fp32 matmuls (default: exact "ieee" products;
    TF32 allowed, e.g. ``torch.backends.cuda.matmul.allow_tf32 = True``: "tf32" tensor cores, ~1e-3 relative error,
    like torch's own fp32 GEMMs then). On CPU there is no TF32, so "ieee", as torch's CPU matmul. fp16/bf16 operands
    multiply exactly either way; they get Triton's default ("tf32", which only affects fp32 operands)."""
    if dtype != torch.float32:
        return "tf32"
    if device.type == "cuda" and _cuda_fp32_matmul_allows_tf32():
        return "tf32"
    return "ieee"
