"""A recorded encoder forward: its steps, replayed for later forwards of the same plan and shape (or, packed, of as
many rows: ``capture.Capture.bound``).

The outputs are the op-by-op forward's, bit for bit: the same native calls on the same values. A replay holds no
more activations at once than the forward: each step's outputs are let go after the last step that reads them.
Before each replay, ``current()`` checks that every derived weight the capture used still holds what it was built
from and that the module attributes the glue read hold what they did. Steps run as ``run.step``'s ``replayed``
form: their checks of what a program fixes were made when it was recorded.
"""

import torch

from .. import derived
from .capture import CONST, LAYOUT, PARAM, SLOT, Capture


class Program:
    """A captured encoder forward: its steps, where its output is, and the derived weights it read."""

    __slots__ = ("steps", "output", "derived", "derived_params", "derived_state", "size", "params", "attributes")

    def __init__(self, capture: Capture, output: tuple):
        # each step with the slots to let go after it (the last step that reads them), so a replay holds no more
        # activations at once than the forward it replays
        released: list[list[int]] = [[] for _ in capture.steps]
        for slot, (made_by, last_use) in enumerate(zip(capture.made_by, capture.last_use)):
            if last_use < len(capture.steps):
                released[max(made_by, last_use)].append(slot)
        self.steps = tuple((fn, *_template(refs), *_template(kwrefs), outputs, many, tuple(r))
                           for (fn, refs, kwrefs, outputs, many), r in zip(capture.steps, released))
        self.output, self.size, self.params = output, len(capture.geometry), tuple(capture.params)
        self.derived, self.attributes = tuple(capture.derived), capture.attributes
        self.derived_params = tuple(ref for _, _, refs, _ in self.derived for ref in refs)  # (joint_state's order)
        # (taken before each value is checked to be current: a write in between fails the check or moves the state)
        used = self._derived_now()
        self.derived_state = None if used is None else derived.joint_state(used)
        if used is None or not all(derived.current(*record[:3]) is record[3] for record in used):
            self.derived_state = None

    def _derived_now(self) -> list[tuple] | None:
        """The derived weights' records with their parameters, or None where one of those was freed."""
        used = []
        for owner, name, refs, value in self.derived:
            params = tuple(ref() for ref in refs)
            if any(p is None for p in params):
                return None
            used.append((owner, name, params, value))
        return used

    def current(self) -> bool:
        """Whether the derived weights it read still hold what they were built from, and the attributes the glue
        read still hold what they did: checked before each replay. (A derived weight rebuilt or dropped anywhere drops
        every program, ``replay.forget``: what is left to compare is its parameters' state, in one native call.)"""
        if self.derived_state is None or any(module.__dict__.get(name) != value
                                             for module, name, value in self.attributes):
            return False
        params = tuple([ref() for ref in self.derived_params])
        for p in params:
            if p is None:
                return False
        return derived.state(params) == self.derived_state

    def reads_current(self) -> bool:
        """``current``, and every derived weight it read is still the very one ``derived.cached`` would give now:
        checked where a program is stored (another thread may rebuild a weight, and run ``replay.forget``, while it
        is captured)."""
        used = self._derived_now()
        return self.current() and used is not None and derived.joint_state(used) == self.derived_state

    def run(self, x: torch.Tensor, layout) -> torch.Tensor | None:
        """The encoder's output for input x laid out as ``layout`` (``padding.TokenLayout``: what the steps that take
        it get), or None where a parameter it reads was freed since (then the forward runs op by op)."""
        params = [ref() for ref in self.params]  # (read again: in-place writes are the forward's to see)
        if any(p is None for p in params):
            return None
        values = [None] * self.size
        values[0] = x
        for fn, args, slotted, kwargs, kwslotted, outputs, many, released in self.steps:
            if slotted:
                args = list(args)
                for i, ref in slotted:
                    args[i] = _value(values, params, layout, ref)
            if kwslotted:
                kwargs = dict(kwargs)
                for name, ref in kwslotted:
                    kwargs[name] = _value(values, params, layout, ref)
            result = fn(*args, **kwargs)
            for slot, out in zip(outputs, result if many else (result,)):
                if slot is not None:
                    values[slot] = out
            for slot in released:
                values[slot] = None
        return _value(values, params, layout, self.output)


def _template(refs):
    """Recorded arguments (a tuple or a dict of refs) -> (the constants in place, the rest as (position, ref))."""
    items = refs.items() if isinstance(refs, dict) else enumerate(refs)
    slotted = tuple((at, ref) for at, ref in items if ref[0] != CONST)
    if isinstance(refs, dict):
        return {name: ref[1] if ref[0] == CONST else None for name, ref in refs.items()}, slotted
    return tuple(ref[1] if ref[0] == CONST else None for ref in refs), slotted


def _value(values: list, params: list, layout, ref: tuple):
    kind = ref[0]
    if kind == SLOT:
        return values[ref[1]]
    if kind == PARAM:
        return params[ref[1]]
    if kind == CONST:
        return ref[1]
    if kind == LAYOUT:
        return layout
    base, shape = values[ref[1]], ref[3]
    if ref[5]:  # (a view of the tokens' rows: this layout's)
        shape = (layout.tokens, *shape[1:])
    return base.as_strided(shape, ref[4], base.storage_offset() + ref[2])


