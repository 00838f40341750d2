"""How many threads fastbert's CPU forwards run, and what keeps a forked child alive.

torch runs one OpenMP thread per core of the host, whatever the process may actually use, and GNU OpenMP's threads
spin at every barrier (hundreds of thousands of iterations before they sleep). Where a thread of the team is not
running, every other one burns its time slice waiting for it: a forward of ~100 parallel regions then crawls.
Measured on a 2-core Intel Xeon, MiniLM encoding 300 mixed sentences in sentence-transformers (2.9 s quiet): beside
one busy process 7.4 s with transformers and 5.1 s with one thread; beside three, 12.1 s and 10.6 s. So a CPU forward
of fastbert runs

    min(torch's thread count, CPUs in the affinity mask, floor(cgroup CPU quota), CPUs other processes leave free)

threads (at least one). The first three are read once per process; the last is sampled from ``/proc/stat`` at most
every ``SAMPLE_SECONDS`` (the CPU time of the machine's CPUs in our mask, minus our own), smoothed, so a busy
neighbour lowers the count within a second and its end raises it again. ``FASTBERT_NUM_THREADS=N`` fixes the count
instead (then nothing adapts). ``fastbert.info()["threads"]`` says what was chosen and why.

A thread that is one of several running forwards side by side (``fastbert serve --instances``: ``one_of``) runs its
share of each: of the limit (or of ``FASTBERT_NUM_THREADS``) and of the CPUs other processes leave free, so that
together they never run more threads than the process has CPUs.

Fork: GNU OpenMP's thread pool belongs to the thread that started it and does not survive ``fork``; a child whose
forking thread had a pool hangs at its first parallel region (with transformers as with fastbert). fastbert's own
one-time work (measurements, trial GEMMs, the int8 guard) therefore runs in a short-lived thread of its own
(``in_own_thread``), whose pool goes with it: importing fastbert, ``optimize``, ``info``, ``quantize``, ``dtype=auto``'s
guard and a server engine's calibration leave the caller's thread without one. That also keeps a pool idle in one thread
from slowing the forwards of another: with more OpenMP threads alive than CPUs, GNU OpenMP's workers sleep at every
barrier instead of spinning (seen: MiniLM's 38-token forward took 33 ms instead of 15 in a second thread while the main
thread kept the pool of an earlier forward, as a server's model thread did beside its calibration forward; AMD EPYC Zen
3, 2 cores). Where the forking thread ran a multi-threaded fastbert forward, the child runs torch on one thread (as
PyTorch's DataLoader workers do) and says so, instead of hanging.
"""

import math
import os
import threading
import time

import torch

from . import announce, run

ENV_NUM_THREADS = "FASTBERT_NUM_THREADS"
SAMPLE_SECONDS = 0.25  # /proc/stat counts in 10 ms ticks: a quarter second of 2 CPUs is 50 of them
_SMOOTHING = 0.5  # weight of the newest sample in the estimate of the CPUs others use


# --- the CPUs the process may use ------------------------------------------------------------------------------------


def affinity() -> int:
    """CPUs in this process's affinity mask (``taskset``, a cpuset container), else the online CPUs."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _mounts(mountinfo: str) -> list[tuple[str, str, str, set[str]]]:
    """(root, mount point, fstype, super options) of each cgroup mount listed in a mountinfo file."""
    mounts = []
    try:
        with open(mountinfo) as f:
            for line in f:
                head, _, tail = line.partition(" - ")
                fields, after = head.split(), tail.split()
                if len(fields) >= 5 and len(after) >= 3 and after[0] in ("cgroup", "cgroup2"):
                    mounts.append((fields[3], fields[4], after[0], set(after[2].split(","))))
    except OSError:
        pass
    return mounts


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _limit_in(directory: str, version: int) -> float | None:
    """CPUs one cgroup directory's quota allows, or None for no limit there."""
    if version == 2:
        text = _read(os.path.join(directory, "cpu.max"))
        parts = text.split() if text else []
        if len(parts) == 2 and parts[0] != "max":
            quota, period = float(parts[0]), float(parts[1])
            return quota / period if quota > 0 and period > 0 else None
        return None
    quota, period = _read(os.path.join(directory, "cpu.cfs_quota_us")), _read(
        os.path.join(directory, "cpu.cfs_period_us"))
    try:
        quota, period = float(quota), float(period)
    except (TypeError, ValueError):
        return None
    return quota / period if quota > 0 and period > 0 else None


