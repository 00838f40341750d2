"""Tensors derived from parameters (the stacked QKV weight, the CPU GEMMs' packed weights), cached beside them and
never written into them.

A forward must not touch parameters: optimizers with flat buffers (ZeRO, FSDP) re-point ``param.data``, other threads
read them, ``torch.func`` swaps them, ``.to()``/``.half()`` replace them. So a derived tensor is built aside and
published with one attribute assignment (a concurrent forward sees the old complete entry or the new one), and it is
never used once its parameters hold other values. Each entry carries the state of what it was built from, read
*before* building, so a write that lands during the build leaves an entry that no longer matches:

- each parameter's identity, in-place version counter, storage address, dtype and device: in-place updates
  (optimizer steps, ``copy_`` under ``no_grad``, ``load_state_dict``), ``.to()``, re-pointing, replacement;
- fused optimizers (``SGD/Adam/AdamW/Adagrad(fused=True)``; the HF Trainer's default ``adamw_torch_fused``) write
  without moving version counters: a global optimizer step hook moves them for the parameters cached here that the
  step updated (those with a gradient), so the next forward sees the step (CUDA graphs too);
- on CPU, a fingerprint of sampled memory words (``fastbert._C.fingerprint``, 16 words per tensor): writes that move
  no counter, through ``.data`` (PEFT's merges), collectives (``dist.broadcast``) or another process sharing the
  memory (Hogwild), change the sampled words;
- replacing a child module of a fastbert module (PEFT wrapping a Linear in LoRA, and unwrapping it after a merge)
  drops what was cached below that module (``layers.Fused.__setattr__``).

Under FSDP2 (``fully_shard``) nothing is cached: each all-gather rewrites the unsharded parameters in place with
their version counters deliberately preserved, into storage freed and re-allocated (on a GPU the caching allocator
hands the same address back), so no state above would see the new values. The derived tensors are built per call.

What the state cannot see, to be announced with ``fastbert.clear_caches(model)``: on a GPU, writes through ``.data``,
collectives or other processes after an inference forward (a fingerprint there would cost a device sync per
forward); on CPU, such writes that change only a few elements (seen when they hit a sampled word). A forward with
gradients (training) drops the caches it passes anyway. Parameters are held weakly: one that is replaced
(``load_state_dict(assign=True)``) and freed takes its entries, and their memory, with it. Cost: one extra copy of
the derived weights; per forward, reading each cached parameter's state (and on CPU its fingerprint).
"""

import threading
import weakref

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from . import _extension, announce, run

try:  # modules under torch.distributed's composable APIs (fully_shard, replicate), held weakly
    from torch.distributed._composable_state import _module_state_mapping as _composable_modules
except ImportError:  # a torch built without distributed support
    _composable_modules = {}

ATTRIBUTE = "_fastbert_derived"  # on the owning module: {name: _Entry}


class _Entries(dict):
    """The cache on a module. Copies and pickles of the module start empty (rebuilt on their first forward): the
    entries may hold tensors that cannot be copied or pickled (oneDNN's packed weights), and a copy's parameters are
    other tensors anyway."""

    def __deepcopy__(self, memo):
        return _Entries()

    def __reduce__(self):
        return _Entries, ()


# --- the state an entry is built from --------------------------------------------------------------------------

_parameter_state = getattr(_extension._C, "parameter_state", None)  # (a _C built before it has none)
_epoch = 0  # moved when an optimizer step could not move the versions it should have: every entry goes stale


def state(params: tuple[torch.Tensor, ...]) -> tuple:
    """What ``params`` hold now, as far as it can be read cheaply: versions, storage addresses, dtypes, devices and,
    on CPU, a fingerprint of their memory. Equal states: the derived tensor built from them is still right. This
    runs for every cached weight of every forward: fastbert._C reads it in one call where it can
    (csrc/parameter_state.cpp: ``state_ref``'s tuple, 2-2.5x faster)."""
    if _parameter_state is not None:
        read = _parameter_state(tuple(params))
        if read is not None:
            return (*read, _epoch)
    return state_ref(params)


