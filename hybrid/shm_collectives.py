"""All-gather, reduce-scatter and all-reduce through shared memory for CPU groups on one host
(ZeRO §5, §7).

ZeRO's data-parallel traffic is reduce-scatters of gradients and all-gathers of parameters (and a
step's small all-reduces: the gradient norm, overflow flags). Between CPU processes on one host,
gloo moves them through loopback TCP: the sender's kernel copies the data into a socket, the
receiver's kernel copies it out, and both copies run on the cores that compute. Here every rank
of the group maps the same shared-memory regions instead (one per rank, ``capacity`` bytes): a
collective costs one copy in (this rank's input into its region) and one pass out (the peers'
parts copied into the output, or summed into it), both ordinary memory traffic. The logical
volume the ledger records is unchanged: the same bytes cross between ranks.

Ordering is the one every collective library relies on: all ranks issue the group's collectives
in the same order with the same sizes. Collective ``s`` (numbered 1, 2, ... on every rank) takes
the next ``nbytes`` of each rank's region, as a ring, so the offsets agree without any message. A
header of int64 counters says, per rank, the last collective it has published (its input is in
its region) and the last it has consumed (it has read what it needs from the peers). A rank
reuses a piece of its region only after every rank has consumed the collectives that used it; it
first completes its own older collectives, so the ring never deadlocks: every rank reaches the
same launch and makes the same completions. Waiting spins with ``sched_yield``, then sleeps; a
peer whose process is gone, or the group's timeout, ends the wait with an error naming the ranks
(``pretrain.liveness`` then names their host).

Chosen once, when the parallel state is built (``--dp-transport``: :mod:`hybrid.parallel_state`
calls :meth:`ShmTransport.create`), and sized by the ZeRO engines, which know their largest
collective (:meth:`ShmTransport.reserve`, through :func:`hybrid.comm.reserve_transport`). Used only
when it can be: gloo groups of CPU processes that see the same files in ``/dev/shm`` (checked by
opening them, not by host names), on x86-64 (whose total store order makes a counter written after
a copy visible only after the copy), with room in ``/dev/shm`` (space is allocated up front, so a
full tmpfs is a fallback at start-up and not a SIGBUS later). A collective larger than ``capacity``
goes through gloo, decided by size alone so every rank decides the same. With ``required`` (``shm``
rather than ``auto``) a rank that cannot use it is an error naming the reason instead of a fallback.
The files are unlinked as soon as every rank has mapped them: nothing is left behind on a crash.
On GPUs NCCL does this itself (its shared-memory and P2P transports); this module is CPU-only.
"""

from __future__ import annotations

import collections
import logging
import os
import platform
import secrets
import time
from datetime import timedelta

import torch

from hybrid import comm
from hybrid.processes import process_gone

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
ALIGN = 64                       # every collective's piece starts on a cache line
PUBLISHED, CONSUMED, PID = 0, 1, 2
SPIN_SECONDS = 0.002             # sched_yield this long before sleeping between checks
CHECK_PEERS_EVERY = 0.05         # seconds between checks that the peers' processes exist
_COMBINE = {"sum": torch.sum, "max": torch.amax, "min": torch.amin}   # all-reduce ops over ranks


