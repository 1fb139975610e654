"""Where an activation checkpoint waits between forward and recompute: whole, Pa, or Pa+cpu (ZeRO §6.1).

A checkpoint is the input of a recomputed segment, the hidden state ``[s, b, h]``. Without sequence
parallelism it is *replicated* across the tensor-parallel (TP) group - every TP rank holds the same
``s*b*h`` numbers. ZeRO-R's **Pa** removes that redundancy: each TP rank keeps only its 1/tp slice of
the flattened tensor, and just before the segment is recomputed the slices are all-gathered through
:mod:`hybrid.comm` (one all-gather of ``s*b*h`` elements per checkpoint, visible in the TP ledger; the
paper's "under 10% of Megatron's 12 sbh per block"). **Pa+cpu** further moves the slices to host
memory: on CUDA a pinned host pool filled asynchronously on a side stream and fetched back ahead of
recompute (the fetch of the next-to-be-recomputed checkpoint starts when the current one is used); on
CPU-only runs the same path places them in a separate host-tier :class:`~hybrid.recompute.arena.Arena`
whose bytes the memory report counts apart from device memory.

With sequence parallelism the checkpoint is already a sequence shard ``[s/tp, b, h]`` (different on
every TP rank, nothing replicated): partitioning it again would not save memory but would cost an
all-gather, so Pa keeps it whole (it is already "partitioned") and Pa+cpu only offloads it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from hybrid import comm
from hybrid.comm import Group
from hybrid.recompute.arena import Arena


@dataclass(eq=False)
class Handle:
    """What a store remembers about one saved checkpoint (the tensor itself goes to autograd)."""

    shape: torch.Size
    dtype: torch.dtype
    partitioned: bool                 # True: ``kept`` is this rank's 1/tp slice of the flat tensor
    kept: torch.Tensor                # the bytes that wait: whole / slice, in device, arena or host tier
    arena: Arena | None = None        # the arena ``kept`` was allocated from, released on load
    prefetched: torch.Tensor | None = None   # CUDA: device copy already on its way
    event: object | None = None       # CUDA: event recorded after the prefetch copy


@dataclass
class StoreCounters:
    saved: int = 0
    loaded: int = 0
    gathered_elements: int = 0
    offloaded_bytes: int = 0


class CheckpointStore:
    """Keeps activation checkpoints between forward and recompute.

    ``partition``: Pa (slice across ``group``); ``offload``: Pa+cpu (slices in ``host_arena``);
    ``device_arena``: MD for checkpoints that stay on the device. ``sequence_parallel`` tells the
    store that checkpoints are already sequence shards (never partitioned twice).
    """

    def __init__(self, group: Group, *, partition: bool = False, offload: bool = False,
                 sequence_parallel: bool = False, device_arena: Arena | None = None,
                 host_arena: Arena | None = None):
        if offload and host_arena is None:
            raise ValueError("Pa+cpu needs a host-tier arena: pass host_arena=Arena(..., tier='host')")
        if host_arena is not None and host_arena.tier != "host":
            raise ValueError(f"host_arena {host_arena.name!r} has tier {host_arena.tier!r}; "
                             f"create it with tier='host'")
        self.group = group
        self.partition = partition or offload   # Pa+cpu offloads Pa's slices
        self.offload = offload
        self.sequence_parallel = sequence_parallel
        self.device_arena = device_arena
        self.host_arena = host_arena
        self.counters = StoreCounters()
        self._waiting: list[Handle] = []   # saved, not yet loaded, in save order
        self._side_stream = None

    @property
    def mode(self) -> str:
        return "pa-cpu" if self.offload else "pa" if self.partition else "device"

    def arenas(self) -> list[Arena]:
        return [a for a in (self.device_arena, self.host_arena) if a is not None]

    # ---- forward: keep ---------------------------------------------------------------------------
    def save(self, x: torch.Tensor) -> Handle:
        x = x.detach()
        split = self.partition and self.group.size > 1 and not self.sequence_parallel
        part = _my_slice(x, self.group) if split else x
        if self.offload:
            kept, arena = self._to_host(part), self.host_arena
        elif self.device_arena is not None:
            kept, arena = self.device_arena.allocate(part.shape, part.dtype), self.device_arena
            kept.copy_(part)
        else:
            kept, arena = (part.clone() if split else x), None   # a slice view would pin all of x
        handle = Handle(x.shape, x.dtype, split, kept, arena)
        self.counters.saved += 1
        self._waiting.append(handle)
        return handle

    def _to_host(self, part: torch.Tensor) -> torch.Tensor:
        kept = self.host_arena.allocate(part.shape, part.dtype)
        if part.is_cuda:   # asynchronous device-to-pinned-host copy on a side stream
            stream = self._stream(part.device)
            stream.wait_stream(torch.cuda.current_stream(part.device))   # part is computed
            with torch.cuda.stream(stream):
                kept.copy_(part, non_blocking=True)
            part.record_stream(stream)   # its memory is not reused before the copy has read it
        else:
            kept.copy_(part)
        self.counters.offloaded_bytes += kept.numel() * kept.element_size()
        return kept

    # ---- backward: give back ---------------------------------------------------------------------
    def load(self, handle: Handle, device: torch.device) -> torch.Tensor:
        """The full checkpoint on ``device`` (gathered across TP if it was partitioned)."""
        self._waiting.remove(handle)   # eq=False: by identity
        part = self._fetch(handle, device)
        if self._waiting and self.offload:
            self._prefetch(self._waiting[-1], device)   # the next segment recomputed
        if handle.partitioned:
            full = _gather(part, handle, self.group)
            self.counters.gathered_elements += full.numel()
        else:
            full = part.view(handle.shape)
            if handle.arena is not None:   # the arena slot is rewound: the recompute needs a copy
                full = full.clone()
        if handle.arena is not None:
            handle.arena.release(handle.kept)
        self.counters.loaded += 1
        return full

    def _fetch(self, handle: Handle, device: torch.device) -> torch.Tensor:
        if handle.kept.device == device:
            return handle.kept   # CPU-only host tier: the same memory, read in place
        if handle.prefetched is None:
            self._prefetch(handle, device)
        consumer = torch.cuda.current_stream(device)
        consumer.wait_event(handle.event)
        # allocated on the side stream, read by the recompute on this one: without the record the
        # allocator could hand its memory to the next prefetch while the recompute still reads it
        handle.prefetched.record_stream(consumer)
        return handle.prefetched

    def _prefetch(self, handle: Handle, device: torch.device) -> None:
        if handle.prefetched is not None or handle.kept.device == device:
            return
        stream = self._stream(device)   # after the device-to-host copy of ``kept`` (same stream)
        with torch.cuda.stream(stream):
            handle.prefetched = handle.kept.to(device, non_blocking=True)
            handle.event = torch.cuda.Event()
            handle.event.record(stream)

    def _stream(self, device: torch.device):
        if self._side_stream is None:
            self._side_stream = torch.cuda.Stream(device)
        return self._side_stream

    @property
    def side_stream(self):
        """The CUDA stream of Pa+cpu's copies (None until the first one): what a caller waits for
        to time them (tests/gpu measure the overlap with compute)."""
        return self._side_stream


def _my_slice(x: torch.Tensor, group: Group) -> torch.Tensor:
    """This rank's ``ceil(n/tp)`` elements of the flattened ``x`` (zero-padded at the end)."""
    flat = x.reshape(-1)
    chunk = math.ceil(flat.numel() / group.size)
    piece = flat[group.rank * chunk:(group.rank + 1) * chunk]
    if piece.numel() < chunk:
        piece = torch.cat([piece, piece.new_zeros(chunk - piece.numel())])
    return piece


def _gather(part: torch.Tensor, handle: Handle, group: Group) -> torch.Tensor:
    """All-gather the slices (one collective through hybrid.comm) and restore the shape."""
    full = torch.empty(part.numel() * group.size, dtype=handle.dtype, device=part.device)
    comm.all_gather_into(full, part.contiguous(), group)
    n = math.prod(handle.shape)
    return full[:n].view(handle.shape)
