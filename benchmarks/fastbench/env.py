"""The machine and software a run measured: device name, versions, GPU math settings, fastbert's backends."""

from __future__ import annotations

import importlib.metadata
import platform

import torch

from .cases import DTYPES


def version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return ""


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


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
