"""One ZeRO-3 sharding unit: a flat, DP-partitioned 16-bit parameter buffer (ZeRO paper §5.3, Pos+g+p).

The parameters of one unit (the embedding, one transformer layer, the final norm) are laid out back to
back in a flat buffer of ``padded`` elements, split into ``Nd`` equal aligned chunks; DP rank ``r``
permanently owns chunk ``r`` (``shard``: 2Ψ_unit/Nd bytes of 16-bit parameters) and the matching
16-bit gradient partition (``grad``). The full buffer exists only while the unit is in use:

    gather()   resize the full buffer's storage to ``padded`` elements and all-gather the chunks
               into it (async); the unit's parameters are views of this buffer, so they come alive.
    release()  resize the storage back to 0 bytes: the parameters keep their shapes but hold no
               memory (autograd's saved references see the values again after the next gather).
    reduce_gradients()  flatten the unit's full gradients into a caller's buffer, reduce-scatter
               them over DP (async, summed) and keep only this rank's chunk, accumulated over
               micro-batches.

With qwZ (``quantized_gather``) the all-gather sends int8 blocks and ``full`` holds their
dequantized values, while ``shard`` (and the fp32 master) stay exact; ``exact_values()`` gathers
the exact parameters for export. ``reduce_scatter`` is the engine's gradient reduce-scatter
(qgZ: :func:`hybrid.zero.quantized_collectives.hierarchical_reduce_scatter`).

Shapes: ``full`` [padded], ``shard``/``grad`` [chunk] with padded = chunk * Nd, chunk a multiple of
the alignment. ``segments`` lists which slice of which parameter this rank owns.

Topology-aware options (:mod:`hybrid.zero.host_groups`): with hybrid sharding ``group`` is the
intra-host DP group and ``replicas`` the inter-host one (gradients: reduce-scatter inside the host,
then the chunk all-reduced across hosts). With hpZ, ``secondary_group`` is the intra-host group:
the first gather after the shard changed (the forward's) keeps this rank's [padded / h] slice of
the gathered buffer in ``secondary``, and every later gather runs over that group from it until
:meth:`invalidate_secondary` (the step wrote new shards).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from hybrid import comm
from hybrid.comm import Group
from hybrid.zero.quantized_collectives import quantized_all_gather


@dataclass(frozen=True)
class Slot:
    """Where parameter ``name`` lives in the unit's flat buffer."""

    name: str
    param: nn.Parameter
    offset: int          # first element inside the flat buffer
    shape: tuple[int, ...]
    # a tile (hybrid.zero.tiling): ``param`` is elements [base, +numel) of the flattened parameter
    # ``name`` of shape ``whole_shape``; otherwise base 0 and ``param`` is all of it
    base: int = 0
    whole_shape: tuple[int, ...] | None = None

    @property
    def numel(self) -> int:
        return int(torch.Size(self.shape).numel())

    @property
    def param_shape(self) -> tuple[int, ...]:
        """Shape of the whole (TP-local) parameter ``name``: what an initialiser or a checkpoint
        gives; the slot's own shape unless it is a tile."""
        return self.whole_shape if self.whole_shape is not None else self.shape


@dataclass(frozen=True)
class Segment:
    """The part of ``slot``'s parameter owned by this rank: elements [param_offset, +length) of the
    flattened (TP-local) parameter sit at [chunk_offset, +length) of the rank's chunk."""

    slot: Slot
    param_offset: int
    chunk_offset: int
    length: int

    def of(self, chunk: torch.Tensor) -> torch.Tensor:
        """This segment's view of a [chunk]-shaped partition (params, grads, master, moments)."""
        return chunk.narrow(0, self.chunk_offset, self.length)


