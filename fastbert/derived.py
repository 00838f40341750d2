"""Tensors derived from parameters (the stacked QKV weight), cached beside them and never written into them.

A forward must not touch parameters: optimizers with flat buffers (ZeRO, FSDP) re-point ``param.data``, other threads
read them, ``torch.func`` swaps them, ``.to()``/``.half()`` replace them. So a derived tensor is built aside from the
parameters and kept with a key that identifies exactly what it was built from: each parameter's identity, in-place
version counter, storage address, dtype and device. Any optimizer step, ``load_state_dict``, ``copy_`` under
``no_grad``, ``.to()`` or re-pointing changes the key, and the next forward rebuilds. The new entry is published with
one attribute assignment, so a concurrent forward sees either the old complete entry or the new one.

Writes that bypass the parameter's own version counter cannot be seen: through ``param.data`` (``p.data.copy_``), or
through another tensor aliasing its memory (a flat buffer the parameter was re-pointed into, as ZeRO and FSDP do).
A forward with gradients (training) drops the cache, so evaluation between training steps is always fresh; after
such writes outside training, call ``fastbert.clear_caches(model)``. Cost: one extra copy of the derived weights.
"""

import torch
from torch import nn

ATTRIBUTE = "_fastbert_derived"  # on the owning module: {name: (key, value)}


class _Entries(dict):
    """The cache on a module. Copies and pickles of the module start empty (rebuilt on their first forward): the
    entries may hold tensors that cannot be copied or pickled (oneDNN's packed weights), and a copy's parameters are
    other tensors anyway."""

    def __deepcopy__(self, memo):
        return _Entries()

    def __reduce__(self):
        return _Entries, ()


def _key(params: tuple[torch.Tensor, ...]) -> tuple:
    return tuple((p, p._version, p.data_ptr(), p.dtype, p.device) for p in params)


def _same(key: tuple, params: tuple[torch.Tensor, ...]) -> bool:
    return len(key) == len(params) and all(
        k[0] is p and k[1] == p._version and k[2] == p.data_ptr() and k[3] == p.dtype and k[4] == p.device
        for k, p in zip(key, params)
    )


def cached(owner: nn.Module, name: str, params: tuple[torch.Tensor, ...], build) -> torch.Tensor:
    """``build(*params)``, cached on ``owner`` under ``name`` until any of ``params`` changes.

    Only for calls that need no gradient through the result. Parameters that are not ``nn.Parameter`` (tensors
    swapped in by ``torch.func.functional_call``, vmap's batched tensors) are never cached: the result is built for
    this call only, so no caller's tensor is kept alive or mistaken for another.
    """
    if torch.compiler.is_compiling() or not all(isinstance(p, nn.Parameter) for p in params):
        return build(*params)
    entries = owner.__dict__.get(ATTRIBUTE) or {}
    entry = entries.get(name)
    if entry is not None and _same(entry[0], params):
        return entry[1]
    # Outside inference mode, so the result is a normal tensor usable by later no-grad forwards too.
    with torch.inference_mode(False), torch.no_grad():
        value = build(*(p.detach() for p in params))
    owner.__dict__[ATTRIBUTE] = _Entries({**entries, name: (_key(params), value)})  # one assignment publishes it
    return value


def discard(owner: nn.Module, name: str) -> None:
    """Drop ``owner``'s cached ``name`` (a training forward calls this: the weights are about to change)."""
    entries = owner.__dict__.get(ATTRIBUTE)
    if entries and name in entries:
        owner.__dict__[ATTRIBUTE] = _Entries({k: v for k, v in entries.items() if k != name})


def clear(module: nn.Module) -> None:
    """Drop every derived tensor cached in ``module`` and its submodules (they are rebuilt on the next forward)."""
    for m in module.modules():
        m.__dict__.pop(ATTRIBUTE, None)
