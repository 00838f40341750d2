"""CPU replay: an encoder forward runs the native steps that an earlier forward of the same plan and shape recorded,
without the Python of the ops between them.

A bert-base int8 forward at 1 x 128 on two cores (an Intel Xeon with VNNI) made 86 native calls (oneDNN's GEMMs,
fastbert._C's attention and LayerNorms) in ~28 ms, and ~6 ms more of Python around them: deciding, checking and
handing activations on, op by op.
Once a plan (``plan.py``) has run a shape, that Python has nothing left to decide: so the encoder's forward is
recorded once as the list of its *steps*, and the next forwards of that plan and shape call the steps alone.

- **Steps** are the functions marked ``run.step``: each calls native code on the tensors it is given and returns
  new ones (``int8/linear.py``'s GEMM calls and quantizers, ``ops/norm.py``'s ``layer_norm_cpu``,
  ``ops/attention_int8.py``'s launch). How their arguments are recorded: ``capture.py``.
- **What is captured**: the layers' forward (``layers.run_layers``) of an inference forward on the CPU, under a
  plan, the second time the plan meets the shape (the first teaches the int8 handoffs their targets), by a
  ``capture.Capture`` set as the forward's recorder (``run.Run.recorder``). The capture is dropped, and that shape
  runs op by op from then on, if any op ran a backend that is not made of steps (``dispatch.Backend.steps``), if a
  decision warned of a fallback, if a torch call between steps computed or copied, or if a step read a tensor of
  unknown origin.
- **What is checked before each replay**: the plan is the forward's (anything a decision read, unchanged: hooks,
  modules, settings, grad mode, ``.to()``), the shape is the one recorded, and the program is current
  (``program.py``). Otherwise that forward runs op by op and is captured again. A dense batch's shape is its batch
  and length. A packed batch's is its number of rows (and whether it has spare rows): the steps that depend on its
  sequences take the layout itself (the attention's), which each replay passes anew, so a server's batches of
  varied sequences (their rows bucketed, ``padding.bucket_rows``) meet programs (the int8 GEMMs, whose range is
  their input's real tokens, read the token count from the layout too: ``run.token_rows``). Where a step took what
  only these sequences give (the int8 attention takes the lengths: ``Capture.bound``), the program serves these
  very sequences, and that number of rows keeps programs per sequences. A derived weight
  rebuilt or dropped anywhere drops every program (``derived.when_replaced``), so none keeps an old one alive.
- **Not replayed**: forwards with gradients, ``output_hidden_states``, a padded dense batch (its rows are data),
  the int8 guard's recording forwards, and every forward that is not planned (torch.compile, export, torch.func).

``FASTBERT_CPU_REPLAY=off`` turns it off; ``fastbert.info()["replay"]`` counts captures, replays and why captures
were dropped.
"""

import threading
import weakref

import torch

from .. import derived, dispatch, run
from ..plan import Plan
from .capture import Capture, Glue
from .program import Program

CAPTURE_AT = 2  # the forward of a plan and shape that is captured (the first teaches the int8 handoffs)
MAX_SHAPES = 64  # shapes a plan keeps; past it, a new one replaces the oldest without a program (or the oldest)
_DROPPED = -1  # a shape whose capture was dropped: it runs op by op
_SEQUENCES = -2  # a number of packed rows whose programs serve the sequences they were recorded for only

_holding: "weakref.WeakSet[Plan]" = weakref.WeakSet()  # the plans holding programs
_counts = {"captured": 0, "replayed": 0}
_dropped: dict[str, int] = {}  # why a capture was dropped -> times
_lock = threading.Lock()


def forget() -> None:
    """Drop every program (a derived weight was replaced or dropped: none may keep the old one alive). Their shapes
    are captured again on their next forward."""
    for ref in list(_holding.data):  # (copied in one step: another thread may add a plan meanwhile)
        plan = ref()
        if plan is None:
            continue
        for key, entry in list(plan.replays.items()):
            if isinstance(entry, Program):
                plan.replays[key] = CAPTURE_AT - 1


derived.when_replaced(forget)


