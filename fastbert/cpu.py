"""The CPU fastbert runs on: its name, the instruction sets that decide which paths are fast (or exact), and the
one-time measurements that choose between exact implementations on it.

fastbert never decides from the vendor or the model name: AMD and Intel CPUs of one name differ (seen: oneDNN 1.05x
and 2x MKL on two "AMD EPYC" machines; the C++ attention 1.3x SDPA on a Zen 4 and 0.75x on an Intel Xeon). It decides
from capabilities (``/proc/cpuinfo`` flags) and from a one-time measurement of both implementations on this CPU,
kept in the per-machine store (``store.py``) under the CPU's name and flags, torch's version, the thread count and
the dtype, so that every process on the machine makes the same choice and gets the same bits.

A measurement runs in a short-lived thread (a process forked afterwards does not inherit its OpenMP threads, see
``threads.py``) and is checked for load: if its threads did not get the CPU, nothing measured is kept, and until the
machine is measured quietly each choice keeps its default, what transformers runs (F.linear, SDPA; int8 where the
CPU has an int8 dot product path at all).
"""

import functools
import os
import platform
import statistics
import threading
import time

import torch
import torch.nn.functional as F

from . import cpu_gemm, native_gemm, store, threads
from .int8 import linear as int8_linear

# The instruction-set flags that change what is fast here, as /proc/cpuinfo names them.
ISA_FLAGS = ("avx2", "avx512f", "avx512bw", "avx512_bf16", "avx512_vnni", "avx_vnni", "avx_ne_convert",
             "amx_tile", "amx_bf16", "amx_int8")

# A GEMM library (oneDNN, fastbert's native GEMM) replaces F.linear only when it is at least this much faster over
# the measured sizes (the geometric mean of its speed-ups) and never more than this much slower at one of them: near a
# tie the measurement would flip between runs (the stored choice keeps later processes on the first one's), and a
# bare-GEMM tie is not worth other low-order bits than transformers'. 5 %, not more: the model gains more than the
# bare GEMM shows (prepacked weights, the epilogue). On an AMD EPYC Zen 4, 2 threads, fp32: oneDNN's GEMMs 1.17x at
# 128 tokens and 1.097x at 1024; mpnet-base 8 x 128 with oneDNN 1.19x transformers, with F.linear 1.05x. On an AMD
# EPYC Zen 3 (AVX2): the native GEMM 1.40x at 128 tokens and 1.02x at 1024; bert-base 1 x 128 with it 184 ms, with
# F.linear 250 (ONNX Runtime 187-199), 8 x 128 even with ONNX Runtime either way.
GEMM_MARGIN = 1.05

ENV_CACHE_DIR = store.ENV_CACHE_DIR


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


# --- measurements, per machine -------------------------------------------------------------------------------------

_figures: dict = {}  # torch.dtype -> the fp32/bf16 GEMM figures; ("int8", bits) -> the int8 ones;
# ("attention", torch.dtype, head dim) -> the attention ones
_lock = threading.Lock()  # concurrent first forwards: one measurement, not two timing each other


def _measured(what, name: str, libraries: tuple[str, ...], tokens: tuple[int, ...], measure) -> dict:
    """``measure()``'s figures {library: {tokens: figure}} for ``what``, from this machine's store or measured now
    (``store.figures``), with "source"; {"busy": why, "source": ...} where the machine was too busy to measure."""
    with _lock:
        if what not in _figures:
            count = threads.most()
            _figures[what] = store.figures(_key(name, count), libraries, tokens, lambda: _timed(measure, count))
        return _figures[what]


def _timed(measure, count: int) -> tuple[dict, str | None]:
    """``measure()`` in a short-lived thread of ``count`` threads -> (its figures, why they cannot be trusted or
    None): its threads must have had the CPU (their CPU time at least ``store.BUSY_RATIO`` of wall time x threads),
    and other processes must have left them enough CPUs."""
    before = threads.sample()
    figures = threads.in_own_thread(measure, threads=count)
    after = threads.sample()
    if before is None or after is None or after[0] <= before[0]:
        return figures, None
    wall = after[0] - before[0]
    share = (after[2] - before[2]) / (wall * count)
    others = max(0.0, (after[1] - before[1]) - (after[2] - before[2])) / wall
    if share < store.BUSY_RATIO:
        return figures, (f"its {count} thread(s) ran {share:.0%} of the time (other processes had the CPU)")
    if others > threads.affinity() - count + 0.5:
        return figures, f"other processes kept {others:.1f} of {threads.affinity()} CPUs busy"
    return figures, None


