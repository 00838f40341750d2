"""The most bytes that tensors created inside a region held at once: a count of tensor sizes, not of the process's
memory, so it reads the same on a busy machine (and under any allocator).

    with LiveBytes() as live:
        model(features)
    live.peak   # bytes

A TorchDispatchMode sees every tensor an op returns; each storage counts once while a tensor on it lives (views share
their base's count), and stops counting when the last one is freed. Tensors made before the region (weights, inputs)
are not counted, nor their views (a slice of a weight holds the weight's storage, which the region did not make).
"""

import collections
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveBytes(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.users = collections.Counter()  # storage address -> live tensors on it
        self.tracked = {}  # id -> weak reference, for the tensors counted (a WeakSet would compare tensors)
        self.now = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {_storage(t)[0] for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            known = self.tracked.get(id(t))
            if isinstance(t, torch.Tensor) and (known is None or known() is not t):
                key, size = _storage(t)
                if not self.users[key] and key in inputs:  # a view of (or a write into) a tensor made before
                    continue
                self.tracked[id(t)] = weakref.ref(t)
                if not self.users[key]:
                    self.now += size
                    self.peak = max(self.peak, self.now)
                self.users[key] += 1
                weakref.finalize(t, self._release, id(t), key, size)
        return out

    def _release(self, tensor_id, key, size):
        self.tracked.pop(tensor_id, None)
        self.users[key] -= 1
        if not self.users[key]:
            self.now -= size


def _storage(t: torch.Tensor) -> tuple[int, int]:
    """(address, bytes) of ``t``'s storage; an opaque tensor (oneDNN's packed weights) by its own address and size."""
    try:
        storage = t.untyped_storage()
        return storage.data_ptr(), storage.nbytes()
    except (NotImplementedError, RuntimeError):
        return id(t), t.numel() * t.element_size()
