"""Recording one encoder forward as its native steps (``run.step``): the recorder a ``Run`` carries while its
forward is captured.

Each step argument is recorded as what it is: the encoder's input, an earlier step's output or a view of its memory,
a parameter of the encoder (held weakly, read again at each replay), a derived weight (``derived.py``), an int8
choice's tensor, or a Python value. Data flow is followed by memory address, not object identity: a view is found
relative to the output whose memory it reads. A capture fails (and its shape runs op by op from then on) if an op ran
a backend that is not made of steps, if a decision warned of a fallback, if a torch call between steps computed or
copied (``Glue`` watches), or if a step read a tensor of unknown origin.
"""

import weakref

import torch
from torch.overrides import TorchFunctionMode

from ..int8 import choices as int8

# module attributes that the glue reads and passes to steps as numbers (a LayerNorm's eps, attention head counts)
READ_ATTRIBUTES = ("eps", "variance_epsilon", "num_attention_heads", "n_heads")
# torch calls of the glue between steps that compute nothing (shapes, views, pointers)
_GLUE = frozenset({
    "view", "__getitem__", "size", "dim", "is_contiguous", "contiguous", "detach", "data_ptr", "__get__", "stride",
    "storage_offset", "numel", "is_floating_point", "is_inference", "__len__", "is_complex", "element_size",
    "reshape",  # (a view where it can be one; where it copies, the check below fails the capture)
})

# how a step argument is found at replay: as recorded, a slot, a view of a slot's memory, a parameter (held weakly:
# a program must not keep a replaced parameter alive, and reads it again each time), the forward's token layout
CONST, SLOT, VIEW, PARAM, LAYOUT = 0, 1, 2, 3, 4