def gemm_libraries(dtype: torch.dtype) -> tuple[str, ...]:
    """The GEMM libraries that can run ``dtype`` here: torch's F.linear always, oneDNN's packed linear where it runs
    (``cpu_gemm``), fastbert's native GEMM for float32 where it runs (``native_gemm``)."""
    return ("torch",) + tuple(name for name, library in (("onednn", cpu_gemm), ("native", native_gemm))
                              if not library.unavailable_reasons(dtype))


def gemm_figures(dtype: torch.dtype) -> dict:
    """GFLOP/s of each of ``gemm_libraries(dtype)`` at ``GEMM_TOKENS`` tokens in ``dtype`` (``_measure_gemm``):
    {"torch": {tokens: gflops}, "onednn": {...}, ..., "source": ...} (or "busy"). Measured once per machine, then
    read back by every process."""
    libraries = gemm_libraries(dtype)
    return _measured(dtype, gemm_measurement(dtype), libraries, GEMM_TOKENS, lambda: _measure_gemm(dtype, libraries))


def gemm_measurement(dtype: torch.dtype) -> str:
    """The name of the GEMM measurement in ``dtype`` in the store's key: its shapes and libraries, so that a machine
    that measured other shapes or libraries (another build of fastbert sharing the store) measures again rather than
    warn of an entry that lacks one."""
    shapes = " ".join(f"{n_in}x{n_out}" for n_in, n_out in GEMM_SHAPES)
    libraries = gemm_libraries(dtype)
    revision = f", native kernel {NATIVE_GEMM_REVISION}" if "native" in libraries else ""
    return f"{dtype} gemm {shapes} of {' '.join(libraries)}{revision}"


def gemm_figures_so_far() -> dict[torch.dtype, dict]:
    with _lock:
        return {what: figures for what, figures in _figures.items() if isinstance(what, torch.dtype)}


def attention_figures_so_far() -> dict[str, dict]:
    """{"<dtype name>, head_dim <d>": the attention figures measured (or read) so far at that dtype and head dim}."""
    with _lock:
        return {f"{str(what[1]).removeprefix('torch.')}, head_dim {what[2]}": figures
                for what, figures in _figures.items() if isinstance(what, tuple) and what[0] == "attention"}


def int8_figures(bits: int) -> dict:
    """Effective GFLOP/s of the fp32 GEMM libraries (``gemm_libraries``) and of the int8 linear with ``bits``-bit
    weights, activation quantization included, measured once per machine (~2 s)."""
    libraries = gemm_libraries(torch.float32) + ("int8",)
    return _measured(("int8", bits), int8_measurement(bits), libraries, INT8_TOKENS,
                     lambda: _measure_int8(bits, libraries))


def int8_measurement(bits: int) -> str:
    """The name of the int8 measurement in the store's key: the int8 GEMM timed and the float32 libraries it is timed
    against, so that a machine that measured others measures again (rather than warn of an entry that lacks one)."""
    return (f"{torch.float32} int8 w{bits} {int8_linear.gemm_library(bits)} against "
            f"{' '.join(gemm_libraries(torch.float32))}")


def int8_figures_so_far() -> dict:
    with _lock:
        return {f"w{what[1]}": figures for what, figures in _figures.items()
                if isinstance(what, tuple) and what[0] == "int8"}


def int8_slower_reason(bits: int, margin: float) -> str | None:
    """Why int8 GEMMs do not replace the fp32 ones here (not ``margin`` times faster than the faster fp32 library at
    every measured size), or None when they do (also while the machine is too busy to measure: int8's default)."""
    figures = int8_figures(bits)
    if "busy" in figures:
        return None
    for tokens, int8_gflops in figures["int8"].items():
        fp32_gflops = max(figures[lib].get(tokens, 0.0) for lib in ("torch", "onednn", "native") if lib in figures)
        if int8_gflops < margin * fp32_gflops:
            return (f"int8 GEMMs are not {margin}x faster than float32 on this CPU at {tokens} tokens "
                    f"({int8_gflops} vs {fp32_gflops} GFLOP/s)")
    return None