def cgroup_quota(proc: str = "/proc/self") -> float | None:
    """CPUs the cgroup CPU quota allows this process (cgroup v2 ``cpu.max``, v1 ``cpu.cfs_quota_us`` over
    ``cpu.cfs_period_us``), the smallest along its hierarchy up to the mount; None where there is none or it cannot
    be read. ``proc``: the /proc entry of the process (tests give a folder laid out the same way)."""
    groups = {}  # controllers ("" for v2) -> the process's cgroup path
    for line in (_read(os.path.join(proc, "cgroup")) or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            for controller in parts[1].split(",") if parts[1] else [""]:
                groups[controller] = parts[2]
    limits = []
    for root, mount_point, fstype, options in _mounts(os.path.join(proc, "mountinfo")):
        version = 2 if fstype == "cgroup2" else 1
        path = groups.get("" if version == 2 else "cpu") if version == 2 or "cpu" in options else None
        if path is None:
            continue
        # The process's cgroup under this mount: its path relative to the mount's root (a container sees "/").
        relative = os.path.relpath(path, root) if path.startswith(root) else "."
        directory = os.path.normpath(os.path.join(mount_point, relative))
        while True:
            limit = _limit_in(directory, version)
            if limit is not None:
                limits.append(limit)
            if os.path.normpath(directory) == os.path.normpath(mount_point) or directory in ("/", ""):
                break
            directory = os.path.dirname(directory)
    return min(limits) if limits else None


def requested() -> int | None:
    """``FASTBERT_NUM_THREADS`` as a positive int, or None when unset (a bad value raises, naming the variable)."""
    value = os.environ.get(ENV_NUM_THREADS, "").strip()
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{ENV_NUM_THREADS}={value!r}: expected a positive integer")
    return int(value)


class _Limit:
    """The most threads this process may run whatever torch says, and why: the affinity mask and the cgroup quota
    (read once: they rarely change), or ``FASTBERT_NUM_THREADS``."""

    def __init__(self):
        self.affinity = affinity()
        self.quota = cgroup_quota()
        self.fixed = requested()
        if self.fixed is not None:
            self.threads, self.why = self.fixed, f"{ENV_NUM_THREADS}={self.fixed}"
        elif self.quota is not None and math.floor(self.quota) < self.affinity:
            self.threads, self.why = max(1, math.floor(self.quota)), f"the cgroup CPU quota ({self.quota:g} CPUs)"
        else:
            self.threads, self.why = self.affinity, "the CPU affinity mask"


_limit: _Limit | None = None
_limit_lock = threading.Lock()


def limit() -> _Limit:
    global _limit
    if _limit is None:
        with _limit_lock:
            if _limit is None:
                _limit = _Limit()
    return _limit


def most() -> int:
    """The most threads a forward runs now: torch's thread count as the caller set it (outside any fastbert forward)
    within the process's limit, or the fixed count (this thread's share of it: ``one_of``)."""
    cap = limit()
    if cap.fixed is not None:
        return max(1, cap.fixed // _parts())
    threads = getattr(_state, "outer", None) or torch.get_num_threads()
    if cap.threads < threads:
        announce.note(f"torch runs {threads} threads, but this process may use {cap.threads} CPU(s) ({cap.why}): "
                      f"fastbert's CPU forwards run {cap.threads} ({ENV_NUM_THREADS} sets the count)")
        return cap.threads
    return threads


def reset() -> None:
    """Read the limits and the environment again at the next forward (tests; after changing the quota or mask)."""
    global _limit
    with _limit_lock:
        _limit = None
    _load.__init__()


# --- the CPUs other processes use -------------------------------------------------------------------------------------


_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def sample() -> tuple[float, float, float] | None:
    """(monotonic seconds, busy CPU seconds of the CPUs in our mask since boot, this process's CPU seconds), or None
    where ``/proc/stat`` cannot be read. Two samples give the CPUs others used in between.

    fastbert's one reading of the machine's load: the thread count's estimate below and the check of a one-time
    measurement (``cpu.py``) both look it up here by name, so what stands in for it (a simulated machine in the
    tests) stands in for both."""
    try:
        mask = os.sched_getaffinity(0)
        busy = 0
        with open("/proc/stat") as f:
            for line in f:  # the total "cpu" line, then one per CPU, then other counters
                if not line.startswith("cpu"):
                    break
                name, *values = line.split()
                if name != "cpu" and int(name[3:]) in mask:
                    # user nice system idle iowait irq softirq steal: idle and iowait are time nobody used
                    v = [int(x) for x in values[:8]]
                    busy += v[0] + v[1] + v[2] + v[5] + v[6] + v[7]
    except (AttributeError, OSError, ValueError, IndexError):
        return None
    own = os.times()
    return time.monotonic(), busy / _TICKS, own.user + own.system


class _Load:
    """A smoothed estimate of how many of our CPUs other processes keep busy, sampled at most every
    ``SAMPLE_SECONDS``."""

    def __init__(self):
        self.lock = threading.Lock()
        self.last = None  # the previous ``sample()``
        self.others = 0.0

    def others_now(self) -> float:
        """CPUs of our mask that other processes kept busy lately (0 where it cannot be read)."""
        last = self.last
        if last is not None and time.monotonic() - last[0] < SAMPLE_SECONDS:
            return self.others
        with self.lock:
            now = sample()
            if now is None:
                return self.others
            if self.last is not None and now[0] > self.last[0]:
                wall = now[0] - self.last[0]
                used = max(0.0, (now[1] - self.last[1]) - (now[2] - self.last[2])) / wall
                self.others = _SMOOTHING * used + (1 - _SMOOTHING) * self.others
            self.last = now
        return self.others


_load = _Load()


# --- the count a forward runs -----------------------------------------------------------------------------------------

_state = threading.local()  # .parallel: this thread ran a multi-threaded fastbert forward (its OpenMP pool exists);
#                             .outer: torch's thread count outside the fastbert forward running in this thread;
#                             .parts: this thread is one of that many running forwards side by side (``one_of``)
_forked_with_pool = False  # this process was forked from a thread with an OpenMP pool: one thread, or it hangs
_last = None  # the count the last forward ran


def for_forward() -> int:
    """The thread count of a CPU forward starting now."""
    global _last
    if _forked_with_pool:
        announce.note("this process was forked after its parent ran a multi-threaded forward: GNU OpenMP's threads "
                      "do not survive fork, so more than one thread here would hang (with transformers too). torch "
                      "runs one thread in it. Run warm-up forwards after the fork (gunicorn's post_fork, a pool's "
                      "initializer) or in a short-lived thread to keep every thread")
        return 1
    cap = limit()
    count = most()
    if cap.fixed is None and count > 1:
        others = _load.others_now()
        free = max(1, math.floor((cap.affinity - others) / _parts() + 0.5))  # (the forwards beside ours are ours)
        if free < count:
            # One message whatever the figure (said once per process): the figure, which changes with every
            # sample, is in report().
            announce.note(f"other processes keep some of this process's {cap.affinity} CPUs busy: fastbert's CPU "
                          "forwards run fewer threads while they do (OpenMP threads spinning for a descheduled peer "
                          "would slow every parallel region down); the count, and with it the low-order bits of "
                          "attention, follows the load (the latest figures: fastbert.info()['threads']; "
                          f"{ENV_NUM_THREADS} fixes the count)")
            count = free
    _last = count
    return count


def one_of(parts: int) -> int:
    """Make the calling thread one of ``parts`` threads that run CPU forwards side by side (a server's model
    instances): its forwards run its share, ``limit // parts`` threads (of ``FASTBERT_NUM_THREADS`` where set; at
    least one), and its share of the CPUs other processes leave free. torch's thread count is set to the share once
    here, so that forwards do not move the process-wide count (torch's and MKL's) back and forth under each other.
    Returns the share."""
    _state.parts = parts
    cap = limit()
    share = max(1, (cap.fixed or cap.threads) // parts)
    torch.set_num_threads(share)
    return share


def _parts() -> int:
    return getattr(_state, "parts", 1)


class running:
    """``with running(count):`` torch (and fastbert's kernels, which ask torch) use ``count`` threads in this thread,
    then what they used before."""

    def __init__(self, count: int):
        self.count = count

    def __enter__(self):
        self.before, self.outer = torch.get_num_threads(), getattr(_state, "outer", None)
        _state.outer = self.outer or self.before
        if self.count != self.before:
            torch.set_num_threads(self.count)
        if self.count > 1:
            _state.parallel = True
        return self.count

    def __exit__(self, *exc):
        if self.count != self.before:
            torch.set_num_threads(self.before)
        _state.outer = self.outer


def report() -> dict:
    """``fastbert.info()["threads"]``."""
    cap = limit()
    return {"torch": torch.get_num_threads(), "limit": cap.threads, "why": cap.why, "affinity": cap.affinity,
            "cgroup_quota": cap.quota, "adapts_to_load": cap.fixed is None, "others_cpus": round(_load.others, 2),
            "last_forward": _last, "forked_with_pool": _forked_with_pool}


# --- fork, and work that must not leave the caller's thread with a pool ---------------------------------------------


def in_own_thread(work, *args, threads: int | None = None):
    """``work(*args)`` in a short-lived thread running ``threads`` threads (default ``most()``): its OpenMP pool, if
    it makes one, ends with it, so a process forked later from the caller's thread does not hang. Its exception is
    re-raised here.

    Inside a fastbert forward (a decision's first measurement), or in a thread that ran a multi-threaded one, the
    work runs in place: the forward's own threads run here anyway, so nothing new is left behind, and a second pool
    beside this thread's would run slower than the forwards it decides for (GNU OpenMP with more threads than CPUs
    puts idle workers to sleep at once; seen: a 128-token bf16 GEMM on 2 threads at 1-thread speed, and the
    measurement calling the machine busy). Not in a process forked after a multi-threaded forward: its pool hangs."""
    threads = threads or most()
    if not _forked_with_pool and (getattr(_state, "parallel", False) or run.current() is not None):
        with running(threads):
            return work(*args)
    result, failure = [], []

    def body():
        try:
            with running(threads):
                result.append(work(*args))
        except BaseException as error:  # noqa: BLE001 - re-raised in the caller's thread
            failure.append(error)

    helper = threading.Thread(target=body, name="fastbert-measure", daemon=True)
    helper.start()
    helper.join()
    if failure:
        raise failure[0]
    return result[0]


def _before_fork():
    global _pool_in_forking_thread
    _pool_in_forking_thread = getattr(_state, "parallel", False)


def _after_fork_in_child():
    global _forked_with_pool, _limit
    _limit = None
    _load.__init__()
    if _pool_in_forking_thread:
        _forked_with_pool = True
        torch.set_num_threads(1)


_pool_in_forking_thread = False
if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)