class Capture:
    """One encoder forward being recorded: its steps, the slots their outputs fill, the derived weights read."""

    def __init__(self, owner: torch.nn.Module, x: torch.Tensor, layout):
        self.inside = 0  # > 0 while a step runs (its own torch calls are not glue)
        self.failure: str | None = None
        # The forward's layout (``padding.TokenLayout``), passed to the steps that take it as the replay's own. A
        # packed program serves other sequences of as many rows unless a step took what the layout alone should give
        # (its lengths, its token count as a number, a view of its tokens' rows under another length): then ``bound``
        # says which, and the program serves these sequences only.
        self.layout, self.bound = layout, None
        self.rows = x.shape[0]
        self.steps: list[tuple] = []
        self.derived: list[tuple] = []  # (owner, name, weak references to the parameters, value) of derived weights
        # The tensors the steps made, found by their memory: its address -> the slot whose tensor took it last (a
        # view reads the same memory; a tensor that died leaves its address to the next step's output)
        self.storages: dict[int, int] = {}
        self.geometry: list[tuple] = []  # slot -> (storage offset, shape, stride, dtype) of its tensor
        self.made_by: list[int] = []  # slot -> the step whose output it is (0 for the input)
        self.last_use: list[int] = []  # slot -> the last step that reads it (-1: none)
        self.add(x)
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
                                for name in READ_ATTRIBUTES if name in module.__dict__)

    def fail(self, why: str) -> None:
        if self.failure is None:
            self.failure = why

    # --- the hooks of ``run.py`` ---

    def decided(self, op: str, backend, warning: str | None) -> None:
        """An op of the forward runs ``backend``: a capture keeps only backends made of steps."""
        if warning is not None:
            self.fail("an op announced a fallback")
        elif not backend.steps:
            self.fail(f"{op} ran its {backend.name} backend")

    def derived_used(self, owner, name: str, params: tuple, value) -> None:
        """A derived weight was read: a replay checks first that it is still the current one."""
        self.derived.append((owner, name, tuple(weakref.ref(p) for p in params), value))
        self.known.update(id(t) for t in tensors_of(value))

    def call(self, fn, args: tuple, kwargs: dict, replayed):
        """``fn(*args, **kwargs)``, recorded as a step that replays call as ``replayed`` (``run.step``)."""
        self.inside += 1
        try:
            refs = tuple(self.ref(a) for a in args)
            kwrefs = {name: self.ref(v) for name, v in kwargs.items()}
            result = fn(*args, **kwargs)
            many = isinstance(result, tuple)
            outputs = tuple(self.add(out) for out in (result if many else (result,)))
            self.steps.append((replayed, refs, kwrefs, outputs, many))
        finally:
            self.inside -= 1
        return result

    # --- slots ---

    def add(self, out) -> int | None:
        if out is None:
            return None
        address = storage(out) if isinstance(out, torch.Tensor) else None
        if address is None or not out.numel():  # (empty tensors share addresses)
            self.fail("a step returned something else than a strided tensor with elements")
            return None
        slot = len(self.geometry)
        self.storages[address] = slot
        self.geometry.append((out.storage_offset(), tuple(out.shape), tuple(out.stride()), out.dtype))
        self.made_by.append(len(self.steps))
        self.last_use.append(-1)
        return slot

    def ref(self, value) -> tuple:
        if value is self.layout:
            return LAYOUT, None
        if not isinstance(value, torch.Tensor):  # (ints, a handoff Target, a derived QuantizedWeight: as recorded)
            if any(id(t) not in self.known for t in tensors_of(value)):
                self.fail("a step took an object holding tensors of the forward")
            self._check_unbound(value)
            return CONST, value
        if id(value) in self.known:
            return CONST, value
        if id(value) in self.parameters:
            if id(value) not in self.param_index:
                self.param_index[id(value)] = len(self.params)
                self.params.append(weakref.ref(value))
            return PARAM, self.param_index[id(value)]
        slot = self.storages.get(storage(value))
        if slot is None:
            self.fail("a step read a tensor made outside the steps")
            return CONST, value
        self.last_use[slot] = len(self.steps)
        offset, shape, stride, dtype = self.geometry[slot]
        if value.dtype != dtype:
            self.fail("a step read a tensor's memory as another dtype")
        if (value.storage_offset(), tuple(value.shape), tuple(value.stride())) == (offset, shape, stride):
            return SLOT, slot
        # (a view of the tokens' rows, before the spare ones: as many rows as the replay's layout has tokens)
        tokens_rows = self.layout.spare_rows > 0 and value.dim() > 0 and value.shape[0] == self.layout.tokens
        if not tokens_rows and (value.dim() == 0 or value.shape[0] != self.rows):
            self._bind("a step read a view of another number of rows")
        return VIEW, slot, value.storage_offset() - offset, tuple(value.shape), tuple(value.stride()), tokens_rows

    def _check_unbound(self, value) -> None:
        """Note a value that only these sequences give (see ``bound``)."""
        layout = self.layout
        if not layout.packed:
            return
        if isinstance(value, (tuple, list)) and tuple(value) == layout.seqlens:
            self._bind("a step took the sequences' lengths")
        elif type(value) is int and (value == layout.tokens or layout.spare_rows and value == layout.spare_rows):
            self._bind("a step took the token count as a number")

    def _bind(self, why: str) -> None:
        if self.bound is None:
            self.bound = why


class Glue(TorchFunctionMode):
    """Watches the torch calls between steps during a capture: any that computes fails it."""

    def __init__(self, capture: Capture):
        super().__init__()
        self.capture = capture

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if not self.capture.inside:
            if getattr(func, "__name__", None) not in _GLUE:
                self.capture.fail(f"torch's {getattr(func, '__name__', func)} ran between steps")
            elif isinstance(result, torch.Tensor) and result.numel() and storage(result) not in {
                    storage(a) for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)}:
                # (``contiguous`` of a strided tensor, an index that gathers: a copy, which a replay would not make)
                self.capture.fail(f"torch's {func.__name__} copied between steps")
        return result


def storage(t: torch.Tensor) -> int | None:
    """The address of a strided tensor's memory, or None (oneDNN's opaque tensors, sparse and other layouts)."""
    if t.layout != torch.strided or t.is_mkldnn:
        return None
    try:
        return t.untyped_storage().data_ptr()
    except (NotImplementedError, RuntimeError):  # (a subclass or wrapper without plain storage)
        return None


def tensors_of(value) -> list[torch.Tensor]:
    """The tensors a value holds: itself, those of a tuple or list, or of an object's slots (a QuantizedWeight, and
    the native PackedWeight in it) or attributes."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in tensors_of(v)]
    fields = [getattr(value, name, None) for name in getattr(type(value), "__slots__", ())]
    fields += list(getattr(value, "__dict__", {}).values()) if not isinstance(value, (type, torch.nn.Module)) else []
    return [t for field in fields if isinstance(field, (torch.Tensor, tuple, list)) or hasattr(type(field), "__slots__")
            for t in tensors_of(field)]