def gemm_slower_reason(library: str, dtype: torch.dtype) -> str | None:
    """Why ``library`` ("onednn" or "native", one of ``gemm_libraries(dtype)``) does not replace F.linear on this CPU
    for ``dtype`` (not ``GEMM_MARGIN`` faster over the measured sizes, or more than that slower at one; another
    library that passes has the larger speed-up; or not measured yet because the machine was busy), or None when it
    does."""
    figures = gemm_figures(dtype)
    if "busy" in figures:
        return f"not measured yet: the machine was busy when fastbert tried ({figures['busy']})"
    name = str(dtype).removeprefix("torch.")
    if library not in figures:  # (oneDNN enabled after this process measured without it)
        return f"not measured in this process: it could not run {name} GEMMs when fastbert measured here"
    speedups = {lib: [figures[lib][t] / figures["torch"][t] for t in figures["torch"]]
                for lib in figures if lib not in ("torch", "source")}
    mean = {lib: statistics.geometric_mean(ratios) for lib, ratios in speedups.items()}
    passing = [lib for lib, ratios in speedups.items() if mean[lib] >= GEMM_MARGIN and min(ratios) >= 1 / GEMM_MARGIN]
    measured = ", ".join(f"{figures[library][t]} vs {g} GFLOP/s at {t} tokens" for t, g in figures["torch"].items())
    if library not in passing:
        return (f"not {GEMM_MARGIN}x faster than torch's F.linear on this CPU over the measured sizes, or more than "
                f"{GEMM_MARGIN}x slower at one ({measured}, {name})")
    best = max(passing, key=mean.get)
    if best != library:
        return (f"{best} is faster still on this CPU ({mean[best]:.2f}x torch's F.linear, {library} "
                f"{mean[library]:.2f}x, {name})")
    return None


def attention_figures(kernel, dtype: torch.dtype, head_dim: int) -> dict:
    """GFLOP/s of torch's SDPA and of the C++ CPU attention ``kernel`` (``ops.attention_cpu.attention_cpu``) in
    ``dtype`` with heads of ``head_dim`` at ``ATTENTION_SEQUENCES``, measured once per machine, dtype and head dim
    (~0.3 s), then read back."""
    return _measured(("attention", dtype, head_dim), attention_measurement(dtype, head_dim), ("torch", "cpu-ext"),
                     tuple(ATTENTION_SEQUENCES), lambda: _measure_attention(kernel, dtype, head_dim))


def attention_slower_reason(kernel, dtype: torch.dtype, head_dim: int) -> str | None:
    """Why the C++ CPU attention ``kernel`` does not replace torch's SDPA here in ``dtype`` with heads of ``head_dim``
    (slower at some measured size by more than ``ATTENTION_NOISE``, or not measured yet because the machine was busy),
    or None."""
    figures = attention_figures(kernel, dtype, head_dim)
    if "busy" in figures:
        return f"not measured yet: the machine was busy when fastbert tried ({figures['busy']})"
    for tokens, torch_gflops in figures["torch"].items():
        if figures["cpu-ext"][tokens] < torch_gflops * (1 - ATTENTION_NOISE):
            count, length = len(ATTENTION_SEQUENCES[tokens]), ATTENTION_SEQUENCES[tokens][0]
            return (f"slower than torch's SDPA on this CPU at {count} x {length} tokens ({figures['cpu-ext'][tokens]} "
                    f"vs {torch_gflops} GFLOP/s, {str(dtype).removeprefix('torch.')}, head_dim {head_dim})")
    return None


def _key(name: str, count: int | None = None) -> str:
    """The store's key of a measurement: this CPU, torch, the thread count (default: a forward's now), what is
    measured."""
    count = count or threads.most()
    cpu = identity()
    flags = ",".join(flag for flag, present in cpu["flags"].items() if present)
    return f"{cpu['model']} [{flags}] torch {torch.__version__} threads {count} {name}"


