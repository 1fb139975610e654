"""The explicit parallel state: world, TP and DP process groups of one rank (docs/design.md §1).

Built from a pure :class:`~hybrid.topology.Topology` inside a torchrun or ``torch.multiprocessing``
job and passed to every layer, optimizer and checkpoint that communicates. There are no module-level
groups: two states can coexist in one process (tests do this).

``ParallelState.single_process()`` needs no process group at all; its groups have size 1 and every
collective degenerates to a local copy.
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from hybrid.comm import CommLedger, Group
from hybrid.topology import Topology

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT = timedelta(minutes=10)


class ParallelState:
    def __init__(self, topology: Topology, rank: int, world: Group, tp: Group, dp: Group,
                 device: torch.device, ledger: CommLedger):
        self.topology = topology
        self.rank = rank
        self.world = world
        self.tp = tp
        self.dp = dp
        self.device = device
        self.ledger = ledger

    # ---- construction ----------------------------------------------------------------------
    @classmethod
    def single_process(cls, device: str | torch.device = "cpu") -> "ParallelState":
        ledger = CommLedger()
        groups = [Group(kind, [0], 0, ledger) for kind in ("world", "tp", "dp")]
        return cls(Topology(1, 1, 1), 0, *groups, concrete_device(device), ledger)

    @classmethod
    def dry_run(cls, topology: Topology, rank: int = 0) -> "ParallelState":
        """The state of ``rank`` in ``topology`` without any process group, for meta-device dry runs
        of many-GPU layouts on one machine. Shapes are right; any collective raises."""
        ledger = CommLedger()
        c = topology.coords(rank)
        world = Group("world", list(range(topology.world_size)), rank, ledger)
        tp = Group("tp", topology.tp_group_of(rank), c.tp_rank, ledger)
        dp = Group("dp", topology.dp_group_of(rank), c.dp_rank, ledger)
        return cls(topology, rank, world, tp, dp, torch.device("meta"), ledger)

    @classmethod
    def initialize(cls, topology: Topology, *, rank: int | None = None, backend: str | None = None,
                   init_method: str | None = None, timeout: timedelta = DEFAULT_TIMEOUT,
                   device: str | torch.device | None = None) -> "ParallelState":
        """Join (or reuse) the default process group and create every TP and DP group.

        Under torchrun, rank and world size come from the environment. ``backend`` defaults to the
        backend of an already joined default group, else NCCL when CUDA is available and gloo
        otherwise; every group gets ``timeout``.
        """
        if backend is None and dist.is_initialized():   # a gloo job on a GPU machine keeps gloo
            backend = dist.get_backend()                  # (and CPU tensors) for its subgroups
        if backend is None:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        if not dist.is_initialized():
            rank = int(os.environ.get("RANK", 0)) if rank is None else rank
            store = _restart_store(init_method, rank, topology.world_size, timeout)
            dist.init_process_group(backend, init_method=None if store else init_method,
                                    store=store, rank=rank, world_size=topology.world_size,
                                    timeout=timeout)
        rank = dist.get_rank()
        if dist.get_world_size() != topology.world_size:
            raise ValueError(f"the job has {dist.get_world_size()} ranks but the topology describes "
                             f"{topology.world_size}; launch with --nproc-per-node x --nnodes = "
                             f"{topology.world_size}")
        device = concrete_device(device) if device is not None else _default_device(backend)
        ledger = CommLedger()
        world = Group("world", list(range(topology.world_size)), rank, ledger, dist.group.WORLD)
        tp = _make_groups("tp", topology.tp_groups(), rank, ledger, backend, timeout)
        dp = _make_groups("dp", topology.dp_groups(), rank, ledger, backend, timeout)
        log.debug("rank %d: %s", rank, topology.describe())
        return cls(topology, rank, world, tp, dp, device, ledger)

    def destroy(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    # ---- coordinates -----------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.world.size

    @property
    def tp_rank(self) -> int:
        return self.tp.rank

    @property
    def tp_size(self) -> int:
        return self.tp.size

    @property
    def dp_rank(self) -> int:
        return self.dp.rank

    @property
    def dp_size(self) -> int:
        return self.dp.size

    def __repr__(self) -> str:
        return (f"ParallelState(rank={self.rank}/{self.world_size}, tp={self.tp_rank}/{self.tp_size}, "
                f"dp={self.dp_rank}/{self.dp_size}, device={self.device})")


def _restart_store(init_method: str | None, rank: int, world_size: int, timeout: timedelta):
    """Under ``torchrun --max-restarts``, a restarted job meets in the same rendezvous store as the
    attempt before it, and gloo could read a dead peer's address left there (connectFullMesh:
    connection refused). Each attempt gets its own key prefix; None outside a restart."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if init_method is not None or attempt in (None, "0") or "MASTER_ADDR" not in os.environ:
        return None
    store, _, _ = next(dist.rendezvous("env://", rank, world_size, timeout=timeout))
    return dist.PrefixStore(f"hybrid-attempt-{attempt}", store)


def _make_groups(kind: str, all_groups: list[list[int]], rank: int, ledger: CommLedger,
                 backend: str, timeout: timedelta) -> Group:
    """Create every group of one kind (all ranks must take part) and return this rank's."""
    mine = None
    for ranks in all_groups:
        pg = dist.new_group(ranks, timeout=timeout, backend=backend) if len(ranks) > 1 else None
        if rank in ranks:
            mine = Group(kind, ranks, ranks.index(rank), ledger, pg, timeout)
    assert mine is not None, f"rank {rank} is in no {kind} group"
    return mine


def _default_device(backend: str) -> torch.device:
    if backend == "nccl":
        local = int(os.environ.get("LOCAL_RANK", dist.get_rank() % max(torch.cuda.device_count(), 1)))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def concrete_device(device: str | torch.device) -> torch.device:
    """``device`` with its index: ``cuda`` becomes ``cuda:<current device>``, since tensors report
    ``cuda:N`` and ``torch.device("cuda") != torch.device("cuda", 0)`` (arenas and meters compare)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device
