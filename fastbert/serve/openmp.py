"""GNU OpenMP's idle workers in a server: spin briefly, then sleep.

After each parallel region libgomp's workers spin (``GOMP_SPINCOUNT``: 300,000 iterations unless set) before they
sleep, so that the next region starts at once: right for a script, whose forwards follow each other. A server's
model threads share the CPUs with its event loop and its tokenizing threads, and the spinning after each forward
takes the CPU from the thread that answers the request and parses the next one. On a 2-core AMD EPYC (Zen 3), real
all-MiniLM-L6-v2, the openai client on the same machine, two rounds each: with 10,000 iterations, concurrency-1 p50
16.2 -> 14.8 and 15.7 -> 13.8 ms, concurrency 32 4,268 -> 4,761 and 4,246 -> 4,383 tokens/s; with no spinning at all
(``OMP_WAIT_POLICY=PASSIVE``: a sleep and a wake-up per region) concurrency-1 p50 23.9 and 18.8 ms.

libgomp reads the variable once, when torch loads it, so the ``fastbert`` command restarts itself with it set (an
exec right after its arguments are parsed: the same process id and name, a second start of Python and its imports)
where it is unset and torch runs on GNU OpenMP. A ``GOMP_SPINCOUNT`` or ``OMP_WAIT_POLICY`` the user set is kept,
and only the command's own process restarts (``fastbert.__main__.command``), never one that calls fastbert's
functions. The start-up log says what runs.
"""

import os
import sys

SPIN_COUNT = 10_000
_RESTARTED = "_FASTBERT_SERVE_RESTARTED"  # in the restarted process's environment only: it never restarts twice
_outcome: dict[str, str | bool] = {"restarted": False, "failed": ""}  # what ``restart_once`` did, for ``describe``


def restart_environment() -> dict[str, str] | None:
    """The environment to restart the command in, or None where it runs as it should already: not Linux, the user
    chose (``GOMP_SPINCOUNT`` or ``OMP_WAIT_POLICY`` set), restarted already, torch not on GNU OpenMP, or arguments
    that are not the ones this process was started with (``sys.argv`` changed by the code that runs it)."""
    started_with = sys.orig_argv[len(sys.orig_argv) - len(sys.argv) + 1:] if len(sys.argv) <= len(sys.orig_argv) \
        else None
    if (sys.platform != "linux" or _RESTARTED in os.environ or "GOMP_SPINCOUNT" in os.environ
            or "OMP_WAIT_POLICY" in os.environ or started_with != sys.argv[1:] or not gnu_openmp()):
        return None
    return {**os.environ, "GOMP_SPINCOUNT": str(SPIN_COUNT), _RESTARTED: "1"}


def restart_once() -> None:
    """In the command's own process: exec it again with the spin count set (``restart_environment``); returns where
    that is not to be done, in the restarted process, or where the exec failed (then it runs as it is, and says so)."""
    if os.environ.pop(_RESTARTED, None) is not None:  # (not passed on to processes it starts)
        _outcome["restarted"] = True
        return
    environment = restart_environment()
    if environment is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        if sys.orig_argv[1:] == sys.argv and os.access(sys.argv[0], os.X_OK):  # the console script: keep its name
            os.execve(sys.argv[0], sys.argv, environment)
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], environment)
    except OSError as error:
        _outcome["failed"] = str(error)


def describe() -> str | None:
    """The start-up log's line on it, or None where torch does not run on GNU OpenMP."""
    if not gnu_openmp():
        return None
    if _outcome["restarted"]:
        return (f"OpenMP: idle workers spin {SPIN_COUNT:,} iterations, then sleep (GOMP_SPINCOUNT, set by fastbert "
                "serve: the server's threads share the CPUs; set it yourself to choose)")
    chosen = {name: os.environ[name] for name in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY") if name in os.environ}
    if chosen:
        return "OpenMP: " + ", ".join(f"{name}={value}" for name, value in chosen.items()) + " (yours)"
    why = f"its restart failed: {_outcome['failed']}" if _outcome["failed"] else "not started as the command"
    return f"OpenMP: GNU OpenMP's default spin count ({why}; GOMP_SPINCOUNT={SPIN_COUNT} serves faster)"


def gnu_openmp() -> bool:
    """Whether torch runs on GNU OpenMP here (libgomp is loaded in this process)."""
    try:
        with open("/proc/self/maps") as f:
            return "libgomp" in f.read()
    except OSError:
        return False
