"""What one forward knows beside its arguments: one ``Run`` object, entered once per model forward.

A model forward (``FusedModel._forward``, ``forward_packed``) enters a ``Run``; the ops it calls read it with
``current()``:

    plan       the forward's decisions, kept while nothing they read has changed (``plan.py``)
    layout     the rows of the activations that are real tokens (``padding.TokenLayout``), set once the inputs are
               prepared: the int8 GEMMs take their activation range over those rows only (``real_rows``)
    offer      the int8 handoff on offer: the u8 an op wrote beside its output for the int8 GEMM that reads it next
               (``int8/handoff.py``); ``offers``: those made in this forward, settled when it ends
    recorder   the replay capture recording this forward's native steps, or None (``replay/``)
    ranges     while the int8 guard records: {Linear: (low [in], high [in])} of the GEMM inputs (``int8/choices.py``)
    tally      counts the guard reads after its forwards (which backend an op ran, kernels launched), or None

``ranges`` and ``tally`` belong to whoever watches the forwards (the guard enters a ``Run`` of its own around them):
a forward's ``Run`` takes them from the ``Run`` around it. Everything else starts empty in every forward.

This module sits on the ground floor: it imports nothing of fastbert. What records a forward hooks in from above,
as tinygrad's JIT does with the capture slot of its lower ``realize`` module: the functions that make native calls
are marked ``@step`` here, and a recorder (``replay/capture.py``) is an object with ``inside`` (> 0 while a step
runs), ``call(fn, args, kwargs, replayed)``, ``decided(op, backend, warning)`` and ``derived_used(owner, name, params,
value)``.

The int8 path meets one shape of one plan three ways: its first forward runs op by op and teaches the int8
handoffs their targets; the second runs op by op again under a recorder; later ones replay the recorded steps.
"""

import collections
import functools
import threading

import torch

# (a thread-local, not a ContextVar: torch.compile traces attribute reads of a thread-local, not ContextVar.get)
_local = threading.local()  # .run: the Run of the forward running in this thread, or absent


def _get():
    return getattr(_local, "run", None)


class Run:
    """One forward's facts (see the module docstring); ``with Run(plan=...) as run:`` makes it ``current()``."""

    __slots__ = ("plan", "layout", "offer", "offers", "recorder", "ranges", "tally", "_masked_rows", "_outer")

    def __init__(self, plan=None, ranges: dict | None = None, tally: collections.Counter | None = None):
        self.plan = plan
        self.layout = None
        self.offer = None
        self.offers: list = []
        self.recorder = None
        self.ranges, self.tally = ranges, tally
        self._masked_rows = None

    def __enter__(self) -> "Run":
        self._outer = outer = _get()
        if outer is not None:  # (the watchers' fields carry into the forwards they watch)
            self.ranges = outer.ranges if self.ranges is None else self.ranges
            self.tally = outer.tally if self.tally is None else self.tally
        _local.run = self
        return self

    def __exit__(self, *exc):
        _local.run = self._outer
        for offer in self.offers:  # (each handoff made in this forward: a u8 nobody took unteaches its producer)
            offer.settle()
        self.offers = []
        self.offer = None

    def real_rows(self, x: torch.Tensor) -> int | torch.Tensor:
        """The rows of ``x`` that are tokens: a count of leading rows, or [R] row indices (a dense batch with
        padding, found once per forward)."""
        layout = self.layout
        if layout is None:
            return x.shape[0]
        if layout.packed or layout.key_padding_mask is None:
            return layout.tokens
        if self._masked_rows is None:
            self._masked_rows = layout.key_padding_mask.flatten().nonzero().squeeze(1)
        return self._masked_rows


def current() -> Run | None:
    """The ``Run`` of the forward running in this thread, or None outside a model forward."""
    return _get()


def real_rows(x: torch.Tensor) -> int | torch.Tensor:
    """``current().real_rows(x)``; every row of ``x`` outside a model forward."""
    run = _get()
    return x.shape[0] if run is None else run.real_rows(x)


def token_rows(x: torch.Tensor):
    """``real_rows(x)``, or the forward's layout itself where that is its token count (packed, or dense with every
    token real): a step given the layout reads ``layout.tokens``, and a replay passes its own layout, so the program
    serves other sequences of as many rows (``replay/``)."""
    run = _get()
    rows = real_rows(x)
    return run.layout if run is not None and run.layout is not None and type(rows) is int else rows


def count(what) -> None:
    """Add one to ``what`` in the tally of whoever watches the forward running here, if anyone does."""
    run = _get()
    if run is not None and run.tally is not None:
        run.tally[what] += 1


# --- the recorder's hooks ---------------------------------------------------------------------------------------


def recorder():
    """The recorder of the forward running here, or None."""
    run = _get()
    return None if run is None else run.recorder


def step(fn=None, *, replayed=None):
    """Mark ``fn`` as a step: native code on the tensors it is given, returning new ones (or a tuple of them). A
    recorder records the call with its arguments; otherwise it is a plain call. ``replayed``: ``fn`` without the
    checks that a replay's arguments pass by construction (``replay/program.py``: each tensor a step made has the
    device, dtype and strides that the recorded call's had, and its shape but for a number of token rows that the
    replay's layout gives; constants are the recorded ones), which a replay calls instead. What can change between
    replays keeps its checks there: a parameter, read anew; the encoder's input, whose strides the program's key
    does not fix (made contiguous, or its strides read, as in ``fn``). The layout is fastbert's own.
    ``@step`` or ``@step(replayed=...)``."""
    if fn is None:
        return functools.partial(step, replayed=replayed)

    @functools.wraps(fn)
    def recorded(*args, **kwargs):
        run = _get()
        capture = None if run is None else run.recorder
        if capture is None or capture.inside:
            return fn(*args, **kwargs)
        return capture.call(fn, args, kwargs, replayed or fn)

    return recorded


class aside:
    """``with aside():`` work that is no step of the forward and no glue between steps (building a derived weight:
    a replay checks that it still holds instead of building it)."""

    __slots__ = ("capture",)

    def __enter__(self):
        self.capture = recorder()
        if self.capture is not None:
            self.capture.inside += 1

    def __exit__(self, *exc):
        if self.capture is not None:
            self.capture.inside -= 1


def decided(op: str, backend, warning: str | None) -> None:
    """An op of the forward runs ``backend`` (``dispatch.Decision``; ``warning``: the fallback it announced): a
    recorder judges whether the forward can still be replayed."""
    capture = recorder()
    if capture is not None and not capture.inside:
        capture.decided(op, backend, warning)


def derived_used(owner, name: str, params: tuple, value) -> None:
    """A derived weight was read (``derived.cached``): a recorder notes it, for a replay to check it first."""
    capture = recorder()
    if capture is not None:
        capture.derived_used(owner, name, params, value)