class ShmTransport:
    """Shared-memory regions of one group; see the module docstring. Build with :meth:`create`,
    then :meth:`reserve` room: until then (capacity 0) every collective goes through gloo."""

    def __init__(self, group, timeout: timedelta, required: bool = False):
        self.group, self.timeout, self.required = group, timeout.total_seconds(), required
        self.capacity = 0
        self._mapping = False            # regions being (re)mapped: all-reduces go through gloo
        self.regions: list[torch.Tensor] = []
        self.header: torch.Tensor | None = None
        self._reset()

    def _reset(self) -> None:
        self._seq = 0
        self._cursor = 0
        self._live: collections.deque = collections.deque()   # (seq, start, end) in seq order
        self._pending: dict[int, "_ShmWork"] = {}
        self._done: set[int] = set()
        self._consumed = 0

    # ---- set-up ----------------------------------------------------------------------------
    @classmethod
    def create(cls, group, timeout: timedelta | None = None,
               required: bool = False) -> "ShmTransport | None":
        """Collective over ``group``, a gloo group of several ranks: the transport (no regions yet),
        or None where some rank cannot use it (each rank says why in the debug log; with
        ``required``, a ValueError naming the reason). Its control messages are not recorded."""
        why = _local_reason_not(group, 0)
        if comm.max_over(group, why is not None):
            why = why or "another rank of the group cannot use it"
            if required:
                raise ValueError(f"--dp-transport shm: shared-memory collectives are not possible "
                                 f"for the {group.kind} group ({why}); use --dp-transport auto or gloo")
            log.debug("shared-memory collectives off for the %s group: %s", group.kind, why)
            return None
        return cls(group, timeout or timedelta(minutes=30), required)

    def reserve(self, nbytes: int) -> bool:
        """Room for collectives of up to ``nbytes`` (twice that, so one can be written while the
        one before it is still read). Collective over the group: every rank calls it, with the
        same ``nbytes``, while none of the group's collectives is in flight. Regions only grow;
        returns whether collectives of that size now go through shared memory."""
        capacity = _align(2 * nbytes)
        if capacity <= self.capacity:
            return True
        self._mapping = True
        try:
            mapped = self._map_regions(capacity)
        finally:
            self._mapping = False
        if mapped is None:
            return False
        self.regions, self.header = mapped
        self.capacity = capacity
        self._reset()
        log.debug("shared-memory collectives on for the %s group: %d bytes per rank",
                  self.group.kind, capacity)
        return True

    def _map_regions(self, capacity: int) -> tuple[list[torch.Tensor], torch.Tensor] | None:
        """New regions of ``capacity`` bytes mapped by every rank (their files already unlinked),
        or None (with a warning; an error if required) where some rank could not."""
        group = self.group
        problem = _local_reason_not(group, capacity)
        if comm.max_over(group, problem is not None):
            return self._give_up(problem or "another rank has no room in /dev/shm")
        token = torch.tensor([secrets.randbits(62) if group.rank == 0 else 0])
        with comm.unrecorded(group):
            comm.broadcast(token, group)
        names = [f"{SHM_DIR}/hybrid-{int(token):x}-{i}" for i in range(group.size + 1)]  # + header
        try:
            _create_file(names[group.rank], capacity)
            if group.rank == 0:
                _create_file(names[-1], 3 * 8 * group.size)
        except OSError as err:
            problem = str(err)
        opened = None
        if not comm.max_over(group, problem is not None):
            try:
                for name in names:   # from_file would create a missing file: a peer on another host
                    os.stat(name)
                regions = [torch.from_file(n, shared=True, size=capacity, dtype=torch.uint8)
                           for n in names[:-1]]
                header = torch.from_file(names[-1], shared=True, size=3 * group.size,
                                         dtype=torch.int64).view(3, group.size)
                opened = regions, header
            except (OSError, RuntimeError) as err:   # a different /dev/shm (another container)
                problem = f"cannot map a peer's region ({err})"
        failed = comm.max_over(group, opened is None)   # every rank mapped (or gave up): unlink
        for name in ((names[group.rank], names[-1]) if group.rank == 0 else (names[group.rank],)):
            try:
                os.unlink(name)
            except FileNotFoundError:
                pass
        if failed:
            return self._give_up(problem or "another rank could not map the regions")
        regions, header = opened
        header[PID, group.rank] = os.getpid()
        comm.barrier(group)                          # every pid is written before anyone waits
        return regions, header

    def _give_up(self, why: str) -> None:
        if self.required:
            raise ValueError(f"--dp-transport shm: cannot set up shared memory for the "
                             f"{self.group.kind} group ({why}); use --dp-transport auto or gloo")
        log.warning("shared-memory collectives off for the %s group: %s", self.group.kind, why)
        return None

    def buffers(self) -> list[torch.Tensor]:
        """This rank's region (the memory report's communication buffers; each rank has one)."""
        return [self.regions[self.group.rank]] if self.regions else []

    # ---- collectives -----------------------------------------------------------------------
    def all_gather(self, output: torch.Tensor, shard: torch.Tensor) -> "_ShmWork | None":
        """``output`` (contiguous, ``size`` x ``shard``) gets every rank's shard; None: too large."""
        n, me = shard.numel(), self.group.rank
        placed = self._reserve(shard.nbytes)
        if placed is None:
            return None
        seq, start = placed
        slots = output.view(-1).view(self.group.size, n)
        self._typed(me, start, shard).copy_(shard.view(-1))
        if shard.data_ptr() != slots[me].data_ptr():
            slots[me].copy_(shard.view(-1))
        self._publish(seq)

        def read() -> None:
            for peer in range(self.group.size):
                if peer != me:
                    slots[peer].copy_(self._typed(peer, start, shard))
        return self._work(seq, read)

    def reduce_scatter(self, output: torch.Tensor, full: torch.Tensor) -> "_ShmWork | None":
        """``output`` (contiguous) = this rank's 1/size slice of ``full`` summed over the ranks
        (its own part first, then the peers' in rank order); ``output`` may be that slice of
        ``full``. None: too large."""
        placed = self._reserve(full.nbytes)
        if placed is None:
            return None
        seq, start = placed
        me, chunk, source = self.group.rank, output.numel(), full.reshape(-1)
        lo, hi = me * chunk, (me + 1) * chunk
        mine = self._typed(me, start, full)
        mine[:lo].copy_(source[:lo])          # the peers' chunks; this rank's own is read in
        mine[hi:].copy_(source[hi:])          # place from ``full`` (untouched until wait())
        self._publish(seq)
        flat_out = output.view(-1)

        def read() -> None:
            parts = [source[lo:hi]] + [self._typed(r, start, full)[lo:hi]
                                       for r in range(self.group.size) if r != me]
            torch.add(parts[0], parts[1], out=flat_out)   # out may BE parts[0]: read first
            for part in parts[2:]:
                flat_out.add_(part)
        return self._work(seq, read)

    def all_reduce(self, tensor: torch.Tensor, op: str) -> "_ShmWork | None":
        """``tensor`` (contiguous) <- its ``op`` ("sum", "max", "min") over the ranks, combined in
        rank order on every rank (the same bits everywhere). For the small all-reduces (a
        gradient norm, overflow flags): one copy in, one read of every peer's, where gloo would
        take a round trip through the loopback. None: too large, or the regions are being set up
        (their own control messages are all-reduces)."""
        if self._mapping:
            return None
        placed = self._reserve(tensor.nbytes)
        if placed is None:
            return None
        seq, start = placed
        flat = tensor.view(-1)
        self._typed(self.group.rank, start, tensor).copy_(flat)
        self._publish(seq)

        def read() -> None:
            parts = torch.stack([self._typed(r, start, tensor) for r in range(self.group.size)])
            flat.copy_(_COMBINE[op](parts, dim=0))
        return self._work(seq, read)

    # ---- the ring and the counters ---------------------------------------------------------
    def _typed(self, rank: int, start: int, like: torch.Tensor) -> torch.Tensor:
        """``like.numel()`` elements of ``like.dtype`` at byte ``start`` of ``rank``'s region."""
        return self.regions[rank][start:start + like.nbytes].view(like.dtype)

    def _reserve(self, nbytes: int) -> tuple[int, int] | None:
        """The next collective's number and byte offset, once every rank is done with that space."""
        if nbytes > self.capacity:
            return None
        start = self._cursor if self._cursor + nbytes <= self.capacity else 0
        end = start + nbytes
        need = max((s for s, a, b in self._live if a < end and start < b), default=0)
        if need:
            for seq in sorted(s for s in self._pending if s <= need):   # our own, oldest first
                self._pending[seq].wait()
            self._wait_all(CONSUMED, need, "finish reading")
            while self._live and self._live[0][0] <= need:
                self._live.popleft()
        self._seq += 1
        self._live.append((self._seq, start, end))
        self._cursor = _align(end)
        return self._seq, start

    def _publish(self, seq: int) -> None:
        self.header[PUBLISHED, self.group.rank] = seq     # after the copy (x86-64: stores in order)

    def _work(self, seq: int, read) -> "_ShmWork":
        work = _ShmWork(self, seq, read)
        self._pending[seq] = work
        return work

    def _complete(self, seq: int, read) -> None:
        self._wait_all(PUBLISHED, seq, "publish its part")
        read()
        del self._pending[seq]
        self._done.add(seq)
        while self._consumed + 1 in self._done:
            self._consumed += 1
            self._done.discard(self._consumed)
        self.header[CONSUMED, self.group.rank] = self._consumed

    def _wait_all(self, row: int, seq: int, what: str) -> None:
        """Until every rank's counter ``row`` reaches ``seq``; an error if a peer is gone or the
        group's timeout passes."""
        counters = self.header[row]
        if int(counters.min()) >= seq:
            return
        begin = time.monotonic()
        next_check = begin + CHECK_PEERS_EVERY
        pause = 2e-5
        while int(counters.min()) < seq:
            now = time.monotonic()
            if now - begin < SPIN_SECONDS:
                os.sched_yield()
                continue
            time.sleep(pause)
            pause = min(2 * pause, 2e-4)
            if now >= next_check:
                next_check = now + CHECK_PEERS_EVERY
                self._raise_if_lost(row, seq, what, now - begin)

    def _raise_if_lost(self, row: int, seq: int, what: str, waited: float) -> None:
        late = [r for r in range(self.group.size) if int(self.header[row, r]) < seq]
        ranks = ",".join(str(self.group.ranks[r]) for r in late)
        gone = [r for r in late if process_gone(int(self.header[PID, r]))]
        if gone:
            names = ",".join(f"{self.group.ranks[r]} (pid {int(self.header[PID, r])})" for r in gone)
            raise RuntimeError(f"shared-memory collective of the {self.group.kind} group: lost "
                               f"connection to rank(s) {names}: the process is gone")
        if waited > self.timeout:
            raise RuntimeError(f"shared-memory collective of the {self.group.kind} group timed out "
                               f"after {waited:.0f} s waiting for rank(s) {ranks} to {what} "
                               f"(collective {seq})")


