"""An activation handed to the int8 GEMM that reads it together with its u8, written by the op that produced it, so
no pass reads the float32 activation again only to quantize it.

    producer   y [tokens, hidden] float32 (the LayerNorm before QKV and before the FFN's first GEMM; the int8
               attention before the O projection), and in the same pass q = u8 of y / smooth with the consumer's
               static (scale, zero point)
    consumer   the int8 GEMM reading y with a static scale (``int8_linear.linear``): takes q when it was made from
               this very tensor with its own (scale, zero point, smooth); otherwise quantizes y itself

A producer learns what to write from its consumer: on the first forward there is no handoff, and the consumer leaves
its static parameters on the producer (a module, held weakly) for the next one. A handoff that goes untaken (the
consumer now runs float32, has other scales, sits behind a hook or reads another tensor) clears them. The result
never depends on a handoff: taken, q is the bytes the consumer's own quantization of y would give
(``tests/test_int8_handoff.py``).

One offer at a time per thread: the consumer reads y right after the producer wrote it (the next op of the layer),
and nothing writes y in between (the handoff is keyed on the tensor object). Whether an offer was taken is kept per
thread, so concurrent forwards of one model do not judge each other's pending offers.
"""

import threading
import weakref
from typing import NamedTuple

import torch
from torch import nn


class Target(NamedTuple):
    """The static quantization a consumer applies to its input: u8 of x / smooth with scale and zero point."""

    scale: float
    zero_point: int
    smooth: torch.Tensor | None  # compared by identity: the consumer's own divisor tensor


class _Offer:
    __slots__ = ("producer", "y", "q", "target", "outcome")

    def __init__(self, producer: nn.Module, y: torch.Tensor, q: torch.Tensor | None, target: Target | None,
                 outcome: "_Outcome | None"):
        self.producer, self.y, self.q = weakref.ref(producer), weakref.ref(y), q
        self.target, self.outcome = target, outcome


class _Outcome:
    """Whether a producer's u8 was taken (no tensor held: the u8 lives only until its consumer reads it)."""

    __slots__ = ("taken",)

    def __init__(self):
        self.taken = False


_targets: "weakref.WeakKeyDictionary[nn.Module, Target]" = weakref.WeakKeyDictionary()
_thread = threading.local()  # .offer: this thread's latest _Offer; .outcomes: {producer: _Outcome of its last u8}


def _outcomes() -> "weakref.WeakKeyDictionary[nn.Module, _Outcome]":
    outcomes = getattr(_thread, "outcomes", None)
    if outcomes is None:
        outcomes = _thread.outcomes = weakref.WeakKeyDictionary()
    return outcomes


def target(producer: nn.Module) -> Target | None:
    """What ``producer`` should quantize its output with this call, or None. A producer whose last u8 in this thread
    went untaken loses its target (no u8 is written for nobody); its consumer teaches it again."""
    wanted = _targets.get(producer)
    if wanted is None:
        return None
    last = _outcomes().get(producer)
    if last is not None and not last.taken:
        _targets.pop(producer, None)
        return None
    return wanted


def offer(producer: nn.Module, y: torch.Tensor, q: torch.Tensor | None, made_with: Target | None) -> None:
    """``producer`` wrote y (and q, the u8 of y with ``made_with``, or None) for the op that reads y next."""
    outcome = None
    if q is None:
        _outcomes().pop(producer, None)
    else:
        outcome = _outcomes()[producer] = _Outcome()
    _thread.offer = _Offer(producer, y, q, made_with, outcome)


def take(x: torch.Tensor, scale: float, zero_point: int, smooth: torch.Tensor | None) -> torch.Tensor | None:
    """The u8 of ``x`` a producer wrote with exactly these parameters, or None (then the caller quantizes x, and the
    producer of x, if any, learns the parameters for its next call)."""
    handed = getattr(_thread, "offer", None)
    if handed is None or handed.y() is not x:
        return None
    _thread.offer = None  # (one consumer per offer; the u8 is not kept past it)
    made_with = handed.target
    if handed.q is not None and made_with is not None and made_with.scale == scale and \
            made_with.zero_point == zero_point and made_with.smooth is smooth:
        handed.outcome.taken = True
        return handed.q
    producer = handed.producer()
    if producer is not None:
        _targets[producer] = Target(scale, zero_point, smooth)
    return None
