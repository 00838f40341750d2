"""CPU replay: an encoder forward runs the native steps that an earlier forward of the same plan and shape recorded,
without the Python of the ops between them.

A bert-base int8 forward at 1 x 128 on two cores makes 86 native calls (oneDNN's GEMMs, fastbert._C's attention and
LayerNorms) in ~28 ms, and ~6 ms more of Python around them: deciding, checking and handing activations on, op by op.
Once a plan (``plan.py``) has run a shape, that Python has nothing left to decide: so the encoder's forward is
recorded once as the list of its *steps*, and the next forwards of that plan and shape call the steps alone.

- **Steps** are the functions marked ``@step``: each calls native code on the tensors it is given and returns new
  ones (``int8_linear``'s GEMM calls and quantizers, ``norm.layer_norm_cpu``, ``attention_int8``'s launch). While a
  forward is captured, a step's arguments are recorded as what they are: the encoder's input, an earlier step's
  output or a view of its memory, a parameter of the encoder (held weakly, read again at each replay), a derived
  weight (``derived.py``), an int8 choice's tensor, or a Python value.
- **What is captured**: the layers' forward (``layers.run_layers``) of an inference forward on the CPU, under a
  plan, the second time the plan meets the shape (the first teaches the int8 handoffs their targets). The capture
  is dropped, and that shape runs op by op from then on, if any op ran a backend that is not made of steps, if a
  decision warned of a fallback, if a torch call between steps computed or copied (a ``TorchFunctionMode`` watches
  the glue), or if a step read a tensor of unknown origin.
- **What is checked before each replay**: the plan is the forward's (anything a decision read, unchanged: hooks,
  modules, settings, grad mode, ``.to()``), the shape is the one recorded (batch, length, or the packed sequences'
  lengths, and the spare rows), the module attributes the glue reads (``_READ_ATTRIBUTES``) hold what they did, and
  every derived weight the capture used is still the current one (parameters written in place, re-pointed or freed
  rebuild or drop them). Otherwise that forward runs op by op and is captured again. A derived weight rebuilt or
  dropped anywhere drops every program, so none keeps an old one alive.
- **Not replayed**: forwards with gradients, ``output_hidden_states``, a padded dense batch (its rows are data),
  the guard's recording forwards, and every forward that is not planned (torch.compile, export, torch.func).

The outputs are the op-by-op forward's, bit for bit: the same native calls on the same values. A replay holds no
more activations at once than the forward: each step's outputs are let go after the last step that reads them.
``FASTBERT_CPU_REPLAY=off`` turns it off; ``fastbert.info()["replay"]`` counts captures, replays and why captures
were dropped.
"""

import functools
import threading
import weakref

import torch
from torch.overrides import TorchFunctionMode

from . import dispatch, plan as plans

# (op, backend) whose every native call is a step; the torch backends of ``mlp`` and ``bias_act`` only call other ops
# (``bias_act`` and ``layer_norm``; ``gemm``), whose own decisions are judged in turn
STEP_BACKENDS = frozenset({("gemm", "int8"), ("attention", "cpu-int8"), ("layer_norm", "cpu-ext"), ("mlp", "int8"),
                           ("mlp", "torch"), ("bias_act", "torch")})
CAPTURE_AT = 2  # the forward of a plan and shape that is captured (the first teaches the int8 handoffs)
MAX_SHAPES = 64  # shapes a plan keeps; past it, a new one replaces the oldest without a program (or the oldest)
# module attributes that the glue reads and passes to steps as numbers (a LayerNorm's eps, attention head counts)
_READ_ATTRIBUTES = ("eps", "variance_epsilon", "num_attention_heads", "n_heads")
# torch calls of the glue between steps that compute nothing (shapes, views, pointers)
_GLUE = frozenset({
    "view", "__getitem__", "size", "dim", "is_contiguous", "contiguous", "detach", "data_ptr", "__get__", "stride",
    "storage_offset", "numel", "is_floating_point", "is_inference", "__len__", "is_complex", "element_size",
})

_thread = threading.local()  # .capture: the _Capture running in this thread, or None
_holding: "weakref.WeakSet" = weakref.WeakSet()  # the plans holding programs
_counts = {"captured": 0, "replayed": 0}
_dropped: dict[str, int] = {}  # why a capture was dropped -> times
_lock = threading.Lock()


def step(fn):
    """Mark ``fn`` as a step: native code on the tensors it is given, returning new ones (or a tuple of them)."""

    @functools.wraps(fn)
    def recorded(*args, **kwargs):
        capture = getattr(_thread, "capture", None)
        if capture is None or capture.inside:
            return fn(*args, **kwargs)
        return capture.call(fn, args, kwargs)

    return recorded


