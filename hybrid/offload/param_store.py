"""Stage-3 parameter partitions on NVMe: ZeRO-Infinity's parameter offload (Rajbhandari et al. 2021,
§5.1 "infinity offload engine", §5.2 "overlap-centric design").

Under ZeRO-3 each rank owns a 1/Nd chunk of every sharding unit's 16-bit parameters
(:attr:`hybrid.zero.stage3_unit.ShardedUnit.shard`); the chunk is only read to all-gather the unit
(twice a step) and written once, by the optimizer. :class:`NVMeParamStore` keeps every unit's chunk
in one file and holds only ``buffers`` chunk-sized host buffers, whatever the number of units:

* ``fetch(k)`` returns a buffer holding unit k's chunk (the input of its all-gather) and is matched
  by ``release(k)`` once the gather has finished reading it. The store knows the order in which a
  step fetches the units (given, or recorded during the first step, like ZeRO-Infinity's trace of
  the first iteration) and reads the next ``lookahead`` units of that order into free buffers on
  its I/O thread while the current unit computes, so a fetch in the steady state is a cache hit.
* ``writer()`` is what the optimizer writes the updated chunks into (``params_out`` of the offload
  backends, which walk the chunks in order): each chunk gets a buffer (no read: it is overwritten
  whole) and is queued for write-back as soon as the next chunk is opened; the buffer keeps the new
  values, so a following fetch of that unit needs no read.
* buffers are reused least-recently-used among those not held and not needed within the
  read-ahead window; one FIFO I/O thread (os.preadv / os.pwrite release the GIL) orders a read into
  a buffer after the write-back out of it, and a unit's read after its own write-back.

Resident memory: ``buffers x max(sizes) x itemsize`` bytes (pinned when ``pin``), constant
(:func:`resident_bytes`, which the budget planner counts instead of the in-memory partitions).

File layout (raw elements of ``dtype`` - 2 bytes for bf16/fp16, 4 for fp32 - little-endian, no
header; unit k has ``sizes[k]`` elements starting at element ``starts[k] = sum(sizes[:k])``)::

    params_rank{R:05d}.bin   [ unit 0 chunk | unit 1 chunk | ... ]   size itemsize x sum(sizes)
                             element e of unit k at byte (starts[k] + e) x itemsize

The file is checkpoint-compatible: :meth:`NVMeParamStore.shard_views` maps it (after landing every
write-back), so a checkpoint copies a unit's chunk out page by page, and a loader writes it in and
calls :meth:`NVMeParamStore.invalidate`, without all chunks being resident at once.
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from hybrid.offload.nvme import open_exclusive

log = logging.getLogger(__name__)
BUFFERS = 4   # up to three held by in-flight gathers (see stage3_hooks), at least one read ahead


def resident_bytes(sizes: list[int], dtype: torch.dtype, buffers: int = BUFFERS) -> int:
    """Host bytes a store of these chunk ``sizes`` keeps resident: its buffers, nothing else."""
    return buffers * max(sizes) * torch.empty((), dtype=dtype).element_size()


@dataclass
class _Buffer:
    """One host buffer: which unit's chunk it holds (or is being read into), its last I/O."""

    data: torch.Tensor
    unit: int | None = None
    holds: int = 0                  # fetches or writes not yet released / committed
    io: Future | None = None        # the last read into / write-back out of this buffer
    last_use: int = 0
    reading: bool = False           # ``io`` is a read whose data nobody has waited for yet


