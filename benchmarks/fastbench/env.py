"""The machine and software a run measured: device name and identity, versions, GPU math settings, fastbert's
backends; and the machine's short name that results folders are named by."""

from __future__ import annotations

import functools
import importlib.metadata
import os
import platform
import re
import subprocess

import torch

from .cases import DTYPES


def version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return ""


# The CPU features that decide which GEMM kernels (oneDNN, MKL, onnxruntime) can run: AVX-512 doubles the fp32
# width, its bf16 and VNNI extensions add 16-bit and int8 dot products, AMX the tile matrix units.
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni")


@functools.lru_cache(maxsize=None)
def cpu_info() -> tuple[str, tuple[str, ...]]:
    """(model name, flags) as ``lscpu`` reports them, else from /proc/cpuinfo; ('', ()) where neither answers."""
    fields: dict[str, str] = {}
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10,
                             env=dict(os.environ, LC_ALL="C")).stdout
        for line in out.splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip().lower(), value.strip())
    except (OSError, subprocess.SubprocessError):
        pass
    if not fields.get("model name") or "flags" not in fields:
        try:
            with open("/proc/cpuinfo") as f:
                for line in f:
                    key, _, value = line.partition(":")
                    if key.strip() in ("model name", "flags"):
                        fields.setdefault(key.strip(), value.strip())
        except OSError:
            pass
    return fields.get("model name", ""), tuple(fields.get("flags", "").split())


def cpu_cores() -> int:
    """CPUs this process may run on (what ``nproc`` prints)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def cpu_identity() -> str:
    """'AMD EPYC, 2 cores; avx2 avx512f avx512_bf16 avx512_vnni; no amx': the CPU's model, cores and GEMM flags."""
    model, flags = cpu_info()
    have = [f for f in CPU_FLAGS if f in flags]
    amx = [f for f in flags if f.startswith("amx")]
    lacking = [f for f in CPU_FLAGS if f not in flags] + ([] if amx else ["amx"])
    parts = [" ".join(have + amx) if have or amx else ""] + (["no " + ", ".join(lacking)] if lacking else [])
    return f"{model or platform.processor() or 'unknown CPU'}, {cpu_cores()} cores; " + "; ".join(p for p in parts if p)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return cpu_info()[0] or platform.processor() or platform.machine() or "cpu"


def gpu_identity(device: torch.device) -> str:
    """'NVIDIA H100 80GB HBM3, sm_90, 79.1 GiB': the GPU's name, compute capability and memory."""
    props = torch.cuda.get_device_properties(device)
    return f"{props.name}, sm_{props.major}{props.minor}, {props.total_memory / 2**30:.1f} GiB"


def _slug(name: str) -> str:
    """'Intel(R) Xeon(R) Gold 6338 CPU @ 2.00GHz' -> 'intel-xeon-gold-6338': marks, clock, 'CPU', 'Processor' and
    'N-Core' dropped, lower case, dashes, at most 40 characters."""
    name = re.sub(r"\((r|tm)\)|@.*$|\bcpu\b|\bprocessor\b|\b\d+-core\b", " ", name, flags=re.IGNORECASE)
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")[:40].strip("-") or "unknown"


def machine_slug(device: torch.device) -> str:
    """The machine in a folder name: 'cpu-amd-epyc-2core' (CPU model, cores) or 'cuda-nvidia-h100-80gb-hbm3'."""
    if device.type == "cuda":
        return f"cuda-{_slug(device_name(device))}"
    return f"cpu-{_slug(device_name(device))}-{cpu_cores()}core"


def gpu_settings() -> str:
    m = torch.backends.cuda.matmul
    parts = [f"matmul.allow_tf32={m.allow_tf32}", f"cudnn.allow_tf32={torch.backends.cudnn.allow_tf32}",
             f"float32_matmul_precision={torch.get_float32_matmul_precision()}",
             f"matmul.allow_fp16_reduced_precision_reduction={m.allow_fp16_reduced_precision_reduction}",
             f"matmul.allow_bf16_reduced_precision_reduction={m.allow_bf16_reduced_precision_reduction}"]
    if hasattr(m, "fp32_precision"):
        parts.append(f"matmul.fp32_precision={m.fp32_precision}")
    return ", ".join(parts)


def fastbert_backends(device: torch.device, dtype: str) -> str:
    try:
        from fastbert import dispatch

        backends, _ = dispatch.report(device, DTYPES[dtype])
        return " ".join(f"{op}={b}" for op, b in backends.items())
    except Exception as e:  # the column is informational; the run itself fails on its own if fastbert is broken
        return f"unknown ({type(e).__name__})"
