"""Pure rank topology of a hybrid TP x DP x PP job (Megatron-LM §3 "model + data parallel"; ZeRO §7;
pipeline stages: Narayanan et al. 2021 §2.2, §3.2).

A :class:`Topology` maps every global rank to its node, its local index on the node, its tensor
parallel (TP) rank, its data-parallel (DP) rank and its pipeline (PP) stage, with no
torch.distributed involved, so a 400-GPU DGX-2 layout can be checked on a laptop.

Rank order (docs/design.md §2): TP varies fastest, then DP, then PP (Megatron's order). The rank
grid is ``arange(world).view(pp, dp, tp)``; with PP 1 (the default) it is ``view(dp, tp)``:

    world 8, tp 2, 4 GPUs per node
        node 0: ranks 0 1 | 2 3        TP groups: [0,1] [2,3] [4,5] [6,7]   (adjacent, inside a node)
        node 1: ranks 4 5 | 6 7        DP groups: [0,2,4,6] [1,3,5,7]       (strided, across nodes)

A TP group that is larger than a node (Megatron's 384-GPU baseline with TP 128) crosses nodes; it is
only accepted with ``allow_tp_across_nodes=True`` and is reported by :attr:`tp_crosses_nodes`, since
its all-reduces then run over InfiniBand instead of NVSwitch.

With PP > 1 each stage is a contiguous block of ``world / pp`` ranks (whole nodes in a real
layout), so the point-to-point traffic between stages crosses nodes while TP stays inside one.
A PP group is one (dp, tp) column through the stages; the embedding group of a column is its first
and last stage, which hold the two uses of the tied word embedding.

Expert parallelism (issue 32; Megatron-Core's layout) is carved out of DP: inside every DP group
(one stage, one TP rank), each run of ``ep`` consecutive DP ranks is an EP group (its ranks hold
different experts and exchange tokens by all-to-all), and the ranks with the same EP index form an
expert-DP group of ``dp / ep`` ranks (they hold the same experts and reduce their gradients):

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


@dataclass(frozen=True)
class Topology:
    world_size: int
    tensor_parallel_size: int = 1
    gpus_per_node: int = 16
    allow_tp_across_nodes: bool = False
    pipeline_parallel_size: int = 1
    expert_model_parallel_size: int = 1   # EP, carved out of DP (module docstring)

    def __post_init__(self) -> None:
        world, tp, per_node = self.world_size, self.tensor_parallel_size, self.gpus_per_node
        pp = self.pipeline_parallel_size
        for name, value in (("world size", world), ("tensor-model-parallel size", tp),
                            ("GPUs per node", per_node), ("pipeline-model-parallel size", pp)):
            if not isinstance(value, int) or value < 1:
                raise TopologyError(f"{name} must be a positive integer, got {value!r}")
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
        if self.dp_size % ep:
            raise TopologyError(
                f"expert-model-parallel size {ep} does not divide the data-parallel size "
                f"{self.dp_size} (EP groups are carved out of DP); choose an EP degree that divides "
                f"{self.dp_size} (e.g. {_largest_divisor_at_most(self.dp_size, ep)}) or add ranks")

    # ---- sizes -----------------------------------------------------------------------------
    @property
    def tp_size(self) -> int:
        return self.tensor_parallel_size

    @property
    def dp_size(self) -> int:
        return self.world_size // (self.tensor_parallel_size * self.pipeline_parallel_size)

    @property
    def pp_size(self) -> int:
        return self.pipeline_parallel_size

    @property
    def ep_size(self) -> int:
        return self.expert_model_parallel_size

    @property
    def expert_dp_size(self) -> int:
        """Ranks holding the same experts: DP / EP (their gradients are reduced over it)."""
        return self.dp_size // self.expert_model_parallel_size

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
        """``grid[dp_rank, tp_rank]`` is the global rank: ``arange(world).view(dp, tp)`` of the
        first pipeline stage (the whole world at PP 1); :attr:`grid3d` holds every stage."""
        return self.grid3d[0]

    @cached_property
    def grid3d(self) -> torch.Tensor:
        """``grid3d[pp_rank, dp_rank, tp_rank]`` is the global rank: ``arange(world).view(pp, dp, tp)``."""
        import torch
        return torch.arange(self.world_size).view(self.pipeline_parallel_size, self.dp_size,
                                                  self.tensor_parallel_size)

    # ---- coordinates -----------------------------------------------------------------------
    def coords(self, rank: int) -> RankCoords:
        if not 0 <= rank < self.world_size:
            raise TopologyError(f"rank {rank} is outside the world of {self.world_size} ranks")
        pp_rank, dp_rank, tp_rank = (self.grid3d == rank).nonzero()[0].tolist()   # where it sits
        node, local_rank = divmod(rank, self.gpus_per_node)
        return RankCoords(rank, node, local_rank, tp_rank, dp_rank, pp_rank)

    def rank_of(self, tp_rank: int, dp_rank: int, pp_rank: int = 0) -> int:
        return int(self.grid3d[pp_rank, dp_rank, tp_rank])

    # ---- groups ----------------------------------------------------------------------------
    def tp_groups(self) -> list[list[int]]:
        """Rows of the grid: one group per (stage, DP replica), adjacent ranks."""
        return self.grid3d.reshape(-1, self.tp_size).tolist()

    def dp_groups(self) -> list[list[int]]:
        """Columns of each stage's grid: one group per (stage, TP rank), strided by the TP degree."""
        return self.grid3d.transpose(1, 2).reshape(-1, self.dp_size).tolist()

    def pp_groups(self) -> list[list[int]]:
        """One group per (DP rank, TP rank): the ranks of that position in every stage, in stage
        order (strided by ``world / pp``)."""
        return self.grid3d.permute(1, 2, 0).reshape(-1, self.pp_size).tolist()

    def embedding_groups(self) -> list[list[int]]:
        """The first and last stage of every PP group (the tied word embedding's two users); the
        single stage itself at PP 1."""
        return [sorted({g[0], g[-1]}) for g in self.pp_groups()]

    def mp_groups(self) -> list[list[int]]:
        """Model-parallel groups: every TP rank of every stage of one DP replica (what together
        holds one copy of the model; the gradient norm of stage 0 sums over it)."""
        return self.grid3d.transpose(0, 1).reshape(self.dp_size, -1).tolist()

    def ep_groups(self) -> list[list[int]]:
        """Every DP group cut into runs of ``ep`` consecutive DP ranks: one EP group per
        (stage, TP rank, expert-DP index), ranks in EP-rank order. ``ep`` 1: every rank alone."""
        ep = self.ep_size
        return self.grid3d.transpose(1, 2).reshape(-1, ep).tolist()

    def expert_dp_groups(self) -> list[list[int]]:
        """The ranks with the same EP index in each DP group (strided by ``ep`` DP ranks): one
        expert-DP group of ``dp / ep`` ranks per (stage, TP rank, EP rank). ``ep`` 1: the DP groups."""
        ep, edp = self.ep_size, self.expert_dp_size
        cols = self.grid3d.transpose(1, 2).reshape(-1, edp, ep)    # [pp*tp, edp, ep]
        return cols.transpose(1, 2).reshape(-1, edp).tolist()

    def expert_coords(self, rank: int) -> tuple[int, int]:
        """``(ep_rank, expert_dp_rank)`` of ``rank``: its index in its EP group (``dp_rank % ep``)
        and in its expert-DP group (``dp_rank // ep``)."""
        expert_dp_rank, ep_rank = divmod(self.coords(rank).dp_rank, self.ep_size)
        return ep_rank, expert_dp_rank

    def ep_group_of(self, rank: int) -> list[int]:
        c = self.coords(rank)
        start = c.dp_rank - c.dp_rank % self.ep_size
        return self.grid3d[c.pp_rank, start:start + self.ep_size, c.tp_rank].tolist()

    def expert_dp_group_of(self, rank: int) -> list[int]:
        c = self.coords(rank)
        return self.grid3d[c.pp_rank, c.dp_rank % self.ep_size::self.ep_size, c.tp_rank].tolist()

    def tp_group_of(self, rank: int) -> list[int]:
        c = self.coords(rank)
        return self.grid3d[c.pp_rank, c.dp_rank].tolist()

    def dp_group_of(self, rank: int) -> list[int]:
        c = self.coords(rank)
        return self.grid3d[c.pp_rank, :, c.tp_rank].tolist()

    def pp_group_of(self, rank: int) -> list[int]:
        c = self.coords(rank)
        return self.grid3d[:, c.dp_rank, c.tp_rank].tolist()

    def embedding_group_of(self, rank: int) -> list[int]:
        """The embedding group holding ``rank``; a middle stage is in none (its own rank alone)."""
        group = self.pp_group_of(rank)
        ends = sorted({group[0], group[-1]})
        return ends if rank in ends else [rank]

    def mp_group_of(self, rank: int) -> list[int]:
        return self.grid3d[:, self.coords(rank).dp_rank].reshape(-1).tolist()

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
                f" | DP {self.dp_size} ({self.tp_size * self.pp_size} DP groups)"
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