class aside:
    """``with aside():`` work that is no step of the forward and no glue between steps (building a derived weight:
    a replay checks that it still holds instead of building it)."""

    def __enter__(self):
        self.capture = getattr(_thread, "capture", None)
        if self.capture is not None:
            self.capture.inside += 1

    def __exit__(self, *exc):
        if self.capture is not None:
            self.capture.inside -= 1


def decided(op: str, backend: str, warning: str | None) -> None:
    """An op of the forward ran ``backend`` (``dispatch.Decision``): a capture keeps only step backends."""
    capture = getattr(_thread, "capture", None)
    if capture is not None and not capture.inside:
        if warning is not None:
            capture.fail("an op announced a fallback")
        elif (op, backend) not in STEP_BACKENDS:
            capture.fail(f"{op} ran its {backend} backend")


def derived_used(owner, name: str, params: tuple, value) -> None:
    """A derived weight was read (``derived.cached``): a replay checks first that it is still the current one."""
    capture = getattr(_thread, "capture", None)
    if capture is not None:
        capture.derived.append((owner, name, tuple(weakref.ref(p) for p in params), value))
        capture.known.update(id(t) for t in _tensors_of(value))


def forget() -> None:
    """Drop every program (a derived weight was replaced or dropped: none may keep the old one alive). Their shapes
    are captured again on their next forward."""
    for ref in list(_holding.data):  # (copied in one step: another thread may add a plan meanwhile)
        plan = ref()
        if plan is None:
            continue
        for key, entry in list(plan.replays.items()):
            if isinstance(entry, _Program):
                plan.replays[key] = CAPTURE_AT - 1


def report() -> dict:
    """What ``fastbert.info()`` shows: forwards captured and replayed in this process, and why captures were dropped."""
    with _lock:
        return {**_counts, "dropped": dict(_dropped)}