def state_ref(params: tuple[torch.Tensor, ...]) -> tuple:
    """``state`` in one pass of Python over the parameters (CPU tensors that are not contiguous sampled through
    torch: ``_sampled``)."""
    versions, layout, snapshots = [], [], []
    for p in params:
        try:
            versions.append(p._version)
        except RuntimeError:  # an inference tensor (moved under inference_mode) keeps no version counter
            if not p.is_inference():
                raise
            versions.append(-1)
        # (on the CPU a snapshot holds the storage while its words are read, whatever another thread does)
        snapshot = p.detach() if p.is_cpu else p
        layout.append((snapshot.data_ptr(), p.dtype, p.device))
        snapshots.append(snapshot)
    return tuple(versions), tuple(layout), _fingerprint(snapshots), _epoch


def _fingerprint(snapshots: list[torch.Tensor]) -> int | None:
    """A hash of 16 words sampled from each CPU tensor's memory (whole tensors of at most 128 bytes), or None when
    some tensor is not on the CPU (reading GPU memory would wait for the device). ``snapshots``: detached tensors,
    each holding its storage while it is read."""
    if not snapshots or not all(t.is_cpu for t in snapshots):
        return None
    native = _extension._C
    if native is not None and hasattr(native, "fingerprint") and all(t.is_contiguous() for t in snapshots):
        # (csrc/fingerprint.h: the same sampled words, hashed without a Python object per word)
        return native.fingerprint([t.data_ptr() for t in snapshots], [t.nbytes for t in snapshots])
    return hash(tuple(_sampled(t) for t in snapshots))


_GOLDEN = 0.6180339887498949


def _sampled(t: torch.Tensor) -> tuple[int, ...]:
    """The torch path of ``_fingerprint`` (any layout, or without the extension): the bytes of 17 sampled elements."""
    n = t.numel()
    if n <= 17:
        positions = list(range(n))
    else:
        positions = [int((i * _GOLDEN) % 1.0 * n) for i in range(16)] + [n - 1]
    picked = torch.take(t, torch.tensor(positions, dtype=torch.long))
    return tuple(picked.view(torch.uint8).tolist()) if picked.numel() else ()


class _Entry:
    """A derived ``value`` and the ``state`` of the parameters it was built from (held weakly: when one is freed,
    the entry can never match again and is dropped from its owner)."""

    __slots__ = ("refs", "state", "value", "__weakref__")

    def __init__(self, owner: nn.Module, name: str, params: tuple[torch.Tensor, ...], params_state: tuple, value):
        owner_ref, entry_ref = weakref.ref(owner), weakref.ref(self)

        def release(_):
            owner, entry = owner_ref(), entry_ref()
            if owner is not None and entry is not None:
                _discard_entry(owner, name, entry)

        self.refs = tuple(weakref.ref(p, release) for p in params)
        self.state, self.value = params_state, value

    def built_from(self, params: tuple[torch.Tensor, ...]) -> bool:
        return len(self.refs) == len(params) and all(ref() is p for ref, p in zip(self.refs, params))


_on_replace: list = []  # what must let go of replaced values (the replay's programs): called on every replacement


def when_replaced(callback) -> None:
    """Call ``callback()`` whenever a derived value is rebuilt or dropped anywhere (``replay/`` drops its programs
    then, so that none keeps an old value alive)."""
    _on_replace.append(callback)


def _replaced() -> None:
    for callback in _on_replace:
        callback()


def cached(owner: nn.Module, name: str, params: tuple[torch.Tensor, ...], build) -> torch.Tensor:
    """``build(*params)``, cached on ``owner`` under ``name`` while ``params`` hold what it was built from.

    Only for calls that need no gradient through the result. Parameters that are not ``nn.Parameter`` (tensors
    swapped in by ``torch.func.functional_call``, vmap's batched tensors) are never cached: the result is built for
    this call only, so no caller's tensor is kept alive or mistaken for another.
    """
    if torch.compiler.is_compiling() or not all(isinstance(p, nn.Parameter) for p in params) or (
            params and fsdp_in_use()):
        return build(*params)
    entries = owner.__dict__.get(ATTRIBUTE) or {}
    entry = entries.get(name)
    now = state(params)  # read before building: a write during the build leaves the new entry stale, not wrong
    if entry is not None and entry.state == now and entry.built_from(params):
        run.derived_used(owner, name, params, entry.value)
        return entry.value
    # Outside inference mode, so the result is a normal tensor usable by later no-grad forwards too.
    with run.aside(), torch.inference_mode(False), torch.no_grad():
        value = build(*(p.detach() for p in params))
    if entry is not None:  # (a value replaced: no replay may hold the old one)
        _replaced()
    entry = _Entry(owner, name, params, now, value)
    owner.__dict__[ATTRIBUTE] = _Entries({**entries, name: entry})  # one assignment publishes it
    _track(params)
    run.derived_used(owner, name, params, value)
    return value