def report() -> dict:
    """What ``fastbert.info()`` shows: forwards captured and replayed in this process, and why captures were dropped."""
    with _lock:
        return {**_counts, "dropped": dict(_dropped)}


def _count(what: str) -> None:
    with _lock:
        _counts[what] += 1


def _shape(layout, x: torch.Tensor) -> tuple | None:
    """What a program is recorded for, or None where the layout's rows are data (a padded dense batch)."""
    if layout.columns is not None or not x.numel():
        return None
    if layout.packed:
        return "packed", layout.seqlens, layout.spare_rows, tuple(x.shape), x.dtype
    if layout.key_padding_mask is not None or layout.key_bounds is not None:
        return None
    return "dense", layout.batch, layout.seq_len, layout.spare_rows, tuple(x.shape), x.dtype


def _rows(layout, x: torch.Tensor) -> tuple:
    """What a packed program that serves any sequences of as many rows is recorded for (with or without spare rows:
    without, the tokens are every row)."""
    return "rows", layout.spare_rows == 0, tuple(x.shape), x.dtype


def encode(owner: torch.nn.Module, layers, x: torch.Tensor, layout, forward) -> torch.Tensor:
    """``forward(x)``, the forward of ``owner``'s ``layers`` op by op (x [rows, hidden] -> [rows, hidden]), or its
    replay where this plan captured them at this shape (see the module's notes)."""
    current = run.current()
    shape = None
    if current is not None and current.plan is not None and current.recorder is None and current.ranges is None \
            and type(x) is torch.Tensor and x.device.type == "cpu" and not torch.is_grad_enabled() \
            and dispatch.settings().cpu_replay != "off":  # (plain tensors: no subclass, proxy or fake one)
        shape = _shape(layout, x)
    if shape is None or not len(layers):
        return forward(x)
    shapes, forward_of = current.plan.replays, (id(owner), id(layers[0]), len(layers))
    key, exact = forward_of + shape, None  # (a dense batch's programs are of its shape)
    if layout.packed:
        rows = forward_of + _rows(layout, x)
        if shapes.get(rows) != _SEQUENCES:
            key, exact = rows, key
    entry = shapes.get(key)
    if isinstance(entry, Program):
        out = entry.run(x, layout) if entry.current() else None
        if out is not None:
            _count("replayed")
            return out
        entry = CAPTURE_AT - 1  # (weights written since: this forward rebuilds them and is captured again)
    if entry == _DROPPED:
        return forward(x)
    if entry is None and len(shapes) >= MAX_SHAPES:  # (the oldest shape that holds no program goes, else the oldest)
        met = list(shapes)
        shapes.pop(next((k for k in met if not isinstance(shapes.get(k), Program)), met[0]), None)
    seen = (entry or 0) + 1
    if seen < CAPTURE_AT:
        shapes[key] = seen
        return forward(x)
    return _capture(owner, x, layout, forward, current, key, exact)


def _capture(owner, x: torch.Tensor, layout, forward, current: run.Run, key: tuple, exact: tuple | None
             ) -> torch.Tensor:
    """Run and record ``forward(x)``, and keep its program under ``key``; or, where ``exact`` is the key of these
    very sequences and the steps took something only they give (``Capture.bound``), under ``exact``, ``key``
    marked so that its other sequences count and capture under their own."""
    capture = current.recorder = Capture(owner, x, layout)
    try:
        with Glue(capture):
            out = forward(x)
    finally:
        current.recorder = None
    output = capture.ref(out)
    plan = current.plan
    if exact is not None and capture.bound is not None:
        plan.replays[key], key = _SEQUENCES, exact
    program = Program(capture, output) if capture.failure is None else None
    if program is not None and not program.reads_current():  # (another thread rebuilt a derived weight meanwhile)
        plan.replays[key] = CAPTURE_AT - 1
        return out
    if capture.failure is not None:
        plan.replays[key] = _DROPPED
        with _lock:
            _dropped[capture.failure] = _dropped.get(capture.failure, 0) + 1
        return out
    plan.replays[key] = program
    _holding.add(plan)
    if not program.reads_current():  # (a weight replaced since the check: forget() may have run before the store)
        plan.replays[key] = CAPTURE_AT - 1
        return out
    _count("captured")
    return out
