"""How a forward is timed, and what else is measured around it.

CPU: time.perf_counter around one call. GPU: triton.testing.do_bench (L2 flushed before every call). Varied shapes
(either device): time.perf_counter around one call of a new shape, synchronized on a GPU. Providers are interleaved
round-robin, the order rotated every round, so a machine that slows down slows every provider alike. Around each
timed call (or do_bench window) the process's resident memory is read, and its change added to that provider's
``rss_growth`` (outside the timed region).
"""

from __future__ import annotations

import gc
import math
import os
import time
from typing import Callable

import torch

from .cases import DTYPES

Call = Callable[[], object]


def quantile(samples: list[float], q: float) -> float:
    """Linear-interpolation quantile (as ``torch.quantile`` and triton's ``do_bench`` compute it)."""
    if not samples:
        raise ValueError("no samples")
    s = sorted(samples)
    pos = q * (len(s) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summarize(samples_ms: list[float]) -> tuple[float, float, float]:
    """(median, p20, p80) in ms: the quantiles [0.5, 0.2, 0.8] the Triton/Liger benchmarks report."""
    return quantile(samples_ms, 0.5), quantile(samples_ms, 0.2), quantile(samples_ms, 0.8)


def _rotations(names: list[str], reps: int):
    for r in range(reps):
        k = r % len(names)
        yield names[k:] + names[:k]


def warm_up(fns: dict[str, Call], calls: int, already: tuple[str, ...] = ()) -> None:
    """``calls`` untimed calls per provider (one fewer for those in ``already``: the output check ran them once on
    these inputs). torch.compile, CUDA-graph capture, Triton autotuning and oneDNN's first-call setup happen here."""
    for i in range(calls):
        for name, fn in fns.items():
            if i > 0 or name not in already:
                fn()


def warm_up_varied(fns: dict[str, Callable[[dict], object]], batches: list[dict], already: tuple[str, ...] = ()
                   ) -> None:
    """One untimed call per provider on each of ``batches`` (a varied-shapes case's check and warm-up batches; those
    in ``already`` ran the first one in the output check)."""
    for i, inputs in enumerate(batches):
        for name, fn in fns.items():
            if i > 0 or name not in already:
                fn(inputs)


def rss_mb() -> float | None:
    """This process's resident memory, MB (Linux /proc/self/statm), or None elsewhere."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return None


class RssGrowth:
    """Per provider, the sum of the changes of the process's RSS across its timed calls, MB (None off Linux).

    Calls run one at a time in this thread, so what the resident memory gains during a call (its output already
    dropped) is that provider's: caches that grow with every new shape show here."""

    def __init__(self, names):
        self.mb: dict[str, float | None] = {name: 0.0 for name in names}

    def around(self, name: str, run: Callable[[], float]) -> float:
        """``run()`` (which returns its time), with the RSS read before and after it."""
        before = rss_mb()
        elapsed = run()
        after = rss_mb()
        if before is None or after is None:
            self.mb[name] = None
        elif self.mb[name] is not None:
            self.mb[name] += after - before
        return elapsed


def _timed(fn: Call, sync: Callable[[], None] = lambda: None) -> float:
    """ms of one call of ``fn``, its output dropped before returning (``sync``: wait for the device before and
    after)."""
    sync()
    t0 = time.perf_counter()
    out = fn()
    sync()
    elapsed = (time.perf_counter() - t0) * 1e3
    del out
    return elapsed


def time_cpu(fns: dict[str, Call], reps: int) -> tuple[dict[str, list[float]], RssGrowth]:
    """ms per call with time.perf_counter: ``reps`` rounds of one call per provider, the order rotated every round;
    and each provider's RSS growth over its calls."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    rss = RssGrowth(fns)
    for order in _rotations(list(fns), reps):
        for name in order:
            times[name].append(rss.around(name, lambda: _timed(fns[name])))
    return times, rss


def time_gpu(fns: dict[str, Call], reps: int, rep_ms: int) -> tuple[dict[str, list[float]], RssGrowth]:
    """ms per call from triton.testing.do_bench (L2 flushed before every call), return_mode='all': ``reps`` rounds,
    each one do_bench window of ``rep_ms`` per provider, the order rotated every round; samples pooled. And each
    provider's RSS growth over its windows."""
    from triton.testing import do_bench

    times: dict[str, list[float]] = {name: [] for name in fns}
    rss = RssGrowth(fns)

    def window(name):
        times[name] += list(do_bench(fns[name], warmup=10, rep=rep_ms, return_mode="all"))
        return 0.0

    for order in _rotations(list(fns), reps):
        for name in order:
            rss.around(name, lambda: window(name))
    return times, rss


def time_varied(fns: dict[str, Callable[[dict], object]], batches: list[dict], device: torch.device
                ) -> tuple[dict[str, list[float]], RssGrowth]:
    """ms of each call with time.perf_counter (synchronized before and after on a GPU: a new shape's whole cost,
    host and device), round r giving every provider ``batches[r]``, the order rotated every round; and each
    provider's RSS growth over its calls."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times: dict[str, list[float]] = {name: [] for name in fns}
    rss = RssGrowth(fns)
    for inputs, order in zip(batches, _rotations(list(fns), len(batches))):
        for name in order:
            times[name].append(rss.around(name, lambda: _timed(lambda: fns[name](inputs), sync)))
    return times, rss


def host_time_ms(fn: Call, calls: int = 20) -> float:
    """CUDA: median host (CPU-side) time of one call, ms: from an idle GPU (synchronized before the call) until the
    Python forward returns; the wait for the GPU to finish afterwards is not counted.

    This is the launch overhead a CUDA graph would remove. A forward that reads device data back (the packed path
    reads the sequence lengths once) waits there for the GPU work queued before that point, and that wait counts.
    When host_ms is close to the GPU time (median_ms), the forward is bound by the host, not by the GPU.
    """
    samples = []
    for _ in range(calls):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        samples.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
        del out
    return quantile(samples, 0.5)


def cpu_snapshot() -> tuple[float, float, float] | None:
    """(wall s, busy CPU-seconds of the whole machine from /proc/stat, this process's CPU-seconds), or None."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(v) for v in f.readline().split()[1:9]]  # user nice system idle iowait irq softirq steal
    except (OSError, ValueError):
        return None
    busy = (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")
    return time.perf_counter(), busy, time.process_time()


def other_cpu_pct(before, after) -> float | None:
    """% of all cores' time between two ``cpu_snapshot``s spent by other processes (clamped to [0, 100])."""
    if before is None or after is None or after[0] <= before[0]:
        return None
    cores = os.cpu_count() or 1
    other = (after[1] - before[1]) - (after[2] - before[2])
    return min(max(100 * other / ((after[0] - before[0]) * cores), 0.0), 100.0)


def peak_memory_mb(fn: Call) -> float:
    """Extra CUDA memory one call needs at its peak, above what is allocated before it (weights, inputs)."""
    torch.cuda.synchronize()
    gc.collect()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    del out
    return (torch.cuda.max_memory_allocated() - base) / 2**20


_MATMUL_PEAK: dict[str, float] = {}


def matmul_peak_tflops(dtype: str, n: int = 8192) -> float:
    """TFLOP/s of one [n, n] @ [n, n] torch.matmul in ``dtype`` on the current GPU, median of do_bench (cached)."""
    if dtype not in _MATMUL_PEAK:
        from triton.testing import do_bench

        a = torch.randn(n, n, device="cuda", dtype=DTYPES[dtype])
        b = torch.randn(n, n, device="cuda", dtype=DTYPES[dtype])
        ms = do_bench(lambda: torch.matmul(a, b), warmup=50, rep=300, return_mode="median")
        _MATMUL_PEAK[dtype] = 2 * n**3 / (ms * 1e-3) / 1e12
        del a, b
        torch.cuda.empty_cache()
    return _MATMUL_PEAK[dtype]