class ShardedUnit:
    """Flat DP-partitioned storage of one unit's parameters; see the module docstring."""

    def __init__(self, name: str, named_params: list[tuple[str, nn.Parameter]], group: Group, *,
                 dtype: torch.dtype, device: torch.device, alignment: int, persistent: bool = False,
                 replicas: Group | None = None, secondary_group: Group | None = None,
                 tile_of: dict[int, tuple[int, tuple[int, ...]]] | None = None):
        """``tile_of``: id(param) -> (base, whole shape) for parameters that are tiles of a larger
        one (memory-centric tiling, :mod:`hybrid.zero.tiling`)."""
        if not named_params:
            raise ValueError(f"sharding unit {name!r} has no parameters to partition")
        self.name, self.group, self.persistent = name, group, persistent
        self.replicas = replicas
        self.slots: list[Slot] = []
        offset = 0
        tile_of = tile_of or {}
        for pname, param in named_params:
            base, whole = tile_of.get(id(param), (0, None))
            self.slots.append(Slot(pname, param, offset, tuple(param.shape), base, whole))
            offset += param.numel()
        self.numel = offset
        quantum = alignment * group.size
        self.padded = -(-offset // quantum) * quantum            # round up to Nd aligned chunks
        self.chunk = self.padded // group.size
        self.full = torch.empty(self.padded, dtype=dtype, device=device)
        self.shard = torch.zeros(self.chunk, dtype=dtype, device=device)
        # not zero-filled: the first reduce overwrites it (grad_accumulated is False), so its pages
        # stay unmapped while construction still holds every shard (ZeRO-3 params on NVMe)
        self.grad = torch.empty(self.chunk, dtype=dtype, device=device)
        self.segments = self._owned_segments(group.rank)
        self.secondary_group = secondary_group if not persistent else None
        self.secondary = (torch.empty(self.padded // secondary_group.size, dtype=dtype, device=device)
                          if self.secondary_group is not None else None)   # hpZ: [padded / h]
        self.secondary_valid = False
        self._gather_handle = None
        self._fetched = False          # the shard was fetched from the NVMe store for this gather
        self._reduce = None            # (handle, reduced chunk) of an in-flight reduce
        self.grad_accumulated = False  # False: the next reduced chunk overwrites ``grad``
        self.full.untyped_storage().resize_(0)   # nothing is gathered until the first use
        self.gathered = False
        self.store, self.store_index = None, -1   # hybrid.offload.param_store: shard on NVMe
        self.quantized_gather = False             # qwZ: gather int8 blocks (use_collectives)
        self.agree_scales = None                  # qwZ with TP: the block scales' TP maximum
        self.gather_format = "int8"               # qwZ's payload: int8 or fp8 (E4M3)
        self.reduce_scatter = functools.partial(comm.reduce_scatter_replicated, group=group,
                                                replicas=replicas)   # qgZ's replaces it

    def use_collectives(self, reduce_scatter: Callable | None, quantized_gather: bool,
                        agree_scales: Callable | None, gather_format: str = "int8") -> None:
        """The engine's ZeRO++ choices: ``reduce_scatter`` for the gradients (qgZ; None: the
        exact one), int8 (``gather_format`` "fp8": E4M3) parameter gathers (qwZ) with
        ``agree_scales`` (their TP agreement)."""
        if reduce_scatter is not None:
            self.reduce_scatter = reduce_scatter
        self.quantized_gather, self.agree_scales = quantized_gather, agree_scales
        self.gather_format = gather_format

    def attach_store(self, store, index: int) -> None:
        """Keep the shard in ``store`` (written there now); each gather fetches it back."""
        store.write(index, self.shard)
        self.store, self.store_index = store, index
        self.shard = torch.empty(0, dtype=self.shard.dtype, device=self.shard.device)

    # ---- layout ----------------------------------------------------------------------------
    def _owned_segments(self, rank: int) -> list[Segment]:
        lo, hi = rank * self.chunk, (rank + 1) * self.chunk
        out = []
        for slot in self.slots:
            start, end = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
            if start < end:
                out.append(Segment(slot, start - slot.offset + slot.base, start - lo, end - start))
        return out

    def bind(self, replace: Callable[[nn.Parameter, torch.Tensor], nn.Parameter]) -> None:
        """Make every parameter a view of the full buffer; ``replace(old, view)`` returns the
        parameter object to use (a new one when the old lives on the meta device)."""
        storage = self.full.untyped_storage()
        storage.resize_(self.padded * self.full.element_size())   # views need in-bounds storage
        slots = []
        for slot in self.slots:
            view = self.full.narrow(0, slot.offset, slot.numel).view(slot.shape)
            slots.append(dataclasses.replace(slot, param=replace(slot.param, view)))
        self.slots = slots
        if not self.gathered:
            storage.resize_(0)
        self.segments = self._owned_segments(self.group.rank)

    @torch.no_grad()
    def materialize(self, init_value: Callable[[str, nn.Parameter], torch.Tensor],
                    write_master: Callable[[int, torch.Tensor], None] | None = None) -> None:
        """Fill this rank's chunk from ``init_value(name, param)``, the full TP-local value of ONE
        parameter (transient); parameters this rank owns no part of are never computed.
        ``write_master(chunk offset, values)`` receives the values unrounded: in mixed precision
        the 16-bit chunk is their rounding, the fp32 master keeps what the initialiser computed
        (as stages 0-2, whose masters copy the fp32 model, so one seed gives one curve at every
        stage)."""
        for seg in self.segments:
            value = init_value(seg.slot.name, seg.slot.param)
            if tuple(value.shape) != seg.slot.param_shape:
                raise ValueError(f"initial value of {seg.slot.name!r} has shape {tuple(value.shape)}, "
                                 f"expected the TP-local shape {seg.slot.param_shape}")
            flat = value.reshape(-1).narrow(0, seg.param_offset, seg.length)
            if write_master is not None:
                write_master(seg.chunk_offset, flat)
            seg.of(self.shard).copy_(flat)
            del value, flat   # free it before the next parameter's value is computed

    # ---- parameter all-gather / release ----------------------------------------------------
    def gather(self, async_op: bool = True) -> None:
        """Start (or finish, when synchronous) the all-gather of the full parameters."""
        if self.gathered or self._gather_handle is not None:
            if not async_op:
                self.wait_gather()
            return
        storage = self.full.untyped_storage()
        storage.resize_(self.padded * self.full.element_size())
        if self.secondary_valid:   # hpZ: inside the host, from the secondary partition
            self._gather_handle = comm.all_gather_into(self.full, self.secondary,
                                                       self.secondary_group, async_op=True)
            if not async_op:
                self.wait_gather()
            return
        self._fetched = self.store is not None
        shard = self.shard if self.store is None else self.store.fetch(self.store_index)
        if self.quantized_gather:      # packed from the shard at once (a host buffer: moved first)
            self._gather_handle = quantized_all_gather(self.full, shard.to(self.full.device),
                                                       self.group, async_op=True,
                                                       agree=self.agree_scales,
                                                       fmt=self.gather_format)
        else:
            if shard.device != self.full.device:   # the NVMe store's host buffer: into our slot
                own = self.full.narrow(0, self.group.rank * shard.numel(), shard.numel())
                shard = own.copy_(shard)   # a blocking copy: the buffer may be released after it
            self._gather_handle = comm.all_gather_into(self.full, shard, self.group, async_op=True)
        if not async_op:
            self.wait_gather()

    def wait_gather(self) -> None:
        if self._gather_handle is not None:
            self._gather_handle.wait()
            self._gather_handle = None
            self.gathered = True
            if self._fetched:   # the gather has read the shard's buffer
                self.store.release(self.store_index)
                self._fetched = False
            if self.secondary is not None and not self.secondary_valid:
                h = self.secondary_group
                self.secondary.copy_(self.full.narrow(0, h.rank * self.secondary.numel(),
                                                      self.secondary.numel()))
                self.secondary_valid = True

    def regather(self) -> None:
        """Gather the full parameters again now (a persistent unit, after its shard changed)."""
        self.gathered = False
        self.gather(async_op=False)

    def invalidate_secondary(self) -> None:
        """The shard changed (an optimizer step, a load): the next gather is a full one again."""
        self.secondary_valid = False

    @property
    def in_flight(self) -> bool:
        return self._gather_handle is not None

    def release(self) -> None:
        """Free the full buffer (storage resized to 0 bytes); persistent units never release."""
        if self.persistent and self.gathered:
            return
        self.wait_gather()
        self.full.untyped_storage().resize_(0)
        self.gathered = False

    @torch.no_grad()
    def exact_values(self) -> dict[Slot, torch.Tensor]:
        """slot -> the exact full (TP-local) parameter (a tile's part of it), gathered unquantized into a temporary
        buffer (collective over DP); the unit's own buffer and state are left as they are."""
        shard = self.shard if self.store is None else self.store.fetch(self.store_index)
        full = torch.empty(self.padded, dtype=self.full.dtype, device=self.full.device)
        comm.all_gather_into(full, shard.to(full.device), self.group)
        if self.store is not None:
            self.store.release(self.store_index)
        return {s: full.narrow(0, s.offset, s.numel).view(s.shape) for s in self.slots}

    def held_bytes(self) -> int:
        return self.full.untyped_storage().nbytes()

    # ---- gradient reduce-scatter ----------------------------------------------------------
    @torch.no_grad()
    def reduce_gradients(self, flat: torch.Tensor, scratch: torch.Tensor | None = None) -> None:
        """Flatten the full gradients into ``flat`` (>= ``padded`` elements, the caller's until
        :meth:`finish_reduce`), reduce-scatter them asynchronously (summed over DP; ``scratch``
        is the backend's receive buffer, see :func:`hybrid.comm.reduce_scatter_into`) and drop
        the full ``.grad`` tensors. The first micro-batch reduces straight into ``grad``."""
        if self._reduce is not None:
            raise RuntimeError(f"unit {self.name!r} reduced its gradients twice in one backward")
        flat = flat[:self.padded]
        end = 0
        for slot in self.slots:                 # slots are back to back in offset order
            grad = slot.param.grad
            target = flat.narrow(0, slot.offset, slot.numel)
            if grad is None:                    # unused in this backward: reduces as zeros
                target.zero_()
            else:
                target.copy_(grad.reshape(-1))
                slot.param.grad = None
            end = slot.offset + slot.numel
        flat[end:].zero_()                      # alignment padding
        out = self.grad if not self.grad_accumulated else torch.empty_like(self.grad)
        handle = self.reduce_scatter(out, flat, async_op=True, scratch=scratch)
        self._reduce = (handle, out)

    @property
    def reduce_pending(self) -> bool:
        return self._reduce is not None

    @torch.no_grad()
    def finish_reduce(self) -> None:
        """Wait for the reduce-scatter and accumulate the chunk into ``grad``."""
        if self._reduce is None:
            return
        handle, out = self._reduce
        handle.wait()
        self._reduce = None
        if out is not self.grad:
            self.grad.add_(out)
        self.grad_accumulated = True

    def zero_grad(self) -> None:
        self.grad.zero_()
        self.grad_accumulated = False
