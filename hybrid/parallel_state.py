"""The explicit parallel state: world, TP, CP, DP and PP process groups of one rank (docs/design.md §1).

With context parallelism (``Topology.cp`` > 1, issue 31) it holds the rank's CP group ``cp`` (the
ranks that share the sequences of its samples; ledger kind "cp") and ``dp_cp``, the DP x CP ranks
with its TP and PP coordinates: the group gradients are reduced and ZeRO partitions built over
(ledger kind "dp_cp", counted as DP traffic). At CP 1 ``cp`` is this rank alone and ``dp_cp`` is the
DP group itself (the same object), so nothing changes.

With pipeline parallelism (``Topology.pipeline_parallel_size`` > 1) it also holds the rank's PP group
(its position in every stage, stage order: the point-to-point peers), its embedding group (first and
last stage: the tied word embedding's two users) and its model-parallel group (every TP rank of every
stage of its DP replica). At PP 1 these are single-rank groups and ``mp`` is the TP group itself.

Built from a pure :class:`~hybrid.topology.Topology` inside a torchrun or ``torch.multiprocessing``
job and passed to every layer, optimizer and checkpoint that communicates. There are no module-level
groups: two states can coexist in one process (tests do this). Entry points build it with
:meth:`ParallelState.from_launch_env` from the launcher's environment (:mod:`hybrid.launch_env`).

The DP group's transport is chosen here, once, by ``dp_transport``: ``auto`` (shared memory where
the group's ranks are CPU processes of one host that can all map it, gloo otherwise), ``shm``
(shared memory or an error saying why not) or ``gloo`` (:mod:`hybrid.shm_collectives`). The ZeRO
engines only size it (:func:`hybrid.comm.reserve_transport`).

Hybrid sharding and ZeRO++ hpZ split each DP group by host (:meth:`Topology.dp_host_groups`):
``dp_intra_host_group`` holds the DP ranks of this rank's DP group on its host, ``dp_inter_host_group``
the ranks at the same position on the other hosts. They are built here with the other groups (a
DP group on one host reuses its process group: intra is the DP group, inter this rank alone), so
every user gets the same ones; where the hosts hold unequal shares of a DP group both are None and
:meth:`ParallelState.require_host_groups` says why.

Expert parallelism (issue 32, :meth:`Topology.ep_groups`): ``ep`` is the rank's EP group (the ranks
that hold different experts of each MoE layer and exchange tokens by all-to-all; ledger kind ``ep``)
and ``expert_dp`` its expert-DP group (the DP x CP / EP ranks holding the same experts, over which expert
gradients are reduced and partitioned; ledger kind ``expert_dp``). At EP 1 ``ep`` is this rank alone
and ``expert_dp`` is the DP x CP group itself (the DP group at CP 1: same process group, same
transport, same ledger kind). Hybrid sharding and hpZ split the expert-DP groups by host too
(:meth:`Topology.expert_dp_host_groups`; :meth:`ParallelState.require_expert_host_groups`): a
group already on one host, or with one rank per host, reuses the expert-DP group (no new process
group).

``ParallelState.single_process()`` needs no process group at all; its groups have size 1 and every
collective degenerates to a local copy.
"""

from __future__ import annotations

import logging
from datetime import timedelta

import torch
import torch.distributed as dist

from hybrid.comm import CommLedger, Group
from hybrid.launch_env import LaunchEnv, LaunchEnvError
from hybrid.shm_collectives import ShmTransport
from hybrid.topology import DEFAULT_TIMEOUT, DP_TRANSPORTS, Topology

log = logging.getLogger(__name__)


