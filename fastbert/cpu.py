"""The CPU fastbert runs on: its name, the instruction sets that decide which paths are fast (or exact), and the GEMM
measurements made on it, kept per machine so that every process on it makes the same choice.

fastbert never decides from the vendor or the model name: AMD and Intel CPUs of one name differ (seen: oneDNN 1.05x
and 2x MKL on two "AMD EPYC" machines). It decides from capabilities (``/proc/cpuinfo`` flags) and from a one-time
measurement of both GEMM libraries on this CPU. The measurement is written to ``$FASTBERT_CACHE_DIR`` (default
``~/.cache/fastbert``) keyed by the CPU's name and flags, torch's version, the thread count and the dtype, so the
next process reads it instead of timing again: two processes on the same machine run the same GEMMs and give the
same bits. Delete the file to measure again.
"""

import functools
import json
import os
import platform
import tempfile
import threading

import torch

from . import _extension
from .kernels import cpu_linear, int8_linear

# The instruction-set flags that change what is fast here, as /proc/cpuinfo names them.
ISA_FLAGS = ("avx2", "avx512f", "avx512bw", "avx512_bf16", "avx512_vnni", "avx_vnni", "avx_ne_convert",
             "amx_tile", "amx_bf16", "amx_int8")

# oneDNN replaces F.linear only when it is at least this much faster at every measured size: near a tie the
# measurement would flip between runs (the stored choice keeps later processes on the first one's), and a bare-GEMM
# tie is not worth other low-order bits than transformers'. 5 %, not more: the model gains more than the bare GEMM
# shows (prepacked weights, bias/GELU/residual in the epilogue). On an AMD EPYC Zen 4, 2 threads, fp32: GEMMs 1.17x
# at 128 tokens and 1.097x at 1024; mpnet-base 8 x 128 with oneDNN 1.19x transformers, with F.linear 1.05x.
ONEDNN_MARGIN = 1.05

ENV_CACHE_DIR = "FASTBERT_CACHE_DIR"


@functools.cache
def identity() -> dict:
    """{"model": the CPU's name, "cores": logical CPUs, "flags": {flag of ISA_FLAGS: bool}}."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                name, _, value = line.partition(":")
                name = name.strip()
                if name == "model name":
                    model = value.strip()
                elif name == "flags":
                    flags = set(value.split())
                if model and flags:
                    break
    except OSError:  # not Linux: what torch can tell
        capability = torch.backends.cpu.get_cpu_capability()
        flags = {"avx2"} if capability in ("AVX2", "AVX512") else set()
        flags |= {"avx512f", "avx512bw"} if capability == "AVX512" else set()
    return {"model": model, "cores": os.cpu_count(), "flags": {flag: flag in flags for flag in ISA_FLAGS}}


def native_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AVX512-BF16 or AMX). Without it bf16 matmuls are emulated and
    slower than fp32, in transformers and fastbert alike."""
    flags = identity()["flags"]
    return flags["avx512_bf16"] or flags["amx_bf16"]


# --- GEMM measurements, per machine ---------------------------------------------------------------------------------

_figures: dict = {}  # torch.dtype -> the fp32/bf16 GEMM figures; ("int8", bits) -> the int8 ones
_lock = threading.Lock()  # concurrent first forwards: one measurement, not two timing each other


def _measured(what, key: str, libraries: tuple[str, ...], measure) -> dict:
    """``measure()``'s figures {library: {tokens: gflops}} for ``what``, read from this machine's store under ``key``
    or measured now and stored; with "source": "measured", or the file they were read from."""
    with _lock:
        if what not in _figures:
            stored = _read_store().get(key)
            if stored is not None and all(lib in stored for lib in libraries):
                figures = {lib: {int(t): g for t, g in stored[lib].items()} for lib in libraries}
                figures["source"] = _store_path()
            else:
                figures = {**measure(), "source": "measured"}
                _write_store(key, {lib: figures[lib] for lib in libraries})
            _figures[what] = figures
        return _figures[what]


def gemm_figures(dtype: torch.dtype) -> dict:
    """GFLOP/s of torch's F.linear and of oneDNN's packed linear at ``cpu_linear.MEASURED_TOKENS`` tokens in
    ``dtype`` with torch's thread count here: {"torch": {tokens: gflops}, "onednn": {...}, "source": "measured" or
    the file it was read from}. Measured once per machine (~0.1 s), then read back by every process."""
    return _measured(dtype, _key(dtype), ("torch", "onednn"), lambda: cpu_linear.measure(dtype))


