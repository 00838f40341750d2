"""The per-machine store of one-time measurements: ``$FASTBERT_CACHE_DIR/cpu_gemm.json`` (default
``~/.cache/fastbert``), so that every process on a machine makes the choices the first one measured.

What it guarantees, whatever happens to the file or the machine:

- **Nothing read is trusted unchecked.** An entry is used only if it holds, for each library measured, a dict of
  integer token counts to finite positive figures, with the token counts expected. A malformed entry (or a file that
  is not JSON) is treated as absent: measured again, rewritten, and warned about naming the file.
- **One measurement per machine, not one per process.** A process that finds no entry takes a file lock, reads again,
  and measures only if the entry is still missing: processes starting together wait for the first one and use its
  figures.
- **Load never decides.** A measurement whose threads did not get the CPU (their CPU time below ``BUSY_RATIO`` of
  wall time, or other processes busy on the CPUs they need) is not stored. A marker is stored instead, for
  ``BUSY_SECONDS``: until it expires every process on the machine uses the defaults (what transformers runs) without
  measuring, and then one measures again.
- **Bounded.** At most ``MAX_ENTRIES`` entries (the oldest go first), each replaced whole and atomically.
- A store that cannot be written (a read-only home) is said once; each process then measures for itself.
"""

import contextlib
import json
import math
import os
import tempfile
import threading
import time

from . import announce

ENV_CACHE_DIR = "FASTBERT_CACHE_DIR"
FILE_NAME = "cpu_gemm.json"
MAX_ENTRIES = 64
BUSY_SECONDS = 600.0  # how long a machine found busy keeps the defaults before the next measurement
BUSY_RATIO = 0.8  # a measurement's CPU time under this share of its wall time x threads: it did not get the CPU
LOCK_SECONDS = 120.0  # the longest a process waits for another one's measurement

_lock = threading.Lock()  # one measurement per process at a time (the file lock orders processes)


def path() -> str:
    folder = os.environ.get(ENV_CACHE_DIR) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "fastbert")
    return os.path.join(folder, FILE_NAME)


# --- reading -------------------------------------------------------------------------------------------------------


def _read_file(file: str) -> dict:
    """The store's entries; {} for a missing file, and for an unreadable one after a warning."""
    try:
        with open(file) as f:
            store = json.load(f)
    except (FileNotFoundError, NotADirectoryError):
        return {}
    except (OSError, ValueError) as error:
        announce.fallback(f"the measurement store {file} cannot be read ({error}): fastbert measures again and "
                          "rewrites it")
        return {}
    if not isinstance(store, dict):
        announce.fallback(f"the measurement store {file} holds a {type(store).__name__}, not a dict of entries: "
                          "fastbert measures again and rewrites it")
        return {}
    return store


def why_invalid(entry, libraries: tuple[str, ...], tokens: tuple[int, ...]) -> str | None:
    """Why a stored entry cannot be used for ``libraries`` measured at ``tokens`` (None: it can)."""
    if not isinstance(entry, dict):
        return f"a {type(entry).__name__}, not a dict"
    if "busy_until" in entry:
        until = entry["busy_until"]
        if not isinstance(until, (int, float)) or not math.isfinite(until):
            return f"busy_until is {until!r}, not a time"
        return None
    for library in libraries:
        figures = entry.get(library)
        if not isinstance(figures, dict):
            return f"{library!r} holds {figures!r}, not a dict of token counts to figures"
        try:
            keys = sorted(int(t) for t in figures)
        except (TypeError, ValueError):
            return f"{library!r} has token counts that are not integers: {sorted(figures)!r}"
        if keys != sorted(tokens):
            return f"{library!r} was measured at {keys} tokens, not {sorted(tokens)}"
        for value in figures.values():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value <= 0:
                return f"{library!r} holds {value!r}, not a finite positive figure"
    return None


