"""Pure rank topology of a hybrid TP x CP x DP x PP job (Megatron-LM §3 "model + data parallel";
ZeRO §7; pipeline stages: Narayanan et al. 2021 §2.2, §3.2; context parallelism: issue 31).

A :class:`Topology` maps every global rank to its node, its local index on the node, its tensor
parallel (TP) rank, its context-parallel (CP) rank, its data-parallel (DP) rank and its pipeline
(PP) stage, with no torch.distributed involved, so a 400-GPU DGX-2 layout can be checked on a laptop.

Rank order (docs/design.md §2): TP varies fastest, then CP, then DP, then PP (Megatron's order).
The rank grid is ``arange(world).view(pp, dp, cp, tp)`` (:attr:`Topology.grid4d`); with CP 1 and
PP 1 (the defaults) it is ``view(dp, tp)``:

    world 8, tp 2, 4 GPUs per node
        node 0: ranks 0 1 | 2 3        TP groups: [0,1] [2,3] [4,5] [6,7]   (adjacent, inside a node)
        node 1: ranks 4 5 | 6 7        DP groups: [0,2,4,6] [1,3,5,7]       (strided, across nodes)

A TP group that is larger than a node (Megatron's 384-GPU baseline with TP 128) crosses nodes; it is
only accepted with ``allow_tp_across_nodes=True`` and is reported by :attr:`tp_crosses_nodes`, since
its all-reduces then run over InfiniBand instead of NVSwitch.

With PP > 1 each stage is a contiguous block of ``world / pp`` ranks (whole nodes in a real
layout), so the point-to-point traffic between stages crosses nodes while TP stays inside one.
A PP group is one (dp, cp, tp) column through the stages; the embedding group of a column is its
first and last stage, which hold the two uses of the tied word embedding.

With CP > 1 (``cp=C``) the C ranks of a CP group hold the same TP shard of the same samples, each
a 1/C part of every sequence (hybrid.context_parallel.layout); they follow each other at stride TP:

    world 8, tp 2, cp 2 (dp 2)         TP groups: [0,1] [2,3] [4,5] [6,7]
                                       CP groups: [0,2] [1,3] [4,6] [5,7]
                                       DP groups: [0,4] [1,5] [2,6] [3,7]
                                       DP x CP groups: [0,2,4,6] [1,3,5,7]

Gradients are reduced and ZeRO partitions built over DP x CP (:meth:`Topology.dp_cp_groups`), since
a CP rank's gradients cover only its tokens; the data sampler still reads by DP rank (the CP ranks of
a DP rank read the same samples). A model-parallel group is TP x PP of one (dp, cp) position.

Expert parallelism (issue 32; Megatron-Core's layout) is carved out of DP x CP: inside every DP x CP
group (one stage, one TP rank), each run of ``ep`` consecutive DP x CP ranks is an EP group (its ranks
hold different experts and exchange tokens by all-to-all), and the ranks with the same EP index form
an expert-DP group of ``dp cp / ep`` ranks (they hold the same experts and reduce their gradients):

    world 8, tp 2, ep 2       DP groups: [0,2,4,6] [1,3,5,7]
        EP groups:         [0,2] [4,6] [1,3] [5,7]
        expert-DP groups:  [0,4] [2,6] [1,5] [3,7]
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from functools import cached_property
from typing import TYPE_CHECKING

if TYPE_CHECKING:   # torch is imported by the grid only: a launcher checks a layout without it
    import torch


class TopologyError(ValueError):
    """An invalid parallel layout; the message says what to change."""


# The process groups' defaults (hybrid.parallel_state builds them; the application's flags read
# these before torch is loaded): the collective timeout, and how DP collectives move their bytes.
DEFAULT_TIMEOUT = timedelta(minutes=10)
DP_TRANSPORTS = ("auto", "shm", "gloo")

@dataclass(frozen=True)
class RankCoords:
    rank: int
    node: int
    local_rank: int
    tp_rank: int
    dp_rank: int
    pp_rank: int = 0
    cp_rank: int = 0


@dataclass(frozen=True)
class Topology:
    world_size: int
    tensor_parallel_size: int = 1
    gpus_per_node: int = 16
    allow_tp_across_nodes: bool = False
    pipeline_parallel_size: int = 1
    cp: int = 1                   # context-parallel size (--context-parallel-size)
    expert_model_parallel_size: int = 1   # EP, carved out of DP x CP (module docstring)

    def __post_init__(self) -> None:
        world, tp, per_node = self.world_size, self.tensor_parallel_size, self.gpus_per_node
        pp, cp = self.pipeline_parallel_size, self.cp
        for name, value in (("world size", world), ("tensor-model-parallel size", tp),
                            ("GPUs per node", per_node), ("pipeline-model-parallel size", pp),
                            ("context-parallel size", cp)):
            if not isinstance(value, int) or value < 1:
                raise TopologyError(f"{name} must be a positive integer, got {value!r}")
        if cp > 1 and world % (tp * cp * pp):
            raise TopologyError(
                f"world size {world} is not divisible by tensor-model-parallel size {tp} x "
                f"context-parallel size {cp} x pipeline-model-parallel size {pp} = "
                f"{tp * cp * pp}; choose degrees whose product divides {world}")
        if world % (tp * pp):
            raise TopologyError(
                f"world size {world} is not divisible by tensor-model-parallel size {tp} x "
                f"pipeline-model-parallel size {pp} = {tp * pp}; choose degrees whose product "
                f"divides {world}")
        if world % tp:
            raise TopologyError(
                f"world size {world} is not divisible by tensor-model-parallel size {tp}; "
                f"choose a TP degree that divides {world} (e.g. {_largest_divisor_at_most(world, tp)})")
        if world > per_node and world % per_node:
            raise TopologyError(
                f"world size {world} is not a whole number of nodes of {per_node} GPUs; "
                f"use a multiple of {per_node} ranks or set GPUs per node to match the machines")
        if tp <= per_node and per_node % tp and world > tp:
            raise TopologyError(
                f"tensor-model-parallel size {tp} does not divide the {per_node} GPUs of a node, so "
                f"TP groups would straddle nodes; use a TP degree that divides {per_node}")
        if tp > per_node:
            if tp % per_node:
                raise TopologyError(
                    f"tensor-model-parallel size {tp} spans nodes of {per_node} GPUs unevenly; "
                    f"use a multiple of {per_node}")
            if not self.allow_tp_across_nodes:
                raise TopologyError(
                    f"tensor-model-parallel size {tp} is larger than a node ({per_node} GPUs): its "
                    f"all-reduces would cross the inter-node network; lower TP to at most {per_node} "
                    f"or opt in with --allow-tp-across-nodes")
        ep = self.expert_model_parallel_size
        if not isinstance(ep, int) or ep < 1:
            raise TopologyError(f"expert-model-parallel size must be a positive integer, got {ep!r}")
        if self.dp_cp_size % ep:
            raise TopologyError(
                f"expert-model-parallel size {ep} does not divide the data-parallel x "
                f"context-parallel size {self.dp_cp_size} (EP groups are carved out of it); choose "
                f"an EP degree that divides {self.dp_cp_size} "
                f"(e.g. {_largest_divisor_at_most(self.dp_cp_size, ep)}) or add ranks")

    # ---- sizes -----------------------------------------------------------------------------
    @property
    def tp_size(self) -> int:
        return self.tensor_parallel_size

    @property
    def dp_size(self) -> int:
        return self.world_size // (self.tensor_parallel_size * self.cp * self.pipeline_parallel_size)

    @property
    def cp_size(self) -> int:
        return self.cp

    @property
    def dp_cp_size(self) -> int:
        """Ranks that gradients are reduced and ZeRO partitions built over: DP x CP."""
        return self.dp_size * self.cp

    @property
    def pp_size(self) -> int:
        return self.pipeline_parallel_size

    @property
    def ep_size(self) -> int:
        return self.expert_model_parallel_size

    @property
    def expert_dp_size(self) -> int:
        """Ranks holding the same experts: DP x CP / EP (their gradients are reduced over it)."""
        return self.dp_cp_size // self.expert_model_parallel_size

    @property
    def num_nodes(self) -> int:
        return -(-self.world_size // self.gpus_per_node)

    @property
    def tp_crosses_nodes(self) -> bool:
        """True when a TP group spans more than one node (its traffic leaves NVSwitch)."""
        return any(len(self.nodes_of(group)) > 1 for group in self.tp_groups())

    # ---- the rank grid ---------------------------------------------------------------------
    @cached_property
    def grid(self) -> torch.Tensor:
        """``grid[dp_cp_rank, tp_rank]`` is the global rank: ``arange(world).view(dp, tp)`` of the
        first pipeline stage (the whole world at PP 1, CP 1); :attr:`grid3d` holds every stage."""
        return self.grid3d[0]

    @cached_property
    def grid3d(self) -> torch.Tensor:
        """``grid3d[pp_rank, dp_cp_rank, tp_rank]`` is the global rank: ``arange(world).view(pp,
        dp x cp, tp)`` (``dp_cp_rank = dp_rank x cp + cp_rank``; at CP 1 the DP rank)."""
        return self.grid4d.reshape(self.pp_size, self.dp_size * self.cp, self.tp_size)

    @cached_property
    def grid4d(self) -> torch.Tensor:
        """``grid4d[pp_rank, dp_rank, cp_rank, tp_rank]`` is the global rank:
        ``arange(world).view(pp, dp, cp, tp)`` (TP fastest, then CP, DP, PP)."""
        import torch
        return torch.arange(self.world_size).view(self.pipeline_parallel_size, self.dp_size,
                                                  self.cp, self.tensor_parallel_size)

    # ---- coordinates -----------------------------------------------------------------------
    def coords(self, rank: int) -> RankCoords:
        if not 0 <= rank < self.world_size:
            raise TopologyError(f"rank {rank} is outside the world of {self.world_size} ranks")
        rest, tp_rank = divmod(rank, self.tp_size)            # where it sits in grid4d
        rest, cp_rank = divmod(rest, self.cp)
        pp_rank, dp_rank = divmod(rest, self.dp_size)
        node, local_rank = divmod(rank, self.gpus_per_node)
        return RankCoords(rank, node, local_rank, tp_rank, dp_rank, pp_rank, cp_rank)

    def rank_of(self, tp_rank: int, dp_rank: int, pp_rank: int = 0, cp_rank: int = 0) -> int:
        return int(self.grid4d[pp_rank, dp_rank, cp_rank, tp_rank])

    # ---- groups ----------------------------------------------------------------------------
    def tp_groups(self) -> list[list[int]]:
        """Rows of the grid: one group per (stage, DP replica, CP rank), adjacent ranks."""
        return self.grid4d.reshape(-1, self.tp_size).tolist()

    def cp_groups(self) -> list[list[int]]:
        """One group per (stage, DP rank, TP rank): the CP ranks of that position, strided by the
        TP degree (adjacent at TP 1)."""
        return self.grid4d.permute(0, 1, 3, 2).reshape(-1, self.cp).tolist()

    def dp_groups(self) -> list[list[int]]:
        """One group per (stage, CP rank, TP rank): the replicas of the same model shard and the
        same sequence part, strided by TP x CP."""
        return self.grid4d.permute(0, 2, 3, 1).reshape(-1, self.dp_size).tolist()

    def dp_cp_groups(self) -> list[list[int]]:
        """One group per (stage, TP rank): its DP x CP ranks in rank order, the group gradients are
        reduced and ZeRO partitions built over (a CP rank's gradients cover only its tokens).
        The DP groups themselves at CP 1."""
        return self.grid4d.permute(0, 3, 1, 2).reshape(-1, self.dp_size * self.cp).tolist()

    def pp_groups(self) -> list[list[int]]:
        """One group per (DP rank, CP rank, TP rank): the ranks of that position in every stage, in
        stage order (strided by ``world / pp``)."""
        return self.grid4d.permute(1, 2, 3, 0).reshape(-1, self.pp_size).tolist()

    def embedding_groups(self) -> list[list[int]]:
        """The first and last stage of every PP group (the tied word embedding's two users); the
        single stage itself at PP 1."""
        return [sorted({g[0], g[-1]}) for g in self.pp_groups()]

    def mp_groups(self) -> list[list[int]]:
        """Model-parallel groups: every TP rank of every stage of one (DP, CP) position (what
        together holds one copy of the model; the gradient norm of stage 0 sums over it)."""
        return self.grid4d.permute(1, 2, 0, 3).reshape(self.dp_size * self.cp, -1).tolist()

    def ep_groups(self) -> list[list[int]]:
        """Every DP x CP group cut into runs of ``ep`` consecutive members: one EP group per
        (stage, TP rank, expert-DP index), ranks in EP-rank order. ``ep`` 1: every rank alone."""
        return self.grid3d.transpose(1, 2).reshape(-1, self.ep_size).tolist()

    def expert_dp_groups(self) -> list[list[int]]:
        """The ranks with the same EP index in each DP x CP group (strided by ``ep``): one
        expert-DP group of ``dp cp / ep`` ranks per (stage, TP rank, EP rank). ``ep`` 1: the
        DP x CP groups."""
        ep, edp = self.ep_size, self.expert_dp_size
        cols = self.grid3d.transpose(1, 2).reshape(-1, edp, ep)    # [pp*tp, edp, ep]
        return cols.transpose(1, 2).reshape(-1, edp).tolist()

    def _dp_cp_index(self, c: RankCoords) -> int:
        return c.dp_rank * self.cp + c.cp_rank                     # grid3d's middle index

    def expert_coords(self, rank: int) -> tuple[int, int]:
        """``(ep_rank, expert_dp_rank)`` of ``rank``: its index in its EP group and in its
        expert-DP group (from its DP x CP index ``i``: ``i % ep`` and ``i // ep``)."""
        expert_dp_rank, ep_rank = divmod(self._dp_cp_index(self.coords(rank)), self.ep_size)
        return ep_rank, expert_dp_rank

    def ep_group_of(self, rank: int) -> list[int]:
        c = self.coords(rank)
        i = self._dp_cp_index(c)
        start = i - i % self.ep_size
        return self.grid3d[c.pp_rank, start:start + self.ep_size, c.tp_rank].tolist()

    def expert_dp_group_of(self, rank: int) -> list[int]:
        c = self.coords(rank)
        i = self._dp_cp_index(c)
        return self.grid3d[c.pp_rank, i % self.ep_size::self.ep_size, c.tp_rank].tolist()

    def tp_group_of(self, rank: int) -> list[int]:
        c = self.coords(rank)
        return self.grid4d[c.pp_rank, c.dp_rank, c.cp_rank].tolist()

    def cp_group_of(self, rank: int) -> list[int]:
        c = self.coords(rank)
        return self.grid4d[c.pp_rank, c.dp_rank, :, c.tp_rank].tolist()

    def dp_group_of(self, rank: int) -> list[int]:
        c = self.coords(rank)
        return self.grid4d[c.pp_rank, :, c.cp_rank, c.tp_rank].tolist()

    def dp_cp_group_of(self, rank: int) -> list[int]:
        c = self.coords(rank)
        return self.grid4d[c.pp_rank, :, :, c.tp_rank].reshape(-1).tolist()

    def pp_group_of(self, rank: int) -> list[int]:
        c = self.coords(rank)
        return self.grid4d[:, c.dp_rank, c.cp_rank, c.tp_rank].tolist()

    def embedding_group_of(self, rank: int) -> list[int]:
        """The embedding group holding ``rank``; a middle stage is in none (its own rank alone)."""
        group = self.pp_group_of(rank)
        ends = sorted({group[0], group[-1]})
        return ends if rank in ends else [rank]

    def mp_group_of(self, rank: int) -> list[int]:
        c = self.coords(rank)
        return self.grid4d[:, c.dp_rank, c.cp_rank].reshape(-1).tolist()

    # ---- host split of DP (hybrid sharding, ZeRO++ hpZ) -------------------------------------
    def dp_host_split_problem(self) -> str | None:
        """Why the DP groups cannot be split into equal per-host parts (None: they can). Hybrid
        sharding and hpZ need every host of a DP group to hold the same number of its ranks."""
        for group in self.dp_groups():
            counts = [len(part) for part in self._by_host(group)]
            if len(set(counts)) > 1:
                return (f"the DP group {group} has {'/'.join(map(str, counts))} ranks on its "
                        f"{len(counts)} hosts of {self.gpus_per_node} GPUs: the DP ranks on a host "
                        f"must be the same number on every host (ranks per host dividing DP {self.dp_size})")
        return None

    def dp_host_groups(self) -> tuple[list[list[int]], list[list[int]]]:
        """Every DP group split by host, for hybrid sharding (FSDP2 HSDP, MiCS) and ZeRO++ hpZ:
        ``(intra, inter)``. An intra-host group is the DP ranks of one DP group on one host (the
        shard group); an inter-host group is the ranks at the same position of every intra-host
        group of one DP group (the replicas of one shard). Pure: a dry run of thousands of ranks
        lists them without torch.distributed.

            world 8, tp 1, 2 GPUs per node   DP [0..7]
            intra: [0,1] [2,3] [4,5] [6,7]   inter: [0,2,4,6] [1,3,5,7]
        """
        problem = self.dp_host_split_problem()
        if problem is not None:
            raise TopologyError(problem)
        intra, inter = [], []
        for group in self.dp_groups():
            parts = self._by_host(group)
            intra += parts
            inter += [list(column) for column in zip(*parts)]
        return intra, inter

    def expert_dp_host_split_problem(self) -> str | None:
        """Why the expert-DP groups cannot be split into equal per-host parts (None: they can)."""
        for group in self.expert_dp_groups():
            counts = [len(part) for part in self._by_host(group)]
            if len(set(counts)) > 1:
                return (f"the expert-DP group {group} has {'/'.join(map(str, counts))} ranks on "
                        f"its {len(counts)} hosts of {self.gpus_per_node} GPUs: the expert-DP "
                        f"ranks on a host must be the same number on every host")
        return None

    def expert_dp_host_groups(self) -> tuple[list[list[int]], list[list[int]]]:
        """Every expert-DP group split by host, as :meth:`dp_host_groups` splits the DP groups
        (hybrid sharding and hpZ for the expert parameters, issue 32). EP groups are consecutive
        DP ranks, so a host may hold a single rank of an expert-DP group:

            world 4, tp 1, 2 GPUs per node, EP 2   expert-DP [0, 2] [1, 3]
            intra: [0] [2] [1] [3]                 inter: [0, 2] [1, 3]
        """
        problem = self.expert_dp_host_split_problem()
        if problem is not None:
            raise TopologyError(problem)
        intra, inter = [], []
        for group in self.expert_dp_groups():
            parts = self._by_host(group)
            intra += parts
            inter += [list(column) for column in zip(*parts)]
        return intra, inter

    def dp_intra_host_group_of(self, rank: int) -> list[int]:
        return next(p for p in self._by_host(self.dp_group_of(rank)) if rank in p)

    def dp_inter_host_group_of(self, rank: int) -> list[int]:
        parts = self._by_host(self.dp_group_of(rank))
        position = next(p.index(rank) for p in parts if rank in p)
        return [p[position] for p in parts]

    @property
    def dp_ranks_per_host(self) -> int:
        """DP ranks of one DP group on one host (the hybrid shard size)."""
        return len(self.dp_intra_host_group_of(0))

    def _by_host(self, ranks: list[int]) -> list[list[int]]:
        """``ranks`` split by host, hosts in order of first appearance, rank order kept."""
        parts: dict[int, list[int]] = {}
        for r in ranks:
            parts.setdefault(r // self.gpus_per_node, []).append(r)
        return list(parts.values())

    def nodes_of(self, ranks: list[int]) -> list[int]:
        return sorted({r // self.gpus_per_node for r in ranks})

    def describe(self) -> str:
        crossing = "crossing nodes" if self.tp_crosses_nodes else "inside one node each"
        return (f"{self.world_size} ranks = {self.num_nodes} node(s) x {min(self.world_size, self.gpus_per_node)}"
                f" | TP {self.tp_size} ({self.world_size // self.tp_size} TP groups, {crossing})"
                f" | DP {self.dp_size} ({self.tp_size * self.cp * self.pp_size} DP groups)"
                + (f" | CP {self.cp} ({self.world_size // self.cp} CP groups)"
                   if self.cp > 1 else "")
                + (f" | PP {self.pp_size} ({self.world_size // self.pp_size} PP groups)"
                   if self.pp_size > 1 else "")
                + (f" | EP {self.ep_size} x expert-DP {self.expert_dp_size}"
                   if self.ep_size > 1 else ""))


def check_expert_split(num_experts: int | None, expert_model_parallel_size: int) -> None:
    """The experts of a MoE layer split evenly over the EP ranks (rank e holds experts
    ``e*E/ep .. (e+1)*E/ep - 1``), or a TopologyError naming the fix. Dense models (None) need EP 1."""
    ep = expert_model_parallel_size
    if ep == 1:
        return
    if not num_experts:
        raise TopologyError(f"expert-model-parallel size {ep} needs a mixture-of-experts model; "
                            f"set --num-experts or use --expert-model-parallel-size 1")
    if num_experts % ep:
        raise TopologyError(
            f"{num_experts} experts do not split evenly over expert-model-parallel size {ep}; "
            f"choose an EP degree that divides {num_experts} "
            f"(e.g. {_largest_divisor_at_most(num_experts, ep)})")


def _largest_divisor_at_most(n: int, k: int) -> int:
    return max(d for d in range(1, min(n, k) + 1) if n % d == 0)