class _ShmWork:
    """Handle of one shared-memory collective: ``wait()`` reads the peers' parts (once)."""

    def __init__(self, transport: ShmTransport, seq: int, read):
        self.transport, self.seq, self.read = transport, seq, read

    def wait(self) -> bool:
        if self.read is not None:
            read, self.read = self.read, None
            self.transport._complete(self.seq, read)
        return True

    def is_completed(self) -> bool:
        return self.read is None


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _local_reason_not(group, capacity: int) -> str | None:
    """Why this rank cannot take part with regions of ``capacity`` bytes (None: it can)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"{platform.machine()} (the ordering of the counters is written for x86-64)"
    if not os.path.isdir(SHM_DIR):
        return f"no {SHM_DIR}"
    stat = os.statvfs(SHM_DIR)
    free = stat.f_bavail * stat.f_frsize
    if free < 2 * capacity * group.size:
        return (f"{SHM_DIR} has {free / 2**20:.0f} MiB free, the group needs "
                f"{capacity * group.size / 2**20:.0f} MiB (and as much spare)")
    return None


def _create_file(path: str, nbytes: int) -> None:
    """A new private file of ``nbytes`` with its space allocated (ENOSPC now, not SIGBUS later)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError:
        os.unlink(path)
        raise
    finally:
        os.close(fd)
