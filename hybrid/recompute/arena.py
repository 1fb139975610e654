"""Contiguous pre-allocated arenas for activation checkpoints (ZeRO §6.3 "MD", with §6.2 "CB").

ZeRO-R's memory defragmentation (MD) observes that long-lived tensors (activation checkpoints kept
from the forward pass to the backward pass) interleave in the allocator with short-lived ones (the
activations that are recomputed and dropped), fragmenting memory. The fix is to place the long-lived
tensors in pre-allocated contiguous buffers. An :class:`Arena` is such a buffer: a list of chunks of
one **constant, configurable size** (CB: the size does not grow with the model), handed out by a
bump pointer. All checkpoints of a micro-batch live in the same few storages; when the last one is
released (backward of the first layer) the pointer returns to the start, so the next micro-batch
reuses exactly the same memory and the number of live storages stays constant across steps.

The same class is the *host tier* of Pa+cpu: on CUDA its chunks are pinned host memory (so copies
can be asynchronous); on CPU-only runs it is a distinct pool whose bytes the memory report counts
apart from device memory (``tier="host"``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from hybrid.parallel_state import concrete_device

log = logging.getLogger(__name__)

ALIGN_BYTES = 64  # every allocation starts on a 64-byte boundary (safe for any dtype view, vector loads)


@dataclass(frozen=True)
class ArenaStats:
    name: str
    tier: str
    chunk_bytes: int
    num_chunks: int
    peak_used_bytes: int
    allocations: int   # allocations served so far (all steps)

    @property
    def capacity_bytes(self) -> int:
        return self.chunk_bytes * self.num_chunks


class Arena:
    """A pool of constant-size contiguous chunks with a bump allocator.

    ``allocate(shape, dtype)`` returns a view into a chunk; ``release(view)`` marks it dead; when
    nothing is live the pool rewinds. Chunks are created lazily (at most ``max_chunks``) and never
    freed, so after the first step no allocation reaches the framework's allocator.
    """

    def __init__(self, name: str, chunk_bytes: int, device: str | torch.device = "cpu", *,
                 tier: str = "device", pin_memory: bool = False, max_chunks: int = 1024):
        if chunk_bytes < ALIGN_BYTES:
            raise ValueError(f"arena {name!r}: chunk size {chunk_bytes} bytes is too small; use at "
                             f"least {ALIGN_BYTES} bytes (e.g. 64 MiB on a GPU)")
        self.name, self.tier, self.chunk_bytes = name, tier, int(chunk_bytes)
        self.device = concrete_device(device)   # ``contains`` compares it with tensors' cuda:N
        self.pin_memory = pin_memory and torch.cuda.is_available() and self.device.type == "cpu"
        self.max_chunks = max_chunks
        self._chunks: list[torch.Tensor] = []   # uint8 [chunk_bytes] each
        self._chunk, self._offset = 0, 0        # bump pointer: chunk index, byte offset in it
        self._live = 0
        self._peak = 0
        self._allocations = 0

    # ---- allocation ----------------------------------------------------------------------------
    def allocate(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
        numel = 1
        for d in shape:
            numel *= int(d)
        nbytes = numel * _itemsize(dtype)
        if nbytes > self.chunk_bytes:
            raise ValueError(f"arena {self.name!r}: a {nbytes}-byte checkpoint does not fit a "
                             f"{self.chunk_bytes}-byte chunk; raise the arena chunk size to at least "
                             f"{_round_up(nbytes, ALIGN_BYTES)} bytes")
        if self._offset + nbytes > self.chunk_bytes:
            self._chunk, self._offset = self._chunk + 1, 0
        chunk = self._chunk_at(self._chunk)
        # set_ rather than slicing: the slot shares the chunk's memory but not its autograd version
        # counter, so writing one checkpoint does not invalidate the others saved for backward
        view = torch.empty(0, dtype=dtype, device=self.device)
        view.set_(chunk.untyped_storage(), self._offset // _itemsize(dtype), tuple(shape))
        self._offset = _round_up(self._offset + nbytes, ALIGN_BYTES)
        self._live += 1
        self._allocations += 1
        self._peak = max(self._peak, self._chunk * self.chunk_bytes + self._offset)
        return view

    def release(self, view: torch.Tensor) -> None:
        """Mark one allocation dead; when none is live the pool rewinds to its start."""
        if not self.contains(view):
            raise ValueError(f"arena {self.name!r}: releasing a tensor it did not allocate")
        if self._live <= 0:
            raise RuntimeError(f"arena {self.name!r}: more releases than allocations")
        self._live -= 1
        if self._live == 0:
            self._chunk, self._offset = 0, 0

    def _chunk_at(self, index: int) -> torch.Tensor:
        while len(self._chunks) <= index:
            if len(self._chunks) >= self.max_chunks:
                raise RuntimeError(f"arena {self.name!r} is full ({self.max_chunks} chunks of "
                                   f"{self.chunk_bytes} bytes); raise max_chunks or the chunk size")
            self._chunks.append(torch.empty(self.chunk_bytes, dtype=torch.uint8, device=self.device,
                                            pin_memory=self.pin_memory))
            log.debug("arena %s: chunk %d of %d bytes (%s tier)", self.name, len(self._chunks),
                      self.chunk_bytes, self.tier)
        return self._chunks[index]

    # ---- inspection ----------------------------------------------------------------------------
    def contains(self, t: torch.Tensor) -> bool:
        """True when ``t`` lives inside one of this arena's chunks."""
        if t.device != self.device:
            return False
        ptr = t.untyped_storage().data_ptr()
        return any(ptr == c.untyped_storage().data_ptr() for c in self._chunks)

    def chunk_pointers(self) -> list[int]:
        """Addresses of the chunks' storages: after the first step they never change (CB)."""
        return [c.untyped_storage().data_ptr() for c in self._chunks]

    @property
    def live(self) -> int:
        return self._live

    def stats(self) -> ArenaStats:
        return ArenaStats(self.name, self.tier, self.chunk_bytes, len(self._chunks), self._peak,
                          self._allocations)

    def __repr__(self) -> str:
        s = self.stats()
        return (f"Arena({self.name!r}, tier={self.tier}, {s.num_chunks} x {self.chunk_bytes} B, "
                f"peak used {s.peak_used_bytes} B, live {self._live})")


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