def _tensors_of(value) -> list[torch.Tensor]:
    """The tensors a value holds: itself, those of a tuple or list, or of an object's slots (a QuantizedWeight) or
    attributes."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors_of(v)]
    fields = [getattr(value, name, None) for name in getattr(type(value), "__slots__", ())]
    fields += list(getattr(value, "__dict__", {}).values()) if not isinstance(value, (type, torch.nn.Module)) else []
    return [t for field in fields if isinstance(field, (torch.Tensor, tuple, list)) for t in _tensors_of(field)]


def _count(what: str) -> None:
    with _lock:
        _counts[what] += 1


# --- capture ------------------------------------------------------------------------------------------------------

# how a step argument is found at replay: as recorded, a slot, a view of a slot's memory, a parameter (held weakly:
# a program must not keep a replaced parameter alive, and reads it again each time)
_CONST, _SLOT, _VIEW, _PARAM = 0, 1, 2, 3


class _Capture:
    """One encoder forward being recorded: its steps, the slots their outputs fill, the derived weights read."""

    def __init__(self, owner: torch.nn.Module, x: torch.Tensor):
        from . import int8  # (which imports the modules whose functions are steps)

        self.inside = 0  # > 0 while a step runs (its own torch calls are not glue)
        self.failure: str | None = None
        self.steps: list[tuple] = []
        self.derived: list[tuple] = []  # (owner, name, weak references to the parameters, value) of derived weights
        # The tensors the steps made, found by their memory: its address -> the slot whose tensor took it last (a
        # view reads the same memory; a tensor that died leaves its address to the next step's output)
        self.storages: dict[int, int] = {}
        self.geometry: list[tuple] = []  # slot -> (storage offset, shape, stride, dtype) of its tensor
        self.made_by: list[int] = []  # slot -> the step whose output it is (0 for the input)
        self.last_use: list[int] = []  # slot -> the last step that reads it (-1: none)
        self._add(x)
        # (parameters, not buffers: a parameter replaced changes the plan, a buffer reassigned would not)
        self.parameters = {id(p): p for p in owner.parameters()}
        self.params: list[weakref.ref] = []  # the parameters steps read, in order of first use
        self.param_index: dict[int, int] = {}
        self.known: set[int] = set()  # ids of the tensors of derived weights and int8 choices (held as they are)
        for module in owner.modules():  # (an int8 choice's divisors: changing a choice drops every plan)
            choice = int8.chosen(module)
            if choice is not None and choice.smooth is not None:
                self.known.add(id(choice.smooth))
        # Python attributes the glue reads and passes to steps (changing one drops no plan): compared before a replay
        self.attributes = tuple((module, name, module.__dict__[name]) for module in owner.modules()
                                for name in _READ_ATTRIBUTES if name in module.__dict__)

    def fail(self, why: str) -> None:
        if self.failure is None:
            self.failure = why

    def call(self, fn, args: tuple, kwargs: dict):
        self.inside += 1
        try:
            refs = tuple(self._ref(a) for a in args)
            kwrefs = {name: self._ref(v) for name, v in kwargs.items()}
            result = fn(*args, **kwargs)
            many = isinstance(result, tuple)
            outputs = tuple(self._add(out) for out in (result if many else (result,)))
            self.steps.append((fn, refs, kwrefs, outputs, many))
        finally:
            self.inside -= 1
        return result

    def _add(self, out) -> int | None:
        if out is None:
            return None
        storage = _storage(out) if isinstance(out, torch.Tensor) else None
        if storage is None or not out.numel():  # (empty tensors share addresses)
            self.fail("a step returned something else than a strided tensor with elements")
            return None
        slot = len(self.geometry)
        self.storages[storage] = slot
        self.geometry.append((out.storage_offset(), tuple(out.shape), tuple(out.stride()), out.dtype))
        self.made_by.append(len(self.steps))
        self.last_use.append(-1)
        return slot

    def _ref(self, value) -> tuple:
        if not isinstance(value, torch.Tensor):  # (ints, a handoff Target, a derived QuantizedWeight: as recorded)
            if any(id(t) not in self.known for t in _tensors_of(value)):
                self.fail("a step took an object holding tensors of the forward")
            return _CONST, value
        if id(value) in self.known:
            return _CONST, value
        if id(value) in self.parameters:
            if id(value) not in self.param_index:
                self.param_index[id(value)] = len(self.params)
                self.params.append(weakref.ref(value))
            return _PARAM, self.param_index[id(value)]
        slot = self.storages.get(_storage(value))
        if slot is None:
            self.fail("a step read a tensor made outside the steps")
            return _CONST, value
        self.last_use[slot] = len(self.steps)
        offset, shape, stride, dtype = self.geometry[slot]
        if value.dtype != dtype:
            self.fail("a step read a tensor's memory as another dtype")
        if (value.storage_offset(), tuple(value.shape), tuple(value.stride())) == (offset, shape, stride):
            return _SLOT, slot
        return _VIEW, slot, value.storage_offset() - offset, tuple(value.shape), tuple(value.stride())


class _Glue(TorchFunctionMode):
    """Watches the torch calls between steps during a capture: any that computes fails it."""

    def __init__(self, capture: _Capture):
        super().__init__()
        self.capture = capture

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if not self.capture.inside:
            if getattr(func, "__name__", None) not in _GLUE:
                self.capture.fail(f"torch's {getattr(func, '__name__', func)} ran between steps")
            elif isinstance(result, torch.Tensor) and result.numel() and _storage(result) not in {
                    _storage(a) for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)}:
                # (``contiguous`` of a strided tensor, an index that gathers: a copy, which a replay would not make)
                self.capture.fail(f"torch's {func.__name__} copied between steps")
        return result


def _storage(t: torch.Tensor) -> int | None:
    """The address of a strided tensor's memory, or None (oneDNN's opaque tensors, sparse and other layouts)."""
    if t.layout != torch.strided or t.is_mkldnn:
        return None
    try:
        return t.untyped_storage().data_ptr()
    except (NotImplementedError, RuntimeError):  # (a subclass or wrapper without plain storage)
        return None


# --- programs -----------------------------------------------------------------------------------------------------


class _Program:
    """A captured encoder forward: its steps, where its output is, and the derived weights it read."""

    __slots__ = ("steps", "output", "derived", "derived_state", "size", "params", "attributes")

    def __init__(self, capture: _Capture, output: tuple):
        from . import derived

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
        """Whether every derived weight it read is still the one ``derived.cached`` would give now, and the
        attributes the glue read still hold what they did."""
        from . import derived

        if self.derived_state is None or any(module.__dict__.get(name) != value
                                             for module, name, value in self.attributes):
            return False
        used = self._derived_now()
        return used is not None and derived.joint_state(used) == self.derived_state

    def run(self, x: torch.Tensor) -> torch.Tensor | None:
        """The encoder's output for input x, or None where a parameter it reads was freed since (then the forward
        runs op by op)."""
        params = [ref() for ref in self.params]  # (read again: in-place writes are the forward's to see)
        if any(p is None for p in params):
            return None
        values = [None] * self.size
        values[0] = x
        for fn, args, slotted, kwargs, kwslotted, outputs, many, released in self.steps:
            if slotted:
                args = list(args)
                for i, ref in slotted:
                    args[i] = _value(values, params, ref)
            if kwslotted:
                kwargs = dict(kwargs)
                for name, ref in kwslotted:
                    kwargs[name] = _value(values, params, ref)
            result = fn(*args, **kwargs)
            for slot, out in zip(outputs, result if many else (result,)):
                if slot is not None:
                    values[slot] = out
            for slot in released:
                values[slot] = None
        return _value(values, params, self.output)


def _template(refs):
    """Recorded arguments (a tuple or a dict of refs) -> (the constants in place, the rest as (position, ref))."""
    items = refs.items() if isinstance(refs, dict) else enumerate(refs)
    slotted = tuple((at, ref) for at, ref in items if ref[0] != _CONST)
    if isinstance(refs, dict):
        return {name: ref[1] if ref[0] == _CONST else None for name, ref in refs.items()}, slotted
    return tuple(ref[1] if ref[0] == _CONST else None for ref in refs), slotted


def _value(values: list, params: list, ref: tuple):
    kind = ref[0]
    if kind == _SLOT:
        return values[ref[1]]
    if kind == _PARAM:
        return params[ref[1]]
    if kind == _CONST:
        return ref[1]
    base = values[ref[1]]
    return base.as_strided(ref[3], ref[4], base.storage_offset() + ref[2])


_DROPPED = -1  # a shape whose capture was dropped: it runs op by op


def _shape(layout, x: torch.Tensor) -> tuple | None:
    """What a program is recorded for, or None where the layout's rows are data (a padded dense batch)."""
    if layout.columns is not None or not x.numel():
        return None
    if layout.packed:
        return "packed", layout.seqlens, layout.spare_rows, tuple(x.shape), x.dtype
    if layout.key_padding_mask is not None or layout.key_bounds is not None:
        return None
    return "dense", layout.batch, layout.seq_len, layout.spare_rows, tuple(x.shape), x.dtype


