"""Fallbacks and differences are never silent: each is warned once, at the caller's line, and kept for
``fastbert.info()``.

A fallback is anything that runs slower code than the user might expect: a torch op instead of a fused kernel
(gradients, dropout, a dtype without a kernel), or transformers' own implementation for a whole forward (an option
fastbert does not accelerate, a hooked module). A note is anything else the user should know at run time: where
fastbert's output legitimately differs from transformers' (left padding read by a head), or where this machine makes
a setting slow. The warning points at the first frame outside fastbert, torch and transformers, so it names the
user's line, not ours.
"""

import os
import sys
import threading
import warnings

import torch
import transformers

_lock = threading.Lock()
_seen: dict[str, int] = {}  # fallback message -> times it applied (shown once, counted always)
_notes: dict[str, int] = {}  # note -> times it applied


def _library_dirs() -> tuple[str, ...]:
    """Directories of library code, whose frames are not the caller's (fastbert.kernels may live apart in an
    editable install)."""
    from . import kernels

    # (__path__, not __file__: fastbert.kernels is a namespace package, without a file of its own)
    packages = (sys.modules[__package__], kernels, torch, transformers)
    return tuple(os.path.abspath(folder) + os.sep for p in packages for folder in p.__path__)


def fallback(message: str) -> None:
    """Warn once (per process) that ``message`` applies, at the caller's line; count every time it applies."""
    with _lock:
        first = message not in _seen
        _seen[message] = _seen.get(message, 0) + 1
    if first:
        warnings.warn(f"fastbert: {message}", RuntimeWarning, stacklevel=_caller_stacklevel())


def note(message: str) -> None:
    """Warn once (per process) that ``message`` applies, at the caller's line; count every time it applies."""
    with _lock:
        first = message not in _notes
        _notes[message] = _notes.get(message, 0) + 1
    if first:
        warnings.warn(f"fastbert: {message}", UserWarning, stacklevel=_caller_stacklevel())


def notes() -> dict[str, int]:
    """Every note met in this process, with how many times it applied."""
    with _lock:
        return dict(_notes)


def seen() -> dict[str, int]:
    """Every fallback reason met in this process, with how many times it applied."""
    with _lock:
        return dict(_seen)


def _caller_stacklevel() -> int:
    """``warnings.warn``'s stacklevel of the first frame outside fastbert, torch and transformers."""
    library = _library_dirs()
    frame, level = sys._getframe(2), 2  # 1 would be fallback() itself
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(library):
        frame, level = frame.f_back, level + 1
    return level if frame is not None else 2
