"""The one thin layer every collective goes through, with a ledger of logical volumes (docs/design.md §5).

ZeRO §5 and §7 count communication as the data a ring collective moves per rank: an all-reduce of
Ψ elements moves 2Ψ(n-1)/n (a reduce-scatter plus an all-gather), an all-gather or a reduce-scatter
moves Ψ(n-1)/n of the full tensor. Each call below performs the collective on its :class:`Group` and
appends one :class:`CommRecord` to that group's :class:`CommLedger`, so "stage 3 moves 3Ψ" is a test.

Every function takes ``async_op``; asynchronous calls return a handle whose ``wait()`` completes the
collective (a no-op handle on single-rank groups, where nothing is sent).

On gloo (CPU) two collectives are built here instead of taken from the backend, because gloo's own
do more than the operation: its reduce-scatter clones the input, all-reduces ALL of it (twice the
volume of a reduce-scatter) and copies a slice out; its all-gather gathers into a fresh buffer and
copies that into the output. Here a reduce-scatter is one all-to-all (each rank sends chunk j of
its input to rank j: (n-1)/n of the tensor, a real reduce-scatter's volume) followed by a local sum
of the n chunks received, and an all-gather sends this rank's shard straight into the output slot
of every peer (point-to-point, all posted at once: again (n-1)/n). NCCL's native collectives are
used as they are.

Pipeline parallelism adds point-to-point transfers (:func:`p2p`): a batch of sends and receives
between stages, posted at once (NCCL: one ``batch_isend_irecv``; gloo: ``isend``/``irecv`` with a
tag per message, so receives posted ahead of time match by tag, not by order). A send records its
bytes under op ``send`` and a receive under ``recv``, in the group's kind (``pp``). A CPU group whose ranks share a host can instead take both through shared
memory: :mod:`hybrid.parallel_state` gives the DP group a transport (:mod:`hybrid.shm_collectives`,
which builds on this module, never the other way round) and the ZeRO engines size it
(:func:`reserve_transport`); the ledger records the same volumes either way.

Beside each record's logical volume, the ledger splits it into the bytes that stay inside a host and
those that cross hosts (:mod:`hybrid.perf.links`), from the group's ranks' hosts (the ledger's
``ranks_per_node``, set from the topology) and the algorithm that moved it: ``ring`` for NCCL and
gloo's all-reduce, ``direct`` for the gloo all-gather and reduce-scatter built here, ``shm`` for the
shared-memory transport (one host: nothing crosses).
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from hybrid.perf.links import nodes_of, split_bytes


@dataclass(frozen=True)
class CommRecord:
    op: str            # all_reduce | all_gather | reduce_scatter | all_to_all | all_to_all_v |
                       # broadcast | send | recv
    group: str         # tp | dp | world | pp | embedding | mp | ep | expert_dp
    numel: int         # elements of the full (unsharded) tensor the collective is about
    dtype: torch.dtype
    bytes_per_rank: float  # logical ring volume moved by each rank
    cross_host_bytes: float = 0.0  # the part of it on links between hosts (group average)
    algorithm: str = "ring"        # ring | direct | shm (hybrid.perf.links)
    category: str = ""             # whose traffic beyond ZeRO's own ("muon"), see labelled()

    @property
    def intra_host_bytes(self) -> float:
        return self.bytes_per_rank - self.cross_host_bytes


@dataclass
class CommLedger:
    """Record of collectives; ``totals()`` sums bytes per (group, op), ``split_totals()`` the same
    bytes split into intra-host and cross-host ones (hosts of ``ranks_per_node`` consecutive ranks;
    None: one host).

    Bounded for long runs: once more than ``max_records`` are held, the oldest half is dropped.
    Readers take a ``position`` mark and later read ``since(mark)``; sums cover retained records.
    """

    records: list[CommRecord] = field(default_factory=list)
    enabled: bool = True
    max_records: int = 200_000
    dropped: int = 0   # records trimmed from the front so far
    ranks_per_node: int | None = None
    category: str = ""   # stamped on new records (set by labelled())
    # --log-straggler: seconds this rank spent inside collectives and waiting on their handles
    # (None: not measured, the default; the collectives then pay one attribute check)
    wait_seconds: float | None = None
    _timing_depth: int = 0   # > 0 inside a timed call: nested calls and waits are not re-counted


    def record(self, op: str, group: "Group", numel: int, dtype: torch.dtype,
               algorithm: str = "ring", src_index: int = 0, peer: int | None = None) -> None:
        """``peer``: for a send/recv, the other rank's index in ``group`` (the pair's hosts decide
        whether its bytes cross, not the whole group's)."""
        if self.enabled and group.size > 1:
            n = group.size
            factor = {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n,
                      "reduce_scatter": (n - 1) / n, "all_to_all": (n - 1) / n,
                      "broadcast": 1.0, "send": 1.0, "recv": 1.0}[op]
            nbytes = factor * numel * _itemsize(dtype)
            ranks = group.ranks if peer is None else [group.ranks[group.rank], group.ranks[peer]]
            nodes = nodes_of(ranks, self.ranks_per_node)
            _, cross = split_bytes(nbytes, op, algorithm, nodes, src_index)
            self.records.append(CommRecord(op, group.kind, numel, dtype, nbytes, cross, algorithm,
                                           self.category))
            if len(self.records) > self.max_records:
                half = len(self.records) // 2
                del self.records[:half]
                self.dropped += half

    def record_sent(self, op: str, group: "Group", numel: int, dtype: torch.dtype,
                    sent_rows: list[int], row_numel: int, algorithm: str = "direct") -> None:
        """Record a collective whose per-rank volume is what this rank really sends: ``sent_rows[j]``
        rows of ``row_numel`` elements to group member j (its own entry stays local and is not
        counted). The cross-host part is the rows sent to members on other hosts, exactly."""
        if self.enabled and group.size > 1:
            item = _itemsize(dtype)
            nodes = nodes_of(group.ranks, self.ranks_per_node)
            mine = nodes[group.rank]
            off = [rows if j != group.rank else 0 for j, rows in enumerate(sent_rows)]
            nbytes = float(sum(off) * row_numel * item)
            cross = float(sum(rows for j, rows in enumerate(off) if nodes[j] != mine)
                          * row_numel * item)
            self.records.append(CommRecord(op, group.kind, numel, dtype, nbytes, cross, algorithm,
                                           self.category))
            if len(self.records) > self.max_records:
                half = len(self.records) // 2
                del self.records[:half]
                self.dropped += half

    @property
    def position(self) -> int:
        """How many records were ever appended: a mark for :meth:`since`."""
        return self.dropped + len(self.records)

    def since(self, mark: int) -> list[CommRecord]:
        """Records appended after ``mark`` (all retained ones if the ledger was reset since)."""
        if mark > self.position:
            return list(self.records)
        return self.records[max(mark - self.dropped, 0):]

    def discard(self, mark: int | None = None) -> None:
        """Forget the records before ``mark`` (default: all); ``position`` is unchanged. A training
        loop that has read them calls this, so its memory stays flat over a long run."""
        held = len(self.records)
        n = held if mark is None else min(max(mark - self.dropped, 0), held)
        del self.records[:n]
        self.dropped += n

    def totals(self) -> dict[tuple[str, str], float]:
        out: dict[tuple[str, str], float] = defaultdict(float)
        for r in self.records:
            out[(r.group, r.op)] += r.bytes_per_rank
        return dict(out)

    def split_totals(self) -> dict[tuple[str, str], tuple[float, float]]:
        """(intra-host, cross-host) bytes per (group, op); each pair sums to ``totals()``'s entry."""
        out: dict[tuple[str, str], tuple[float, float]] = {}
        for r in self.records:
            intra, cross = out.get((r.group, r.op), (0.0, 0.0))
            out[(r.group, r.op)] = (intra + r.intra_host_bytes, cross + r.cross_host_bytes)
        return out

    def cross_host_bytes(self, group: str | None = None, op: str | None = None) -> float:
        return sum(r.cross_host_bytes for r in self.records
                   if (group is None or r.group == group) and (op is None or r.op == op))

    def bytes(self, group: str | None = None, op: str | None = None,
              category: str | None = None) -> float:
        return sum(r.bytes_per_rank for r in self.records
                   if (group is None or r.group == group) and (op is None or r.op == op)
                   and (category is None or r.category == category))

    def count(self, group: str | None = None, op: str | None = None) -> int:
        return sum(1 for r in self.records
                   if (group is None or r.group == group) and (op is None or r.op == op))

    def reset(self) -> None:
        self.records.clear()
        self.dropped = 0


