"""A forward's decisions, kept for the next forward while nothing they depend on has changed.

Each fused op decides how it runs (``ops/``, through ``dispatch.decide``): which backend, whether its modules are
plain enough to read their weights directly, whether autograd needs the reference ops. A decision reads dozens of
attributes and settings, and a bert-base forward has ~100 ops: deciding again on every call cost more host time
than the ops themselves at small batches. So a model forward first reads, once, everything those decisions depend on:

- the module tree, walked from the model: each module's class, children, parameters (by id, class and
  ``requires_grad``), hooks (by handle), ``forward`` replaced on the instance, training flag and dropout
  probability;
- the global module hooks, grad mode, autocast, fastbert's settings and ``torch.backends.mkldnn.enabled``, the
  model's device and dtype, and every ``.to()``/``.half()`` applied to a fastbert module since.

That is the plan's key. While it is unchanged, the previous forward's decisions stand; when anything in it differs,
a new plan decides again. (A hook added, a module wrapped by PEFT, ``model.train()``: the next forward sees it.)
Derived weights are not decisions: they are checked on every call (``derived.py``), as are the inputs. A plan holds
modules but no parameter (decisions read weights from their modules when they run), so a parameter replaced
(``load_state_dict(assign=True)``) is freed at once, with what was derived from it.

Not planned (decided on every call, as before): forwards under torch.compile, export or tracing, torch.func
transforms, a dispatch mode (fake tensors), and ops called outside a model forward.
"""

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from . import _extension, dispatch, plain, run

_module_tree = getattr(_extension._C, "module_tree", None)  # (a _C built before it has none)
_module_tree_matches = getattr(_extension._C, "module_tree_matches", None)
_conversions = 0  # moved by every .to()/.half()/... of a fastbert module (layers.Fused._apply)


def converted() -> None:
    """A fastbert module's parameters were converted or moved: no plan made before stays valid."""
    global _conversions
    _conversions += 1


class Plan:
    """The decisions of the ops of one model for one key: op name and owning module -> what ``decide`` returned.
    A copy or pickle of the model starts without a plan (its decisions name the original's modules)."""

    def __init__(self, key: tuple):
        self.key = key
        self.decisions: dict[tuple[int, str], object] = {}
        self.replays: dict[tuple, object] = {}  # (owner, first layer, layers, shape) -> replay/'s program, or state

    def __deepcopy__(self, memo):
        return None

    def __reduce__(self):
        return _no_plan, ()


def _no_plan():
    return None


def plannable() -> bool:
    """Whether this forward may reuse decisions: eager code on plain tensors only (see the module docstring)."""
    return not (
        torch.compiler.is_compiling()
        or dispatch.exporting()
        or _get_current_dispatch_mode() is not None
        or torch._C._functorch.maybe_current_level() is not None
    )


def for_model(model, device: torch.device, dtype: torch.dtype, inputs_require_grad: bool) -> Plan | None:
    """``model``'s plan for a forward now (its last one when the key is unchanged, else a new one), or None where
    forwards are not planned."""
    if not plannable():
        return None
    rest = (
        device, dtype, torch.is_grad_enabled(), inputs_require_grad,
        device.type in ("cpu", "cuda") and torch.is_autocast_enabled(device.type),
        dispatch.settings(), torch.backends.mkldnn.enabled, plain.global_hooks(),
        _conversions,
    )
    last = model.__dict__.get("_fastbert_plan")
    if last is not None and last.key[1:] == rest and same_structure(model, last.key[0]):
        return last
    plan = Plan((structure(model), *rest))
    model.__dict__["_fastbert_plan"] = plan  # (one assignment: another thread sees the old plan or this one)
    return plan


def structure_ref(model) -> tuple:
    """Everything about ``model``'s module tree that a decision reads, one entry per module (holding the modules,
    so no module id in a plan is reused while it lives; parameters by id, class and ``requires_grad``)."""
    entries = []
    stack = [model]
    while stack:  # (runs before every forward: lists built in one go, no generators)
        m = stack.pop()
        d = m.__dict__
        children = tuple(d["_modules"].values())
        params = d["_parameters"]
        hooks = d["_forward_hooks"], d["_forward_pre_hooks"], d["_backward_hooks"], d["_backward_pre_hooks"]
        entries.append((
            m, type(m), d["training"], d.get("p"), "forward" in d, children,
            tuple([tuple(h) for h in hooks]) if hooks[0] or hooks[1] or hooks[2] or hooks[3] else None,
            tuple([None if p is None else (id(p), type(p), p.requires_grad) for p in params.values()]) if params
            else None,
        ))
        if children:
            stack.extend([c for c in children if c is not None])
    return tuple(entries)


def structure(model) -> tuple:
    """``structure_ref(model)``, built by fastbert._C where it has ``module_tree`` (csrc/module_tree.cpp: the same
    tuple with no Python bytecode per module, 2-3x faster; bert-base has 228 modules). Built for each new plan; before
    every forward, ``same_structure`` compares the tree with the plan's."""
    return structure_ref(model) if _module_tree is None else _module_tree(model)


def same_structure(model, key: tuple) -> bool:
    """``structure(model) == key``, by fastbert._C without building the tuple where it has ``module_tree_matches``
    (csrc/module_tree.cpp: the tree's modules compared with the key's as they are read; bert-base's 228 modules
    ~100 -> 59 us on a Zen 3, the comparison of the two tuples included)."""
    return structure(model) == key if _module_tree_matches is None else _module_tree_matches(model, key)


def current() -> Plan | None:
    """The plan of the forward running here (``run.current().plan``), or None."""
    forward = run.current()
    return None if forward is None else forward.plan


def decided(owner, op: str, decide, *args):
    """``decide(*args)``, kept in the forward's plan under (``owner``, ``op``): the decision of ``op`` for the module
    ``owner``, taken once per plan. Outside a plan, decided on every call."""
    plan = current()
    if plan is None:
        return decide(*args)
    key = (id(owner), op)
    decision = plan.decisions.get(key, _MISSING)
    if decision is _MISSING:  # (None is a decision too)
        decision = plan.decisions[key] = decide(*args)
    return decision


_MISSING = object()
