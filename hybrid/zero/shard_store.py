"""Where ZeRO-3's owned 16-bit parameter chunks live between their uses: in memory, as each unit's
``shard`` (:class:`ResidentShards`), or, with ``OffloadConfig(params="nvme")``, in the file of
:class:`hybrid.offload.param_store.NVMeParamStore` (ZeRO-Infinity parameter offload, Rajbhandari
et al. 2021 §5). The stage-3 engine holds one of the two through the same four methods and never
asks which: ``writer()`` (the chunks an optimizer step writes), ``end_step()``, ``resident()`` (its
own host buffers, for the memory report) and ``shard_views()`` (the chunks, for a checkpoint).
"""

from __future__ import annotations

import contextlib

import torch

from hybrid.offload import param_store
from hybrid.offload.budget import OffloadConfig
from hybrid.zero.stage3_unit import ShardedUnit


class ResidentShards:
    """The units' chunks in memory, where they were built."""

    def __init__(self, units: list[ShardedUnit]):
        self.units = units

    def writer(self):
        return contextlib.nullcontext(self.shard_views())

    def end_step(self) -> None:
        """Nothing to prefetch."""

    def resident(self) -> list[torch.Tensor]:
        """No buffers beyond the shards (which the engine counts as its parameters)."""
        return []

    def shard_views(self) -> list[torch.Tensor]:
        return [u.shard for u in self.units]


def params_on_nvme(offload: OffloadConfig | None) -> bool:
    return offload is not None and offload.params == "nvme"


def resident_param_bytes(offload: OffloadConfig | None, units: list[ShardedUnit],
                         dtype: torch.dtype) -> int:
    """Host bytes the 16-bit chunks will take: the store's buffers on NVMe, else the chunks."""
    sizes = [u.chunk for u in units]
    if params_on_nvme(offload):
        return param_store.resident_bytes(sizes, dtype)
    return torch.empty((), dtype=dtype).element_size() * sum(sizes)


def open_shard_store(offload: OffloadConfig | None, units: list[ShardedUnit], *,
                     dtype: torch.dtype, rank: int, device: torch.device):
    """The store of the units' (materialised) chunks: on NVMe they move into the file now."""
    if not params_on_nvme(offload):
        return ResidentShards(units)
    store = param_store.NVMeParamStore([u.chunk for u in units], dtype=dtype,
                                       directory=offload.nvme_path, rank=rank,
                                       pin=device.type == "cuda")
    for k, unit in enumerate(units):
        unit.attach_store(store, k)
    return store