class _TimedHandle:
    """An asynchronous collective's handle whose ``wait()`` adds its blocked seconds to the
    ledger's ``wait_seconds`` (the straggler timing of :func:`_timed`)."""

    def __init__(self, handle, ledger: CommLedger):
        self.handle, self.ledger = handle, ledger

    def wait(self, *args, **kwargs):
        return _timed_call(self.ledger, self.handle.wait, *args, **kwargs)

    def is_completed(self) -> bool:
        return self.handle.is_completed()


def _timed_call(ledger: CommLedger, fn, *args, **kwargs):
    if ledger._timing_depth:          # inside another timed call: it counts the whole
        return fn(*args, **kwargs)
    ledger._timing_depth += 1
    start = time.perf_counter()
    try:
        return fn(*args, **kwargs)
    finally:
        ledger._timing_depth -= 1
        ledger.wait_seconds += time.perf_counter() - start


def _timed(position: int):
    """Time a collective (its :class:`Group` is argument ``position`` or ``group=``) into its
    ledger's ``wait_seconds`` when the ledger measures (--log-straggler): the call itself, and the
    ``wait()`` of the handle an asynchronous call returns. Off, it costs one call and one attribute
    check per collective."""
    def wrap(fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            group = args[position] if len(args) > position else kwargs["group"]
            ledger = group.ledger
            if ledger.wait_seconds is None:
                return fn(*args, **kwargs)
            handle = _timed_call(ledger, fn, *args, **kwargs)
            return _TimedHandle(handle, ledger) if handle is not None else None
        return timed
    return wrap


@dataclass
class Group:
    """A process group with its kind, this rank's index in it and the ledger it reports to.

    ``pg`` is None for a single-rank group: collectives are then local copies and send nothing.
    """

    kind: str
    ranks: list[int]
    rank: int
    ledger: CommLedger
    pg: object | None = None
    timeout: timedelta | None = None
    shm: object | None = None    # hybrid.shm_collectives.ShmTransport, set by hybrid.parallel_state

    @property
    def size(self) -> int:
        return len(self.ranks)

    def require_process_group(self) -> None:
        if self.pg is None and self.size > 1:
            raise RuntimeError(f"this {self.kind} group of {self.size} ranks belongs to a dry-run "
                               f"parallel state and cannot communicate")


class _Done:
    """Handle of a collective that completed synchronously (single-rank groups)."""

    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


@_timed(1)
def all_reduce(tensor: torch.Tensor, group: Group, op: str = "sum", async_op: bool = False):
    """In-place all-reduce of ``tensor`` over ``group`` (op: sum, max or min)."""
    if op not in _REDUCE_OPS:
        raise ValueError(f"all-reduce op must be one of {sorted(_REDUCE_OPS)}, got {op!r}")
    group.ledger.record("all_reduce", group, tensor.numel(), tensor.dtype)
    if group.size == 1:
        return _Done() if async_op else None
    group.require_process_group()
    if group.shm is not None and tensor.is_contiguous() and tensor.device.type == "cpu":
        work = group.shm.all_reduce(tensor, op)
        if work is not None:
            return _finish(work, async_op)
    return dist.all_reduce(tensor, op=_REDUCE_OPS[op], group=group.pg, async_op=async_op)


class _Joined:
    """Handle of several backend works plus what must run after them (a local reduction)."""

    def __init__(self, works: list, then=None):
        self.works, self.then = works, then

    def wait(self) -> bool:
        for work in self.works:
            work.wait()
        self.works = []
        if self.then is not None:
            then, self.then = self.then, None
            then()
        return True

    def is_completed(self) -> bool:
        return self.then is None and not self.works


def _finish(handle: _Joined, async_op: bool):
    if async_op:
        return handle
    handle.wait()
    return None


def _is_gloo(group: Group) -> bool:
    return dist.get_backend(group.pg) == "gloo"


def needs_reduce_scratch(group: Group) -> bool:
    """Whether :func:`reduce_scatter_into` on ``group`` receives into a full-size scratch buffer
    (gloo's all-to-all path): callers that reduce often keep one and pass it as ``scratch``.
    Not with a sized shared-memory transport: the peers' regions are read directly."""
    shared = group.shm is not None and group.shm.capacity > 0
    return group.size > 1 and group.pg is not None and not shared and _is_gloo(group)


def reserve_transport(group: Group, nbytes: int) -> bool:
    """Make ``group``'s shared-memory transport, where set-up gave it one, hold collectives of
    ``nbytes``: an engine calls it with its largest reduce-scatter or all-gather. Collective over
    ``group`` (every rank, the same ``nbytes``, nothing in flight); returns whether such
    collectives go through shared memory (False: the backend's own path)."""
    return group.shm is not None and group.shm.reserve(nbytes)


def transport_buffers(group: Group) -> list[torch.Tensor]:
    """This rank's constant-size shared-memory region of ``group`` (memory report), if any."""
    return group.shm.buffers() if group.shm is not None else []


@_timed(2)
def all_gather_into(output: torch.Tensor, shard: torch.Tensor, group: Group, async_op: bool = False):
    """Concatenate every rank's ``shard`` along dim 0 into ``output`` (``size`` times larger).
    ``shard`` may be this rank's own slot of ``output`` (an in-place all-gather)."""
    if output.numel() != shard.numel() * group.size:
        raise ValueError(f"all-gather output has {output.numel()} elements, expected "
                         f"{shard.numel()} x {group.size}")
    if group.size == 1:
        output.copy_(shard.view_as(output))
        return _Done() if async_op else None
    group.require_process_group()
    if group.shm is not None and output.is_contiguous() and output.device.type == "cpu":
        work = group.shm.all_gather(output, shard.contiguous())
        if work is not None:
            group.ledger.record("all_gather", group, output.numel(), output.dtype, "shm")
            return _finish(work, async_op)
    if not (_is_gloo(group) and output.is_contiguous() and output.device.type == "cpu"):
        # gloo's send/recv hand the raw pointer to its TCP transport (host memory only); its
        # all-gather stages CUDA tensors through pinned host buffers itself
        group.ledger.record("all_gather", group, output.numel(), output.dtype, "ring")
        return dist.all_gather_into_tensor(output, shard, group=group.pg, async_op=async_op)
    group.ledger.record("all_gather", group, output.numel(), output.dtype, "direct")
    slots = output.view(-1).chunk(group.size)          # [size] x [shard numel], contiguous
    source = shard.contiguous().view(-1)
    if source.data_ptr() != slots[group.rank].data_ptr():
        slots[group.rank].copy_(source)
    works = []
    for peer, global_rank in enumerate(group.ranks):   # every send and receive posted at once
        if peer != group.rank:
            works.append(dist.isend(source, global_rank, group=group.pg))
            works.append(dist.irecv(slots[peer], global_rank, group=group.pg))
    return _finish(_Joined(works), async_op)


@_timed(2)
def reduce_scatter_into(output: torch.Tensor, full: torch.Tensor, group: Group,
                        async_op: bool = False, scratch: torch.Tensor | None = None):
    """Sum ``full`` over ``group`` and keep this rank's 1/size slice (along dim 0) in ``output``.

    ``output`` may be this rank's own slice of ``full`` (in place); ``full`` must stay untouched
    until ``wait()``. On gloo the chunks arrive in a
    full-size receive buffer: ``scratch`` (a contiguous tensor of at least ``full.numel()``
    elements of its dtype, untouched until ``wait()``), or a fresh allocation."""
    if full.numel() != output.numel() * group.size:
        raise ValueError(f"reduce-scatter input has {full.numel()} elements, expected "
                         f"{output.numel()} x {group.size}")
    if group.size == 1:
        if output.data_ptr() != full.data_ptr():   # in place (the engines' case): nothing to do
            output.copy_(full.view_as(output))
        return _Done() if async_op else None
    group.require_process_group()
    if group.shm is not None and output.is_contiguous() and output.device.type == "cpu":
        work = group.shm.reduce_scatter(output, full.contiguous())   # host regions: host tensors
        if work is not None:
            group.ledger.record("reduce_scatter", group, full.numel(), full.dtype, "shm")
            return _finish(work, async_op)
    if not (_is_gloo(group) and output.is_contiguous()):
        group.ledger.record("reduce_scatter", group, full.numel(), full.dtype, "ring")
        return dist.reduce_scatter_tensor(output, full, group=group.pg, async_op=async_op)
    group.ledger.record("reduce_scatter", group, full.numel(), full.dtype, "direct")
    if scratch is None:
        scratch = torch.empty(full.numel(), dtype=full.dtype, device=full.device)
    received = scratch.view(-1)[:full.numel()]                                 # [size x chunk]
    work = dist.all_to_all_single(received, full.contiguous().view(-1), group=group.pg,
                                  async_op=True)
    flat_out = output.view(-1)

    def reduce_locally() -> None:                       # chunk j of every rank, summed in order
        torch.sum(received.view(group.size, -1), dim=0, out=flat_out)
    return _finish(_Joined([work], reduce_locally), async_op)


@_timed(2)
def reduce_scatter_replicated(output: torch.Tensor, full: torch.Tensor, group: Group,
                              replicas: Group | None, async_op: bool = False,
                              scratch: torch.Tensor | None = None):
    """Hybrid sharding's gradient reduction (FSDP2 HSDP, MiCS): :func:`reduce_scatter_into` over
    ``group`` (the shard group, inside a host), then an all-reduce of this rank's slice ``output``
    over ``replicas`` (the ranks holding the same slice on the other hosts), started once the
    reduce-scatter has landed: the sum over every rank of both. ``replicas`` None or of one rank:
    the reduce-scatter alone. Both collectives are recorded with their own groups."""
    handle = reduce_scatter_into(output, full, group, async_op=True, scratch=scratch)
    across = (lambda: all_reduce(output, replicas)) if replicas is not None and replicas.size > 1 \
        else None
    return _finish(_Joined([handle], across), async_op)
@_timed(2)
def all_to_all(output: torch.Tensor, source: torch.Tensor, group: Group, async_op: bool = False):
    """Send part j of ``source`` (dim 0 cut into ``size`` equal parts) to group member j; part i
    of ``output`` receives member i's. Each rank sends (n-1)/n of ``source``, every part straight
    to its peer on NCCL and gloo alike (``direct``). Both must be contiguous."""
    if output.numel() != source.numel() or source.numel() % group.size:
        raise ValueError(f"all-to-all needs equal-size input and output cut into {group.size} "
                         f"parts, got {source.numel()} and {output.numel()} elements")
    group.ledger.record("all_to_all", group, source.numel(), source.dtype, "direct")
    if group.size == 1:
        output.copy_(source)
        return _Done() if async_op else None
    group.require_process_group()
    return dist.all_to_all_single(output, source, group=group.pg, async_op=async_op)


@_timed(4)
def all_to_all_v(output: torch.Tensor, source: torch.Tensor, output_split_sizes: list[int],
                 input_split_sizes: list[int], group: Group, async_op: bool = False):
    """All-to-all with variable split sizes along dim 0 (expert parallelism's token exchange,
    issue 32): rows ``input_split_sizes[j]`` of ``source`` (in member order) go to member j, and
    ``output`` receives ``output_split_sizes[i]`` rows from member i, in member order. The sizes
    must agree across ranks (exchange them first: :func:`exchange_counts`); nothing is padded.

    The ledger records op ``all_to_all_v`` with the bytes this rank really sends to its peers (its
    own rows stay local), and their cross-host part exactly (:meth:`CommLedger.record_sent`)."""
    n = group.size
    if len(input_split_sizes) != n or len(output_split_sizes) != n:
        raise ValueError(f"all-to-all-v needs {n} input and output split sizes, got "
                         f"{len(input_split_sizes)} and {len(output_split_sizes)}")
    if sum(input_split_sizes) != source.shape[0] or sum(output_split_sizes) != output.shape[0]:
        raise ValueError(f"all-to-all-v split sizes sum to {sum(input_split_sizes)} (input) and "
                         f"{sum(output_split_sizes)} (output) rows, but the tensors have "
                         f"{source.shape[0]} and {output.shape[0]}")
    row = math.prod(source.shape[1:])
    if math.prod(output.shape[1:]) != row:
        raise ValueError(f"all-to-all-v rows differ: {row} elements sent per row, "
                         f"{math.prod(output.shape[1:])} received")
    group.ledger.record_sent("all_to_all_v", group, source.numel(), source.dtype,
                             list(input_split_sizes), row)
    if n == 1:
        output.copy_(source)
        return _Done() if async_op else None
    group.require_process_group()
    return dist.all_to_all_single(output, source, output_split_sizes=list(output_split_sizes),
                                  input_split_sizes=list(input_split_sizes), group=group.pg,
                                  async_op=async_op)


def exchange_counts(send_counts: torch.Tensor, group: Group) -> torch.Tensor:
    """The counts exchange that precedes :func:`all_to_all_v`: ``send_counts`` is int64
    ``[size, c]`` (row j: what this rank will send member j); the result's row i is what member i
    will send this rank. A small equal-split all-to-all, recorded as op ``all_to_all`` of int64."""
    received = torch.empty_like(send_counts)
    all_to_all(received, send_counts.contiguous(), group)
    return received


@_timed(1)
def broadcast(tensor: torch.Tensor, group: Group, src_index: int = 0, async_op: bool = False):
    """Broadcast ``tensor`` from the group member with index ``src_index``."""
    algorithm = "direct" if group.pg is not None and _is_gloo(group) else "ring"
    group.ledger.record("broadcast", group, tensor.numel(), tensor.dtype, algorithm, src_index)
    if group.size == 1:
        return _Done() if async_op else None
    group.require_process_group()
    return dist.broadcast(tensor, src=group.ranks[src_index], group=group.pg, async_op=async_op)


@dataclass(frozen=True)
class P2POp:
    """One point-to-point transfer of :func:`p2p`: ``op`` is ``send`` or ``recv``, ``peer`` the
    index of the other rank in the group, ``tag`` tells messages between the same two ranks apart
    (gloo matches by it; NCCL matches in posting order, so both sides must post in the same order)."""

    op: str
    tensor: torch.Tensor
    peer: int
    tag: int = 0


@_timed(1)
def p2p(ops: list[P2POp], group: Group):
    """Post every send and receive of ``ops`` at once over ``group``; return a handle whose
    ``wait()`` completes them all (receives are then filled). Tensors must stay untouched until
    then; a receive tensor must be contiguous."""
    for o in ops:
        if o.op not in ("send", "recv"):
            raise ValueError(f"point-to-point op must be send or recv, got {o.op!r}")
        if o.peer == group.rank or not 0 <= o.peer < group.size:
            raise ValueError(f"peer {o.peer} is not another rank of this {group.kind} group of "
                             f"{group.size}")
        group.ledger.record(o.op, group, o.tensor.numel(), o.tensor.dtype, peer=o.peer)
    if not ops:
        return _Done()
    group.require_process_group()
    if not _is_gloo(group):
        batch = [dist.P2POp(dist.isend if o.op == "send" else dist.irecv, o.tensor,
                            group.ranks[o.peer], group.pg) for o in ops]
        return _Joined(dist.batch_isend_irecv(batch))
    works = []
    for o in ops:
        post = dist.isend if o.op == "send" else dist.irecv
        works.append(post(o.tensor, group.ranks[o.peer], group=group.pg, tag=o.tag))
    return _Joined(works)


@_timed(0)
def barrier(group: Group) -> None:
    if group.size > 1:
        dist.barrier(group=group.pg)


@contextlib.contextmanager
def unrecorded(group: Group):
    """Collectives inside are control traffic (flags, names), not training traffic: the ledger,
    which counts what ZeRO's volumes are about, does not record them."""
    enabled, group.ledger.enabled = group.ledger.enabled, False
    try:
        yield
    finally:
        group.ledger.enabled = enabled


@contextlib.contextmanager
def labelled(group: Group, category: str):
    """Collectives inside are recorded under ``category`` (an optimizer's own traffic beside
    ZeRO's, e.g. Muon's ``"muon"``), so the ledger tells them apart from the paper's volumes."""
    before, group.ledger.category = group.ledger.category, category
    try:
        yield
    finally:
        group.ledger.category = before


def max_over(group: Group, value: int, device: str | torch.device = "cpu") -> int:
    """The largest ``value`` of any rank of ``group`` (a control all-reduce, unrecorded)."""
    flag = torch.tensor([value], dtype=torch.int64, device=device)
    with unrecorded(group):
        all_reduce(flag, group, op="max")
    return int(flag.item())


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