# --- the timings ------------------------------------------------------------------------------------------------------


def median_seconds(calls: dict, warmup: int = 3, reps: int = 21) -> dict[str, float]:
    """Median seconds of each call, timed in turns (a change of clock or load affects every library alike)."""
    for _ in range(warmup):
        for call in calls.values():
            call()
    times = {name: [] for name in calls}
    for _ in range(reps):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


# A small batch (one sequence) and a large one: a library that wins one may lose the other.
GEMM_TOKENS = (128, 1024)
# bert-base's attention output (in, out) and its first FFN GEMM: a library may win one shape and lose the other (seen,
# AMD EPYC Zen 3: fastbert's native GEMM 1.09x MKL on the first, 1.5x on the second, at 128 tokens).
GEMM_SHAPES = ((768, 768), (768, 3072))
# Part of the float32 measurement's key: a machine that measured an older native GEMM (csrc/gemm_cpu.cpp) measures
# this one again rather than keep an older kernel's verdict.
NATIVE_GEMM_REVISION = 2


def _measure_gemm(dtype: torch.dtype, libraries: tuple[str, ...]) -> dict[str, dict[int, float]]:
    """Effective GFLOP/s of ``libraries`` (``gemm_libraries``) over the ``GEMM_SHAPES`` GEMMs with a bias in
    ``dtype``, for each of ``GEMM_TOKENS`` (medians after warm-ups, the libraries interleaved: 21 reps at 128 tokens,
    7 at 1024, ~1.5 s on 2 cores of an AVX2 CPU in float32, a few percent either way from run to run)."""
    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(n_out, n_in, generator=generator).to(dtype) for n_in, n_out in GEMM_SHAPES]
    biases = [torch.zeros(w.shape[0], dtype=dtype) for w in weights]
    figures = {name: {} for name in libraries}
    with torch.inference_mode():
        onednn = [cpu_gemm.pack(w) for w in weights] if "onednn" in libraries else None
        native = [native_gemm.pack(w) for w in weights] if "native" in libraries else None
        for tokens in GEMM_TOKENS:
            xs = [torch.randn(tokens, w.shape[1], generator=generator).to(dtype) for w in weights]
            calls = {
                "torch": lambda: [F.linear(x, w, b) for x, w, b in zip(xs, weights, biases)],
                "onednn": lambda: [cpu_gemm.linear(x, p, b) for x, p, b in zip(xs, onednn, biases)],
                "native": lambda: [native_gemm.linear(x, p, b) for x, p, b in zip(xs, native, biases)],
            }
            gflop = sum(2 * tokens * w.numel() for w in weights) / 1e9
            reps = 21 if tokens <= 128 else 7
            for name, seconds in median_seconds({name: calls[name] for name in libraries}, warmup=2, reps=reps).items():
                figures[name][tokens] = round(gflop / seconds, 1)
    return figures


# bert-base's four GEMM shapes (in, out) at a small and a large batch: int8 must win where the model spends its time.
INT8_SHAPES = ((768, 2304), (768, 768), (768, 3072), (3072, 768))
INT8_TOKENS = (128, 1024)


