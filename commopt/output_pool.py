"""Output buffers for ``compressed_allreduce(..., out=None)`` on CPU, reused once released.

A fresh CPU tensor of tens of MB comes from the OS as new pages, zeroed on first touch, and
torch keeps no cache of CPU memory. At 16M fp32 elements that first touch cost 30 ms of a
53 ms exchange (2 forked gloo ranks on this project's 2-core VM, 2026-11-24: 83 ms per call
without ``out=``, 53 ms with it). So the last results handed out are kept here, and a kept
buffer is handed out again once nothing but this pool holds it: no Python reference to the
tensor but the pool's (``sys.getrefcount``), no C++ one either (autograd's saved tensors, a
pending collective: ``Tensor._use_count``), and no other tensor on its storage, a view included
(torch's storage use count). A result anyone still holds is never reused.

Two buffers per (shape, dtype), for the usual ``y = compressed_allreduce(x, e, f)`` loop, where
the previous result is still bound to ``y`` during the call; at most ``capacity`` shapes, the
least recently used forgotten first. The memory kept is thus at most 2·capacity results. On
other devices (CUDA's caching allocator already makes a new buffer cheap), or where the
interpreter or torch cannot tell (checked once at import), every call allocates.
"""

from __future__ import annotations

import functools
import sys
import threading
from collections import OrderedDict

import torch

__all__ = ["OutputPool", "output_like"]

_use_count = getattr(torch._C, "_storage_Use_Count", None)


def _holders(t: torch.Tensor) -> int:
    return int(_use_count(t.untyped_storage()._cdata))  # type: ignore[misc]


def _released(entry: tuple[torch.Tensor, int]) -> bool:
    """Whether only the pool's ``entry`` refers to its tensor (2: the entry and this call's
    argument; nothing in C++) and no other tensor shares its storage."""
    t = entry[0]
    return sys.getrefcount(t) == 3 and t._use_count() == 1 and _holders(t) <= entry[1]


@functools.cache
def _counts_work() -> bool:
    """The reference counts behave as :func:`_released` expects on this interpreter (checked
    once, at the first call without ``out=`` on CPU, not at import)."""
    if _use_count is None or not hasattr(torch.Tensor, "_use_count"):
        return False
    t = torch.empty(1)
    entry = (t, _holders(t))
    held = not _released(entry)
    del t
    view = entry[0][:]
    viewed = not _released(entry)
    del view
    w = torch.ones(1, requires_grad=True)
    loss = (entry[0] * w).sum()  # autograd saves the tensor in C++ only
    saved = not _released(entry)
    del loss
    return held and viewed and saved and _released(entry)


class OutputPool:
    """Kept output buffers (see the module docstring).

    Args:
        capacity: how many (shape, dtype) keys keep buffers.
    """

    def __init__(self, capacity: int = 2) -> None:
        self._capacity = capacity
        # key → [(buffer, its storage's use count when only the pool held it)]
        self._kept: OrderedDict[tuple, list[tuple[torch.Tensor, int]]] = OrderedDict()
        self._lock = threading.Lock()

    def like(self, tensor: torch.Tensor) -> torch.Tensor:
        """A tensor like ``torch.empty_like(tensor)``, contents undefined, owned by the caller
        until it drops it."""
        if tensor.device.type != "cpu" or not _counts_work():
            return torch.empty_like(tensor)
        key = (tuple(tensor.shape), tensor.stride(), tensor.dtype)
        with self._lock:
            kept = self._kept.setdefault(key, [])
            self._kept.move_to_end(key)
            for entry in kept:
                if _released(entry):
                    return entry[0]
            fresh = torch.empty_like(tensor)
            kept.append((fresh, _holders(fresh)))
            del kept[:-2]
            while len(self._kept) > self._capacity:
                self._kept.popitem(last=False)
            return fresh

    def clear(self) -> None:
        """Forget every kept buffer."""
        with self._lock:
            self._kept.clear()


_pool = OutputPool()


def output_like(tensor: torch.Tensor) -> torch.Tensor:
    """The process-wide pool's :meth:`OutputPool.like`."""
    return _pool.like(tensor)