class NVMeParamStore:
    """Every unit's parameter chunk (``sizes[k]`` elements of ``dtype``) in a file (module doc)."""

    def __init__(self, sizes: list[int], *, dtype: torch.dtype, directory: str, rank: int,
                 buffers: int = BUFFERS, lookahead: int | None = None, order: list[int] | None = None,
                 pin: bool = False):
        if not sizes or min(sizes) <= 0:
            raise ValueError(f"every unit needs a positive chunk size, got {sizes}")
        if buffers < 2:
            raise ValueError(f"the parameter store needs at least 2 buffers, got {buffers}")
        self.sizes, self.dtype = list(sizes), dtype
        self.item = torch.empty((), dtype=dtype).element_size()
        self.starts = np.cumsum([0] + self.sizes[:-1]).tolist()
        self.lookahead = buffers - 2 if lookahead is None else lookahead
        if not 0 <= self.lookahead < buffers:
            raise ValueError(f"lookahead must be in [0, {buffers - 1}], got {lookahead}")
        self.path = os.path.join(directory, f"params_rank{rank:05d}.bin")
        os.makedirs(directory, exist_ok=True)
        self.fd = open_exclusive(self.path, sum(self.sizes) * self.item,
                                 "another parameter store; give each one its own directory")
        self.buffers = [_Buffer(torch.empty(max(self.sizes), dtype=dtype, pin_memory=pin))
                        for _ in range(buffers)]
        self.io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nvme-params")
        self._pending: list[Future] = []
        self.order = list(order) if order is not None else None
        self._recording: list[int] = []
        self._cursor, self._clock = 0, 0
        self.trace: list[tuple[str, int]] = []   # ("read" | "hit" | "miss" | "write", unit)
        log.info("NVMe parameter store: %s (%.1f MiB), %d buffers of %d elements", self.path,
                 sum(self.sizes) * self.item / 2**20, buffers, max(self.sizes))

    # ---- raw I/O (runs on the I/O thread) ---------------------------------------------------
    def _bytes(self, t: torch.Tensor) -> memoryview:
        return memoryview(t.view(torch.uint8).numpy()).cast("B")

    def _read(self, unit: int, data: torch.Tensor) -> None:
        view = self._bytes(data[:self.sizes[unit]])
        got = os.preadv(self.fd, [view], self.starts[unit] * self.item)
        if got != len(view):
            raise IOError(f"short read of {self.path}: {got} of {len(view)} bytes")

    def _write(self, unit: int, data: torch.Tensor) -> None:
        view, offset, done = self._bytes(data[:self.sizes[unit]]), self.starts[unit] * self.item, 0
        while done < len(view):
            done += os.pwrite(self.fd, view[done:], offset + done)

    def _submit(self, fn, unit: int, buf: _Buffer) -> Future:
        future = self.io.submit(fn, unit, buf.data)
        self._pending = [f for f in self._pending if not f.done() or f.exception()]
        self._pending.append(future)
        buf.io = future
        return future

    # ---- buffers ----------------------------------------------------------------------------
    def _holding(self, unit: int) -> _Buffer | None:
        return next((b for b in self.buffers if b.unit == unit), None)

    def _free_buffer(self, keep: set[int]) -> _Buffer | None:
        """A buffer nobody holds, preferring empty ones, then least recently used; buffers whose
        unit is in ``keep`` (about to be fetched) are not taken."""
        free = [b for b in self.buffers if b.holds == 0 and b.unit not in keep]
        if not free:
            return None
        return min(free, key=lambda b: (b.unit is not None, b.last_use))

    def _touch(self, buf: _Buffer) -> None:
        self._clock += 1
        buf.last_use = self._clock

    def _upcoming(self) -> list[int]:
        """The next ``lookahead`` units of the fetch order after the cursor (wrapping)."""
        if not self.order or not self.lookahead:
            return []
        n = len(self.order)
        out = []
        for i in range(n):
            unit = self.order[(self._cursor + i) % n]
            if unit not in out:
                out.append(unit)
            if len(out) == self.lookahead:
                break
        return out

    def _read_ahead(self) -> None:
        upcoming = self._upcoming()
        for unit in upcoming:
            if self._holding(unit) is not None:
                continue
            buf = self._free_buffer(keep=set(upcoming))
            if buf is None:
                return
            buf.unit, buf.reading = unit, True
            self._touch(buf)
            self._submit(self._read, unit, buf)
            self.trace.append(("read", unit))

    def _advance(self, unit: int) -> None:
        """Move the cursor past this fetch of ``unit`` (resynchronising if the engine deviates)."""
        if self.order is None:
            self._recording.append(unit)
            return
        n = len(self.order)
        for i in range(n):
            if self.order[(self._cursor + i) % n] == unit:
                self._cursor = (self._cursor + i + 1) % n
                return

    # ---- the engine's interface -------------------------------------------------------------
    def fetch(self, unit: int) -> torch.Tensor:
        """Unit ``unit``'s chunk ([sizes[unit]] of ``dtype`` in a host buffer), valid until
        :meth:`release`. Starts the read-ahead of the next units of the fetch order."""
        buf = self._holding(unit)
        if buf is None:
            buf = self._free_buffer(keep=set())
            if buf is None:
                raise RuntimeError(f"all {len(self.buffers)} parameter buffers are held; release "
                                   f"units after their gather or use more buffers")
            buf.unit, buf.reading = unit, True
            self._submit(self._read, unit, buf)
            self.trace.append(("miss", unit))
        else:
            self.trace.append(("hit", unit))
        buf.holds += 1
        self._touch(buf)
        self._advance(unit)
        self._read_ahead()
        if buf.reading:   # (a pending write-back out of it does not matter: it only reads it)
            buf.io.result()
            buf.reading = False
        return buf.data[:self.sizes[unit]]

    def release(self, unit: int) -> None:
        """The gather has read ``unit``'s chunk: its buffer may be reused (data stays cached)."""
        buf = self._holding(unit)
        if buf is None or buf.holds == 0:
            raise RuntimeError(f"unit {unit} is not fetched")
        buf.holds -= 1

    def end_step(self) -> None:
        """End of a step: the first one's fetches become the read-ahead order (unless given)."""
        if self.order is None and self._recording:
            self.order, self._recording = self._recording, []
            self._cursor = 0
            log.debug("parameter store: recorded fetch order of %d units", len(self.order))
        self._read_ahead()   # the next step's first units

    def open_for_write(self, unit: int) -> torch.Tensor:
        """A buffer for ``unit``'s new chunk (contents undefined: overwrite all of it)."""
        if any(b.unit == unit and b.holds for b in self.buffers):
            raise RuntimeError(f"unit {unit} is written while fetched")
        old = self._holding(unit)
        buf = old if old is not None else self._free_buffer(keep=set())
        if buf is None:
            raise RuntimeError(f"all {len(self.buffers)} parameter buffers are held")
        if buf.io is not None:
            buf.io.result()   # a read-ahead or write-back still uses this buffer
        buf.unit, buf.holds, buf.reading = unit, 1, False
        self._touch(buf)
        return buf.data[:self.sizes[unit]]

    def commit(self, unit: int) -> None:
        """Queue the write-back of ``unit``'s new chunk; its buffer stays a valid cache of it."""
        buf = self._holding(unit)
        if buf is None or buf.holds != 1:
            raise RuntimeError(f"unit {unit} was not opened for writing")
        buf.holds = 0
        self._submit(self._write, unit, buf)
        self.trace.append(("write", unit))

    def writer(self) -> "ShardWriter":
        """The ``params_out`` sequence for an offload backend's ``update`` / ``publish``."""
        return ShardWriter(self)

    def write(self, unit: int, values: torch.Tensor) -> None:
        """Store ``unit``'s chunk from ``values`` (initialisation, or a checkpoint load)."""
        self.open_for_write(unit).copy_(values.reshape(-1))
        self.commit(unit)

    def flush(self) -> None:
        """Wait for every queued read and write (re-raising an I/O error)."""
        for future in self._pending:
            future.result()
        self._pending = []

    # ---- checkpoints and reports ------------------------------------------------------------
    def shard_views(self) -> list[torch.Tensor]:
        """Per-unit 1-D ``dtype`` tensors mapped from the file (paged in on access). Writing
        through them must be followed by :meth:`invalidate`."""
        self.flush()
        raw = np.memmap(self.path, dtype=np.uint8, mode="r+", shape=(sum(self.sizes) * self.item,))
        flat = torch.from_numpy(raw).view(self.dtype)
        return list(torch.split(flat, self.sizes))

    def invalidate(self) -> None:
        """Forget cached chunks (the file was written through :meth:`shard_views`)."""
        self.flush()
        for buf in self.buffers:
            if buf.holds:
                raise RuntimeError(f"unit {buf.unit} is still fetched")
            buf.unit = None

    def resident(self) -> list[torch.Tensor]:
        """The host buffers (memory report category 'param16' of a stage-3 rank)."""
        return [b.data for b in self.buffers]

    def close(self) -> None:
        if self.fd >= 0:
            self.flush()
            self.io.shutdown(wait=True)
            os.close(self.fd)
            self.fd = -1

    def __del__(self):
        try:
            self.close()
        except Exception:   # interpreter shutdown: the OS closes the descriptor anyway
            pass


class ShardWriter:
    """``params_out`` for the offload backends, which walk the chunks in increasing order:
    indexing chunk k opens unit k for writing and commits the unit opened before it; :meth:`close`
    commits the last one. Going back to a committed chunk is refused (its new values would be
    lost)."""

    def __init__(self, store: NVMeParamStore):
        self.store = store
        self.current: tuple[int, torch.Tensor] | None = None
        self.done: set[int] = set()

    def __len__(self) -> int:
        return len(self.store.sizes)

    def __getitem__(self, unit: int) -> torch.Tensor:
        if self.current is not None and self.current[0] == unit:
            return self.current[1]
        if unit in self.done:
            raise RuntimeError(f"chunk {unit} was already written and committed; write the "
                               f"chunks in order")
        self._commit_current()
        self.current = (unit, self.store.open_for_write(unit))
        return self.current[1]

    def _commit_current(self) -> None:
        if self.current is not None:
            self.store.commit(self.current[0])
            self.done.add(self.current[0])
            self.current = None

    def close(self) -> None:
        self._commit_current()

    def __enter__(self) -> "ShardWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