def gemm_figures_so_far() -> dict[torch.dtype, dict]:
    with _lock:
        return {what: figures for what, figures in _figures.items() if isinstance(what, torch.dtype)}


def attention_figures_so_far() -> dict | None:
    with _lock:
        return _figures.get("attention")


def int8_figures(bits: int) -> dict:
    """Effective GFLOP/s of the fp32 GEMMs (torch, oneDNN where it runs) and of the int8 linear with ``bits``-bit
    weights, activation quantization included (``int8_linear.measure``), measured once per machine (~2 s)."""
    libraries = ("torch", "onednn", "int8")
    return _measured(("int8", bits), f"{_key(torch.float32)} int8 w{bits}", libraries,
                     lambda: int8_linear.measure(bits))


def int8_figures_so_far() -> dict:
    with _lock:
        return {f"w{what[1]}": figures for what, figures in _figures.items() if isinstance(what, tuple)}


def int8_slower_reason(bits: int, margin: float) -> str | None:
    """Why int8 GEMMs do not replace the fp32 ones here (not ``margin`` times faster than the faster fp32 library at
    every measured size), or None when they do."""
    figures = int8_figures(bits)
    for tokens, int8_gflops in figures["int8"].items():
        fp32_gflops = max(figures[lib].get(tokens, 0.0) for lib in ("torch", "onednn"))
        if int8_gflops < margin * fp32_gflops:
            return (f"int8 GEMMs are not {margin}x faster than float32 on this CPU at {tokens} tokens "
                    f"({int8_gflops} vs {fp32_gflops} GFLOP/s)")
    return None


def onednn_slower_reason(dtype: torch.dtype) -> str | None:
    """Why oneDNN does not replace F.linear on this CPU for ``dtype`` (not ``ONEDNN_MARGIN`` faster at every
    measured size), or None when it does."""
    figures = gemm_figures(dtype)
    for tokens, torch_gflops in figures["torch"].items():
        onednn_gflops = figures["onednn"][tokens]
        if onednn_gflops < ONEDNN_MARGIN * torch_gflops:
            return (f"not {ONEDNN_MARGIN}x faster than torch's F.linear on this CPU at {tokens} tokens "
                    f"({onednn_gflops} vs {torch_gflops} GFLOP/s, {str(dtype).removeprefix('torch.')})")
    return None


def attention_figures() -> dict:
    """GFLOP/s of torch's SDPA and of the C++ CPU attention (float32) at ``_extension.ATTENTION_MEASURED``'s
    sequences with torch's thread count here, measured once per machine (~0.3 s), then read back."""
    return _measured("attention", f"{_key(torch.float32)} attention", ("torch", "cpu-ext"),
                     _extension.attention_cpu_measure)


def attention_slower_reason() -> str | None:
    """Why the C++ CPU attention does not replace torch's SDPA here (slower at some measured size), or None."""
    figures = attention_figures()
    for tokens, torch_gflops in figures["torch"].items():
        if figures["cpu-ext"][tokens] < torch_gflops:
            return (f"slower than torch's SDPA on this CPU at {tokens} tokens ({figures['cpu-ext'][tokens]} vs "
                    f"{torch_gflops} GFLOP/s)")
    return None


def _key(dtype: torch.dtype) -> str:
    cpu = identity()
    flags = ",".join(flag for flag, present in cpu["flags"].items() if present)
    return f"{cpu['model']} [{flags}] torch {torch.__version__} threads {torch.get_num_threads()} {dtype}"


def _store_path() -> str:
    folder = os.environ.get(ENV_CACHE_DIR) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "fastbert")
    return os.path.join(folder, "cpu_gemm.json")


def _read_store() -> dict:
    try:
        with open(_store_path()) as f:
            store = json.load(f)
        return store if isinstance(store, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_store(key: str, figures: dict) -> None:
    """Add ``figures`` under ``key``, atomically (a concurrent reader sees the old file or the new one). A
    read-only home keeps the figures for this process only."""
    path = _store_path()
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        store = {**_read_store(), key: figures}
        handle, temporary = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
        with os.fdopen(handle, "w") as f:
            json.dump(store, f, indent=1, sort_keys=True)
        os.replace(temporary, path)
    except OSError:
        pass
