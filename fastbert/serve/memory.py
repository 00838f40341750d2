"""The server's memory: glibc's malloc keeps what a large request freed (its body, its parsed text) in its heap, and
keeps growing that heap with each new batch shape. ``give_back`` returns the free part of the heap to the system
after a large request; ``allocator_advice`` says, at start-up, how to keep the growth flat (docs/serving.md,
"Memory")."""

import ctypes
import ctypes.util

from .._openmp import process_maps

LARGE_BODY = 1 << 20  # bytes: a request this large gives the memory it freed back when it is answered

_trim = getattr(ctypes.CDLL(None), "malloc_trim", None)  # (glibc's; None elsewhere)


def give_back() -> None:
    """Return the free memory at the top and inside glibc's heaps to the system (nothing where malloc is not
    glibc's; under tcmalloc, whose memory glibc does not hold, a cheap no-op)."""
    if _trim is not None:
        _trim(0)


def allocator_advice() -> str | None:
    """What to say when this process allocates with glibc's malloc (None under tcmalloc or jemalloc, or where it
    cannot be told). A server's batches have a new shape nearly every time, and glibc's heap keeps growing with
    them, as it does under transformers; tcmalloc keeps the memory flat."""
    maps = process_maps()
    if "libc.so" not in maps or "tcmalloc" in maps or "jemalloc" in maps:
        return None
    # (tcmalloc only: the allocator measured, benchmarks/memory.py)
    found = next(filter(None, map(ctypes.util.find_library, ("tcmalloc_minimal", "tcmalloc"))), None)
    remedy = f"start it with LD_PRELOAD={found}" if found else "install tcmalloc (libtcmalloc-minimal4, gperftools)"
    return ("memory: glibc's malloc, whose heap grows with new batch shapes (resident memory keeps rising); "
            f"{remedy} to keep it flat (docs/serving.md, Memory)")