def encode(owner: torch.nn.Module, layers, x: torch.Tensor, layout, run) -> torch.Tensor:
    """``run(x)``, the forward of ``owner``'s ``layers`` op by op (x [rows, hidden] -> [rows, hidden]), or its replay
    where this plan captured them at this shape (see the module's notes)."""
    from . import int8

    current = plans.current()
    shape = None
    if current is not None and type(x) is torch.Tensor and x.device.type == "cpu" and not torch.is_grad_enabled() \
            and not int8.is_recording() and dispatch.settings().cpu_replay != "off" \
            and getattr(_thread, "capture", None) is None:  # (plain tensors: no subclass, proxy or fake one)
        shape = _shape(layout, x)
    if shape is None or not len(layers):
        return run(x)
    key, shapes = (id(owner), id(layers[0]), len(layers), shape), current.replays
    entry = shapes.get(key)
    if isinstance(entry, _Program):
        out = entry.run(x) if entry.current() else None
        if out is not None:
            _count("replayed")
            return out
        entry = CAPTURE_AT - 1  # (weights written since: this forward rebuilds them and is captured again)
    if entry == _DROPPED:
        return run(x)
    if entry is None and len(shapes) >= MAX_SHAPES:  # (the oldest shape that holds no program goes, else the oldest)
        met = list(shapes)
        shapes.pop(next((k for k in met if not isinstance(shapes.get(k), _Program)), met[0]), None)
    seen = (entry or 0) + 1
    if seen < CAPTURE_AT:
        shapes[key] = seen
        return run(x)
    return _capture(owner, x, run, current, key)


def _capture(owner, x: torch.Tensor, run, plan: "plans.Plan", key: tuple) -> torch.Tensor:
    capture = _thread.capture = _Capture(owner, x)
    try:
        with _Glue(capture):
            out = run(x)
    finally:
        _thread.capture = None
    output = capture._ref(out)
    program = _Program(capture, output) if capture.failure is None else None
    if program is not None and not program.current():  # (another thread rebuilt a derived weight meanwhile)
        plan.replays[key] = CAPTURE_AT - 1
        return out
    if capture.failure is not None:
        plan.replays[key] = _DROPPED
        with _lock:
            _dropped[capture.failure] = _dropped.get(capture.failure, 0) + 1
        return out
    plan.replays[key] = program
    _holding.add(plan)
    if not program.current():  # (a derived weight replaced since the check: forget() may have run before the store)
        plan.replays[key] = CAPTURE_AT - 1
        return out
    _count("captured")
    return out