class ParallelState:
    def __init__(self, topology: Topology, rank: int, world: Group, tp: Group, dp: Group,
                 device: torch.device, ledger: CommLedger, *, pp: Group | None = None,
                 embedding: Group | None = None, mp: Group | None = None,
                 host_groups: tuple[Group, Group] | None = None,
                 host_split_problem: str | None = None, cp: Group | None = None,
                 dp_cp: Group | None = None, ep: Group | None = None,
                 expert_dp: Group | None = None,
                 expert_host_groups: tuple[Group, Group] | None = None,
                 expert_host_problem: str | None = None):
        self.topology = topology
        self.rank = rank
        self.world = world
        self.tp = tp
        self.dp = dp
        self.cp = cp if cp is not None else Group("cp", [rank], 0, ledger)
        self.dp_cp = dp_cp if dp_cp is not None else dp
        self.device = device
        self.ledger = ledger
        self.pp = pp if pp is not None else Group("pp", [rank], 0, ledger)
        self.embedding = embedding if embedding is not None else Group("embedding", [rank], 0, ledger)
        self.mp = mp if mp is not None else tp
        self.ep = ep if ep is not None else Group("ep", [rank], 0, ledger)
        self.expert_dp = expert_dp if expert_dp is not None else self.dp_cp   # EP 1: DP x CP
        self._host_split_problem = host_split_problem   # the topology's reason there are none
        if host_split_problem is not None:
            self.dp_intra_host_group = self.dp_inter_host_group = None
        else:
            self.dp_intra_host_group, self.dp_inter_host_group = (
                host_groups if host_groups is not None else _one_host_groups(dp, ledger))
        # the expert-DP groups split by host (EP > 1; at EP 1 the expert-DP group is DP x CP,
        # whose split is the one above at CP 1)
        self._expert_host_problem = expert_host_problem
        self._expert_host_groups = expert_host_groups

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
        ledger = CommLedger(ranks_per_node=topology.gpus_per_node)
        c = topology.coords(rank)
        world = Group("world", list(range(topology.world_size)), rank, ledger)
        tp = Group("tp", topology.tp_group_of(rank), c.tp_rank, ledger)
        dp = Group("dp", topology.dp_group_of(rank), c.dp_rank, ledger)
        pp = Group("pp", topology.pp_group_of(rank), c.pp_rank, ledger)
        emb_ranks = topology.embedding_group_of(rank)
        embedding = Group("embedding", emb_ranks, emb_ranks.index(rank), ledger)
        mp_ranks = topology.mp_group_of(rank)
        mp = (Group("mp", mp_ranks, mp_ranks.index(rank), ledger)
              if topology.pp_size > 1 else tp)
        cp = Group("cp", topology.cp_group_of(rank), c.cp_rank, ledger)
        dp_cp = dp
        if topology.cp_size > 1:
            dp_cp_ranks = topology.dp_cp_group_of(rank)
            dp_cp = Group(DP_CP, dp_cp_ranks, dp_cp_ranks.index(rank), ledger)
        problem, host_groups = topology.dp_host_split_problem(), None
        if problem is None:
            intra, inter = (topology.dp_intra_host_group_of(rank), topology.dp_inter_host_group_of(rank))
            host_groups = (Group(INTRA, intra, intra.index(rank), ledger),
                           Group(INTER, inter, inter.index(rank), ledger))
        ep = expert_dp = expert_hosts = None
        expert_problem = topology.expert_dp_host_split_problem() if topology.ep_size > 1 else None
        if topology.ep_size > 1:
            ep_ranks, edp_ranks = topology.ep_group_of(rank), topology.expert_dp_group_of(rank)
            ep_rank, expert_dp_rank = topology.expert_coords(rank)
            ep = Group("ep", ep_ranks, ep_rank, ledger)
            expert_dp = Group("expert_dp", edp_ranks, expert_dp_rank, ledger)
            if expert_problem is None:
                intra_all, inter_all = topology.expert_dp_host_groups()
                intra = next(g for g in intra_all if rank in g)
                inter = next(g for g in inter_all if rank in g)
                expert_hosts = (Group(EXPERT_INTRA, intra, intra.index(rank), ledger),
                                Group(EXPERT_INTER, inter, inter.index(rank), ledger))
        return cls(topology, rank, world, tp, dp, torch.device("meta"), ledger, pp=pp,
                   embedding=embedding, mp=mp, host_groups=host_groups, host_split_problem=problem,
                   cp=cp, dp_cp=dp_cp, ep=ep, expert_dp=expert_dp,
                   expert_host_groups=expert_hosts, expert_host_problem=expert_problem)

    @classmethod
    def from_launch_env(cls, env: LaunchEnv, *, tensor_parallel_size: int = 1,
                        pipeline_parallel_size: int = 1, context_parallel_size: int = 1,
                        expert_model_parallel_size: int = 1,
                        gpus_per_node: int | None = None, allow_tp_across_nodes: bool = False,
                        timeout: timedelta = DEFAULT_TIMEOUT, dp_transport: str = "auto",
                        device: str | torch.device | None = None) -> "ParallelState":
        """The one constructor of entry points: one process when the launcher started none
        (``env`` not distributed), else join the job and create its TP, DP and PP groups. A node holds
        the launcher's ``LOCAL_WORLD_SIZE`` ranks, else ``gpus_per_node``, else the whole world."""
        if not env.distributed:
            for name, size in (("pipeline-model-parallel", pipeline_parallel_size),
                               ("context-parallel", context_parallel_size),
                               ("expert-model-parallel", expert_model_parallel_size)):
                if size > 1:
                    raise ValueError(f"{name} size {size} needs as many ranks at least; launch "
                                     f"with torchrun")
            return cls.single_process(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        per_node = env.local_world_size or gpus_per_node or env.world_size
        topology = Topology(env.world_size, tensor_parallel_size, gpus_per_node=per_node,
                            allow_tp_across_nodes=allow_tp_across_nodes,
                            pipeline_parallel_size=pipeline_parallel_size, cp=context_parallel_size,
                            expert_model_parallel_size=expert_model_parallel_size)
        return cls.initialize(topology, env=env, timeout=timeout, dp_transport=dp_transport,
                              device=device)

    @classmethod
    def initialize(cls, topology: Topology, *, env: LaunchEnv | None = None,
                   backend: str | None = None, init_method: str | None = None,
                   timeout: timedelta = DEFAULT_TIMEOUT, dp_transport: str = "auto",
                   device: str | torch.device | None = None) -> "ParallelState":
        """Join (or reuse) the default process group and create every TP, DP and PP group (and,
        with PP > 1, the embedding and model-parallel groups).

        Joining needs ``env`` (this rank, the store; default: parsed from the environment).
        ``backend`` defaults to the backend of an already joined default group, else NCCL when CUDA
        is available and gloo otherwise; every group gets ``timeout``; ``dp_transport`` picks the DP
        group's transport (module docstring).
        """
        if backend is None and dist.is_initialized():   # a gloo job on a GPU machine keeps gloo
            backend = dist.get_backend()                  # (and CPU tensors) for its subgroups
        if dp_transport not in DP_TRANSPORTS:
            raise ValueError(f"dp_transport must be one of {', '.join(DP_TRANSPORTS)}, got "
                             f"{dp_transport!r}")
        if backend is None:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        if not dist.is_initialized():
            env = env if env is not None else LaunchEnv.from_environ()
            if init_method is None and (env.master_addr is None or env.master_port is None):
                raise LaunchEnvError(f"{env.world_size} ranks without MASTER_ADDR and MASTER_PORT: "
                                     f"they have nowhere to meet; launch with torchrun, or set both")
            store = _restart_store(init_method, env, topology.world_size, timeout)
            dist.init_process_group(backend, init_method=None if store else init_method,
                                    store=store, rank=env.rank, world_size=topology.world_size,
                                    timeout=timeout)
        rank = dist.get_rank()
        if dist.get_world_size() != topology.world_size:
            raise ValueError(f"the job has {dist.get_world_size()} ranks but the topology describes "
                             f"{topology.world_size}; launch with --nproc-per-node x --nnodes = "
                             f"{topology.world_size}")
        device = concrete_device(device) if device is not None else _default_device(backend, env)
        ledger = CommLedger(ranks_per_node=topology.gpus_per_node)
        world = Group("world", list(range(topology.world_size)), rank, ledger, dist.group.WORLD)
        tp = _make_groups("tp", topology.tp_groups(), rank, ledger, backend, timeout)
        dp = _make_groups("dp", topology.dp_groups(), rank, ledger, backend, timeout)
        dp.shm = _dp_shared_memory(dp, dp_transport, device, timeout)
        pp = _make_groups("pp", topology.pp_groups(), rank, ledger, backend, timeout)
        embedding = _make_groups("embedding", topology.embedding_groups(), rank, ledger, backend,
                                 timeout, member_of_all=False)
        mp = (_make_groups("mp", topology.mp_groups(), rank, ledger, backend, timeout)
              if topology.pp_size > 1 else tp)
        cp, dp_cp = Group("cp", [rank], 0, ledger), dp
        if topology.cp_size > 1:   # ring / all-to-all traffic (gloo, or NCCL on GPUs)
            cp = _make_groups("cp", topology.cp_groups(), rank, ledger, backend, timeout)
            dp_cp = _make_groups(DP_CP, topology.dp_cp_groups(), rank, ledger, backend, timeout)
            dp_cp.shm = _dp_shared_memory(dp_cp, dp_transport, device, timeout)
        problem = topology.dp_host_split_problem()
        host_groups = None if problem is not None else _make_host_groups(
            topology, rank, dp, ledger, backend, timeout, dp_transport, device)
        ep = expert_dp = expert_hosts = None
        expert_problem = topology.expert_dp_host_split_problem() if topology.ep_size > 1 else None
        if topology.ep_size > 1:   # EP 1: ep is this rank alone, expert_dp the DP group (__init__)
            ep = _make_groups("ep", topology.ep_groups(), rank, ledger, backend, timeout)
            expert_dp = _make_groups("expert_dp", topology.expert_dp_groups(), rank, ledger,
                                     backend, timeout)
            expert_dp.shm = _dp_shared_memory(expert_dp, "gloo" if dp_transport == "gloo" else "auto",
                                              device, timeout)
            if expert_problem is None:
                expert_hosts = _make_expert_host_groups(topology, rank, expert_dp, ledger, backend,
                                                        timeout)
        log.debug("rank %d: %s", rank, topology.describe())
        return cls(topology, rank, world, tp, dp, device, ledger, pp=pp, embedding=embedding, mp=mp,
                   host_groups=host_groups, host_split_problem=problem, cp=cp, dp_cp=dp_cp,
                   ep=ep, expert_dp=expert_dp, expert_host_groups=expert_hosts,
                   expert_host_problem=expert_problem)

    def require_host_groups(self, option: str) -> tuple[Group, Group]:
        """(intra-host, inter-host) DP groups for ``option``, or a ValueError saying why the layout
        has none."""
        if self.dp_intra_host_group is None:
            raise ValueError(f"{option} splits every DP group by host, but "
                             f"{self._host_split_problem}; choose a layout whose DP groups have "
                             f"as many ranks on every host")
        return self.dp_intra_host_group, self.dp_inter_host_group

    def require_expert_host_groups(self, option: str) -> tuple[Group, Group]:
        """(intra-host, inter-host) expert-DP groups for ``option`` (the expert parameters' class
        under hybrid sharding or hpZ), or a ValueError saying why there are none. At EP 1 the
        expert-DP group is the DP group: its split is :meth:`require_host_groups`'."""
        if self.expert_dp is self.dp_cp:
            return self.require_host_groups(option)
        if self._expert_host_groups is None:
            raise ValueError(f"{option} splits every expert-DP group by host, but "
                             f"{self._expert_host_problem or 'this state has no such split'}; "
                             f"choose a layout whose expert-DP groups have as many ranks on "
                             f"every host")
        return self._expert_host_groups

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

    @property
    def cp_rank(self) -> int:
        return self.cp.rank

    @property
    def cp_size(self) -> int:
        return self.cp.size

    @property
    def pp_rank(self) -> int:
        return self.pp.rank

    @property
    def pp_size(self) -> int:
        return self.pp.size

    @property
    def ep_rank(self) -> int:
        return self.ep.rank

    @property
    def ep_size(self) -> int:
        return self.ep.size

    @property
    def is_first_stage(self) -> bool:
        return self.pp.rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp.rank == self.pp.size - 1

    def __repr__(self) -> str:
        return (f"ParallelState(rank={self.rank}/{self.world_size}, tp={self.tp_rank}/{self.tp_size}, "
                f"dp={self.dp_rank}/{self.dp_size}, "
                + (f"cp={self.cp_rank}/{self.cp_size}, " if self.cp_size > 1 else "")
                + (f"pp={self.pp_rank}/{self.pp_size}, " if self.pp_size > 1 else "")
                + (f"ep={self.ep_rank}/{self.ep_size}, " if self.ep_size > 1 else "")
                + f"device={self.device})")


def _restart_store(init_method: str | None, env: LaunchEnv, world_size: int, timeout: timedelta):
    """Under ``torchrun --max-restarts``, a restarted job meets in the same rendezvous store as the
    attempt before it, and gloo could read a dead peer's address left there (connectFullMesh:
    connection refused). Each attempt gets its own key prefix; None outside a restart."""
    if init_method is not None or env.restart_count == 0 or env.master_addr is None:
        return None
    store, _, _ = next(dist.rendezvous("env://", env.rank, world_size, timeout=timeout))
    return dist.PrefixStore(f"hybrid-attempt-{env.restart_count}", store)


def _dp_shared_memory(dp: Group, transport: str, device: torch.device,
                      timeout: timedelta) -> ShmTransport | None:
    """The DP group's shared-memory transport, or None for the backend's own collectives.
    Collective over ``dp`` (every rank decides the same)."""
    if transport == "gloo" or dp.size < 2 or device.type != "cpu" or dist.get_backend(dp.pg) != "gloo":
        if transport == "shm" and dp.size > 1:
            raise ValueError("--dp-transport shm needs CPU ranks on gloo (it is the CPU path; "
                             "NCCL has its own); use --dp-transport auto")
        return None
    return ShmTransport.create(dp, timeout, required=transport == "shm")


INTRA, INTER = "dp_intra_host", "dp_inter_host"   # ledger kinds of the host-split DP groups
EXPERT_INTRA, EXPERT_INTER = "expert_dp_intra_host", "expert_dp_inter_host"   # their expert-DP peers
DP_CP = "dp_cp"   # ledger kind of the DP x CP group (CP > 1); the trainer counts it as DP traffic


def _one_host_groups(dp: Group, ledger: CommLedger) -> tuple[Group, Group]:
    """A DP group on one host: the intra-host group is the DP group itself (same process group and
    transport), the inter-host group this rank alone."""
    intra = Group(INTRA, dp.ranks, dp.rank, ledger, dp.pg, dp.timeout, shm=dp.shm)
    return intra, Group(INTER, [dp.ranks[dp.rank]], 0, ledger)


def _make_host_groups(topology: Topology, rank: int, dp: Group, ledger: CommLedger, backend: str,
                      timeout: timedelta, dp_transport: str, device: torch.device
                      ) -> tuple[Group, Group]:
    """This rank's intra- and inter-host DP groups (every rank takes part in creating them).
    Intra-host groups of CPU ranks get shared memory as the DP group would (``dp_transport``
    ``shm`` is only required of the whole DP group)."""
    if all(len(topology.nodes_of(g)) == 1 for g in topology.dp_groups()):   # no new groups
        return _one_host_groups(dp, ledger)
    intra_all, inter_all = topology.dp_host_groups()
    intra = _make_groups(INTRA, intra_all, rank, ledger, backend, timeout)
    intra.shm = _dp_shared_memory(intra, "gloo" if dp_transport == "gloo" else "auto", device,
                                  timeout)
    inter = _make_groups(INTER, inter_all, rank, ledger, backend, timeout)
    return intra, inter


def _make_expert_host_groups(topology: Topology, rank: int, expert_dp: Group, ledger: CommLedger,
                             backend: str, timeout: timedelta) -> tuple[Group, Group]:
    """This rank's intra- and inter-host expert-DP groups (every rank takes part). A split with
    one part reuses the expert-DP group's process group (every group on one host: intra is it;
    one rank per host: inter is it)."""
    intra_all, inter_all = topology.expert_dp_host_groups()
    kinds = (EXPERT_INTRA, EXPERT_INTER)
    reused = [Group(kind, expert_dp.ranks, expert_dp.rank, ledger, expert_dp.pg, expert_dp.timeout,
                    shm=expert_dp.shm) for kind in kinds]
    alone = [Group(kind, [rank], 0, ledger) for kind in kinds]
    if all(len(g) == 1 for g in inter_all):   # every expert-DP group on one host
        return reused[0], alone[1]
    if all(len(g) == 1 for g in intra_all):   # one rank of each expert-DP group per host
        return alone[0], reused[1]
    return (_make_groups(EXPERT_INTRA, intra_all, rank, ledger, backend, timeout),
            _make_groups(EXPERT_INTER, inter_all, rank, ledger, backend, timeout))


def _make_groups(kind: str, all_groups: list[list[int]], rank: int, ledger: CommLedger,
                 backend: str, timeout: timedelta, member_of_all: bool = True) -> Group:
    """Create every group of one kind (all ranks must take part) and return this rank's; without
    ``member_of_all`` a rank in none of them (a middle pipeline stage for the embedding group)
    gets a group of itself alone."""
    mine = None if member_of_all else Group(kind, [rank], 0, ledger)
    for ranks in all_groups:
        pg = dist.new_group(ranks, timeout=timeout, backend=backend) if len(ranks) > 1 else None
        if rank in ranks:
            mine = Group(kind, ranks, ranks.index(rank), ledger, pg, timeout)
    assert mine is not None, f"rank {rank} is in no {kind} group"
    return mine


def _default_device(backend: str, env: LaunchEnv | None) -> torch.device:
    if backend == "nccl":
        local = env.local_rank if env is not None else dist.get_rank() % max(torch.cuda.device_count(), 1)
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