def _measure_int8(bits: int, libraries: tuple[str, ...]) -> dict[str, dict[int, float]]:
    """Effective GFLOP/s over bert-base's four GEMM shapes, per token count, of the fp32 GEMM libraries of
    ``libraries`` (``gemm_libraries``) and of the int8 linear, quantization of x included (median of 11 after 2
    warm-ups, interleaved; ~2 s)."""
    generator = torch.Generator().manual_seed(0)
    figures = {name: {} for name in libraries}
    with torch.inference_mode():
        weights = [torch.randn(n_out, n_in, generator=generator) / n_in ** 0.5 for n_in, n_out in INT8_SHAPES]
        biases = [torch.zeros(w.shape[0]) for w in weights]
        quantized = [int8_linear.quantize_weight(w, bits) for w in weights]
        onednn = [cpu_gemm.pack(w) for w in weights] if "onednn" in libraries else None
        native = [native_gemm.pack(w) for w in weights] if "native" in libraries else None
        for tokens in INT8_TOKENS:
            xs = [torch.randn(tokens, w.shape[1], generator=generator) for w in weights]
            calls = {
                "torch": lambda: [F.linear(x, w, b) for x, w, b in zip(xs, weights, biases)],
                "onednn": lambda: [cpu_gemm.linear(x, p, b) for x, p, b in zip(xs, onednn, biases)],
                "native": lambda: [native_gemm.linear(x, p, b) for x, p, b in zip(xs, native, biases)],
                "int8": lambda: [int8_linear.linear(x, q, b) for x, q, b in zip(xs, quantized, biases)],
            }
            gflop = sum(2 * tokens * w.numel() for w in weights) / 1e9
            for name, seconds in median_seconds({name: calls[name] for name in libraries}, warmup=2, reps=11).items():
                figures[name][tokens] = round(gflop / seconds, 1)
    return figures


# Sequences both CPU attentions are timed on (12 heads of the model's head dim): 16 short sentences of 32 tokens (a
# server's or the Embedder's batches), 8 x 128 tokens and one of 512. The kernel replaces torch's SDPA only where it
# is as fast at all three (within ATTENTION_NOISE), for that dtype and head dim. With heads of 64 (measured at 8 x 128
# and 512 then): on Zen 4 it is faster at every length; its AVX2 build, timed there against SDPA's AVX-512 one, at 128
# tokens, not at 512; on an Intel Xeon (Sapphire Rapids class) SDPA was faster at both. On an AVX2-only Zen 3 it is
# 1.2-2.0x SDPA with heads of 32 (MiniLM's) at every length, and with heads of 64 1.5x at 16 x 40 tokens but 0.97x at
# 8 x 128 and 0.83x at 512.
ATTENTION_SEQUENCES = {32: [32] * 16, 128: [128] * 8, 512: [512]}
# How much slower than SDPA the kernel may measure at one size and still be chosen: what separates two measurements
# of the same code on one machine. (A Zen 3 measured 81.8 against SDPA's 82.0 GFLOP/s at 512 tokens with heads of 32,
# where it ran 2.1x and 1.4x SDPA at the other two sizes: a strict comparison kept SDPA, per sequence, for MiniLM.)
ATTENTION_NOISE = 0.05
# Part of the stored measurement's key: a machine that measured an older C++ attention (or other sequences) measures
# this one again rather than keep an older kernel's verdict.
ATTENTION_KERNEL_REVISION = 3


def attention_measurement(dtype: torch.dtype, head_dim: int) -> str:
    """The name of the attention measurement in ``dtype`` with heads of ``head_dim`` (part of its key in the
    store)."""
    return f"{dtype} attention head_dim {head_dim}, kernel {ATTENTION_KERNEL_REVISION}"


def _measure_attention(attention_cpu, dtype: torch.dtype, head_dim: int) -> dict[str, dict[int, float]]:
    """GFLOP/s of torch's per-sequence SDPA and of the C++ CPU attention on ``ATTENTION_SEQUENCES`` in ``dtype``,
    12 heads of ``head_dim`` (median of 11 after 3 warm-ups, interleaved; ~0.3 s)."""
    generator = torch.Generator().manual_seed(0)
    figures = {"torch": {}, "cpu-ext": {}}
    with torch.inference_mode():
        for tokens, seqlens in ATTENTION_SEQUENCES.items():
            qkv = torch.randn(sum(seqlens), 3, 12, head_dim, generator=generator).to(dtype)

            def sdpa():
                for chunk in qkv.split(seqlens):
                    q, k, v = chunk.permute(1, 2, 0, 3)[:, None]
                    F.scaled_dot_product_attention(q, k, v)

            seconds = median_seconds({"torch": sdpa, "cpu-ext": lambda: attention_cpu(qkv, seqlens)}, reps=11)
            gflop = sum(4 * length * length * 12 * head_dim for length in seqlens) / 1e9
            for name, value in seconds.items():
                figures[name][tokens] = round(gflop / value, 1)
    return figures
