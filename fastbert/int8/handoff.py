"""An activation handed to the int8 GEMM that reads it together with its u8, written by the op that produced it, so
no pass reads the float32 activation again only to quantize it.

    producer   y [tokens, hidden] float32 (the LayerNorm before QKV and before the FFN's first GEMM; the int8
               attention before the O projection), and in the same pass q = u8 of y / smooth with the consumer's
               static (scale, zero point)
    consumer   the int8 GEMM reading y with a static scale (``int8_linear.linear``): takes q when it was made from
               this very tensor with its own (scale, zero point, smooth); otherwise quantizes y itself

A producer learns what to write from its consumer: on the first forward there is no handoff, and the consumer leaves
its static parameters on the producer (a module, held weakly) for the next one; a consumer with other scales teaches
the new ones. A handoff no consumer answers (the consumer now runs float32, sits behind a hook or reads another
tensor) clears them. The result never depends on a handoff: taken, q is the bytes the consumer's own quantization of
y would give (``tests/test_int8_handoff.py``).

One offer at a time per forward (``run.Run.offer``): the consumer reads y right after the producer wrote it (the
next op of the layer), and nothing writes y in between (the handoff is keyed on the tensor object). The offers are
scoped to one forward: when it ends, a producer whose u8 no consumer answered loses its target (no u8 is written for
nobody next time; its consumer teaches it again), so concurrent forwards of one model never judge each other's
offers.
Outside a model forward nothing is offered (an op called alone writes its u8 for nobody).
"""

import weakref
from typing import NamedTuple

import torch
from torch import nn

from .. import run


class Target(NamedTuple):
    """The static quantization a consumer applies to its input: u8 of x / smooth with scale and zero point."""

    scale: float
    zero_point: int
    smooth: torch.Tensor | None  # compared by identity: the consumer's own divisor tensor


class _Offer:
    """What a producer wrote for the next op: y (held weakly), its u8 q (or None) and the target q was made with."""

    __slots__ = ("producer", "y", "q", "target", "answered")

    def __init__(self, producer: nn.Module, y: torch.Tensor, q: torch.Tensor | None, target: Target | None):
        self.producer, self.y, self.q = weakref.ref(producer), weakref.ref(y), q
        self.target, self.answered = target, False  # answered: its consumer took the u8, or taught other parameters

    def settle(self) -> None:
        """The forward ends (``run.Run.__exit__``): a u8 no consumer answered unteaches its producer."""
        producer = self.producer()
        if not self.answered and producer is not None:
            _targets.pop(producer, None)


_targets: "weakref.WeakKeyDictionary[nn.Module, Target]" = weakref.WeakKeyDictionary()


def target(producer: nn.Module) -> Target | None:
    """What ``producer`` should quantize its output with, as its consumer taught it, or None."""
    return _targets.get(producer)


def offer(producer: nn.Module, y: torch.Tensor, q: torch.Tensor | None, made_with: Target | None) -> None:
    """``producer`` wrote y (and q, the u8 of y with ``made_with``, or None) for the op that reads y next."""
    current = run.current()
    if current is None:
        return
    if current.offer is not None:  # (its consumer has had its turn: its u8 need not live on)
        current.offer.q = None
    current.offer = handed = _Offer(producer, y, q, made_with)
    if q is not None:
        current.offers.append(handed)


def take(x: torch.Tensor, scale: float, zero_point: int, smooth: torch.Tensor | None) -> torch.Tensor | None:
    """The u8 of ``x`` a producer wrote with exactly these parameters, or None (then the caller quantizes x, and the
    producer of x, if any, learns the parameters for its next call)."""
    current = run.current()
    handed = None if current is None else current.offer
    if handed is None or handed.y() is not x:
        return None
    current.offer = None  # (one consumer per offer; the u8 is not kept past it)
    handed.answered = True
    made_with = handed.target
    if handed.q is not None and made_with is not None and made_with.scale == scale and \
            made_with.zero_point == zero_point and made_with.smooth is smooth:
        q, handed.q = handed.q, None  # (the u8 lives only until its consumer reads it)
        return q
    producer = handed.producer()
    if producer is not None:
        _targets[producer] = Target(scale, zero_point, smooth)
    return None
