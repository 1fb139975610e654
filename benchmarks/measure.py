"""Measurements the peer benchmarks share: what a peer framework keeps alive, seen from outside.

A peer's partitions are internal to it, so its model-state bytes are counted as the CPU tensor
storages that its build (and first step) left alive: :func:`live_storages` before and after, the
difference being its own. Storages are counted once, by data pointer.
"""

from __future__ import annotations

import gc
import weakref


def live_storages() -> dict[int, int]:
    """data_ptr -> bytes of every live, non-memory-mapped CPU tensor storage the garbage collector
    can see."""
    import torch
    out = {}
    for obj in gc.get_objects():
        if isinstance(obj, weakref.ProxyTypes):   # isinstance on a dead proxy raises
            continue
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu" and not obj.is_meta:
            try:
                storage = obj.untyped_storage()
                if storage.nbytes() and not storage.filename:   # a memory-mapped file is not resident
                    out[storage.data_ptr()] = storage.nbytes()
            except RuntimeError:   # a storage freed under a live wrapper (e.g. FSDP's)
                continue
    return out


def bytes_grown_since(before: dict[int, int]) -> int:
    """Bytes of the live storages that were not alive in ``before``."""
    return sum(n for ptr, n in live_storages().items() if ptr not in before)