def _usable(store: dict, key: str, libraries, tokens, file: str) -> dict | None:
    """The entry under ``key`` if it can be used now; a malformed one is warned about (it is then measured again)."""
    entry = store.get(key)
    if entry is None:
        return None
    why = why_invalid(entry, libraries, tokens)
    if why is not None:
        announce.fallback(f"the measurement store {file} has a malformed entry for {key!r} ({why}): fastbert "
                          "measures again and rewrites it")
        return None
    if "busy_until" in entry and entry["busy_until"] <= time.time():
        return None  # the machine was busy; long enough ago to measure again
    return entry


# --- writing -------------------------------------------------------------------------------------------------------

_read_only_said = False


def _write(file: str, key: str, entry: dict) -> None:
    """Store ``entry`` under ``key``, atomically, keeping the newest ``MAX_ENTRIES`` (malformed ones dropped)."""
    global _read_only_said
    try:
        os.makedirs(os.path.dirname(file), exist_ok=True)
        store = {k: v for k, v in _read_file(file).items() if isinstance(v, dict)}
        store[key] = entry
        newest = sorted(store, key=lambda k: _time_of(store[k]), reverse=True)[:MAX_ENTRIES]
        handle, temporary = tempfile.mkstemp(dir=os.path.dirname(file), suffix=".tmp")
        with os.fdopen(handle, "w") as f:
            json.dump({k: store[k] for k in sorted(newest)}, f, indent=1, sort_keys=True)
        os.replace(temporary, file)
    except OSError as error:
        if not _read_only_said:
            _read_only_said = True
            announce.note(f"the measurement store {file} cannot be written ({error}): each process measures this "
                          f"machine again (set {ENV_CACHE_DIR} to a writable folder to keep one measurement)")


def _time_of(entry: dict) -> float:
    value = entry.get("measured_at", entry.get("busy_until", 0.0))
    return value if isinstance(value, (int, float)) and math.isfinite(value) else 0.0


@contextlib.contextmanager
def _file_lock(file: str):
    """An exclusive lock on ``file``.lock (waits at most ``LOCK_SECONDS``; no lock where it cannot be taken)."""
    handle = None
    try:
        import fcntl

        os.makedirs(os.path.dirname(file), exist_ok=True)
        handle = open(file + ".lock", "a")
        deadline = time.monotonic() + LOCK_SECONDS
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    break  # another process holds it too long: measure without it
                time.sleep(0.05)
    except (ImportError, OSError):
        pass
    try:
        yield
    finally:
        if handle is not None:
            handle.close()  # (releases the lock)


# --- the one entry point -------------------------------------------------------------------------------------------


def figures(key: str, libraries: tuple[str, ...], tokens: tuple[int, ...], measure) -> dict:
    """The figures under ``key``: {library: {tokens: figure}, "source": the file they came from, or "measured"}; or,
    where the machine was (or is) too busy to measure, {"busy": why, "source": ...} (callers keep their defaults).

    ``measure()`` -> (figures {library: {tokens: figure}}, why it was busy or None) runs only when no usable entry
    exists, under the file lock."""
    file = path()
    entry = _usable(_read_file(file), key, libraries, tokens, file)
    if entry is None:
        with _lock, _file_lock(file):
            entry = _usable(_read_file(file), key, libraries, tokens, file)  # (another process may have measured)
            if entry is None:
                measured, busy = measure()
                if busy is None:
                    _write(file, key, {**measured, "measured_at": time.time()})
                    return {**_as_ints(measured, libraries), "source": "measured"}
                _write(file, key, {"busy_until": time.time() + BUSY_SECONDS, "busy": busy})
                return {"busy": busy, "source": "measured now, busy"}
    if "busy_until" in entry:
        return {"busy": str(entry.get("busy", "the machine was busy")), "source": file}
    return {**_as_ints(entry, libraries), "source": file}


def _as_ints(entry: dict, libraries) -> dict:
    # (by token count, as measured: the file keeps its keys as sorted strings, "1024" before "128")
    return {lib: dict(sorted((int(t), float(g)) for t, g in entry[lib].items())) for lib in libraries}