def current(owner: nn.Module, name: str, params: tuple[torch.Tensor, ...]):
    """What ``cached`` would return now without building: the value cached on ``owner`` under ``name`` while
    ``params`` hold what it was built from, else None."""
    entry = (owner.__dict__.get(ATTRIBUTE) or {}).get(name)
    if entry is None or not entry.built_from(params) or entry.state != state(params):
        return None
    return entry.value


def joint_state(used: tuple[tuple, ...]) -> tuple | None:
    """For values that ``cached`` returned, each as (owner, name, params, value): the ``state`` of all their
    parameters in one pass, or None where one is no longer the value cached under its name (rebuilt or dropped).
    Taken while each is current (``current``), an equal joint state later means they all still are."""
    params = []
    for owner, name, built_from, value in used:
        entry = (owner.__dict__.get(ATTRIBUTE) or {}).get(name)
        if entry is None or entry.value is not value or not entry.built_from(built_from):
            return None
        params += built_from
    return state(tuple(params))


def fsdp_in_use() -> bool:
    """Whether FSDP2 shards modules in this process (then nothing is cached, said once; see the module's notes)."""
    if not _composable_modules:
        return False
    from torch.distributed.fsdp import FSDPModule

    if not any(isinstance(m, FSDPModule) for m in list(_composable_modules)):
        return False
    announce.fallback("FSDP2 (fully_shard) rewrites parameters in place without moving their version counters: "
                      "derived weights (stacked QKV, packed GEMM weights) are rebuilt on every forward, not cached")
    return True


def discard(owner: nn.Module, name: str) -> None:
    """Drop ``owner``'s cached ``name`` (a training forward calls this: the weights are about to change)."""
    entries = owner.__dict__.get(ATTRIBUTE)
    if entries and name in entries:
        owner.__dict__[ATTRIBUTE] = _Entries({k: v for k, v in entries.items() if k != name})
        _replaced()


def _discard_entry(owner: nn.Module, name: str, entry: _Entry) -> None:
    entries = owner.__dict__.get(ATTRIBUTE)
    if entries and entries.get(name) is entry:  # (a newer entry under the same name stays)
        owner.__dict__[ATTRIBUTE] = _Entries({k: v for k, v in entries.items() if k != name})
        _replaced()


def clear(module: nn.Module) -> None:
    """Drop every derived tensor cached in ``module`` and its submodules (they are rebuilt on the next forward)."""
    for m in module.modules():
        m.__dict__.pop(ATTRIBUTE, None)
    _replaced()


# --- optimizer steps: make fused optimizers' writes visible ------------------------------------------------------

_tracked: dict[int, weakref.ref] = {}  # id -> weak reference, for every parameter a derived tensor was built from
_hook_lock = threading.Lock()
_hook = None


def _track(params: tuple[torch.Tensor, ...]) -> None:
    global _hook
    for p in params:
        if id(p) not in _tracked:
            _tracked[id(p)] = weakref.ref(p, lambda _, key=id(p): _tracked.pop(key, None))
    if _hook is None:
        with _hook_lock:
            if _hook is None:
                _hook = register_optimizer_step_post_hook(_after_optimizer_step)


def _dead():
    return None


def _after_optimizer_step(optimizer, args, kwargs) -> None:
    """After any ``optimizer.step()``: the tracked parameters it updated (those with a gradient: every torch
    optimizer skips the others) get their version moved, as the in-place update of a non-fused optimizer does.
    Never raises into the training loop: if the versions cannot be moved, every derived tensor goes stale."""
    global _epoch
    stepped = [p for group in optimizer.param_groups for p in group["params"]
               if p.grad is not None and _tracked.get(id(p), _dead)() is p]
    if not stepped:
        return
    try:
        torch.autograd.graph.increment_version(stepped)
    except Exception:  # noqa: BLE001 - e.g. a tensor subclass without a version counter
        _epoch += 1
