"""Which DP groups a ZeRO engine partitions over, by host (past the ZeRO paper: FSDP2's HSDP,
MiCS, ZeRO++ hpZ).

Plain ZeRO partitions every model state over the whole DP group, so with DP spanning hosts each
stage-3 all-gather and every reduce-scatter crosses the slow links between hosts. Two options
(:class:`~hybrid.zero.config.ZeroConfig`) use the host split of each DP group that
:class:`~hybrid.parallel_state.ParallelState` builds (``dp_intra_host_group``: the h DP ranks on this
host; ``dp_inter_host_group``: the k ranks at this position on the k hosts; DP n = h k):

* hybrid sharding (``hybrid_shard``): stages 1-3 partition over the intra-host group and replicate
  across hosts. Parameters are gathered inside the host; gradients are reduce-scattered inside the
  host, then this rank's slice all-reduced over the inter-host group
  (:func:`hybrid.comm.reduce_scatter_replicated`): the sum over all n DP ranks, exactly. Model
  states cost /h instead of /n.
* hpZ (``hpz``, stage 3): partitions over the whole DP group as plain stage 3; after a unit's first
  all-gather of a step (in forward) this rank keeps its 1/h slice of the gathered 16-bit unit (the
  secondary partition), and later gathers of that step run over the intra-host group from it.
  Extra memory: 2Ψ/h bytes per rank in bf16 (Ψ/h elements of the compute dtype). ZeRO++'s hpZ (Wang et
  al. 2023) keeps it for the backward; here it also serves the next micro-batches' gathers
  until the step writes new parameters.

Cross-host bytes per rank per step, Ψ the bytes of the (padded) 16-bit parameters, over gloo's
direct collectives of :mod:`hybrid.comm` (a peer on another host is (n-h)/(n-1) of the n-1 peers):

    plain stage 3     3 Ψ (n-h)/n      two all-gathers + one reduce-scatter over DP
    hpZ               2 Ψ (n-h)/n      the backward's all-gather stays inside the host
    hybrid shard      2 Ψ (k-1)/n      only the all-reduce of Ψ/h over k hosts (a ring, all hops cross)
    plain stage 1/2   2 Ψ (n-h)/n      reduce-scatter + all-gather over DP
    hybrid 1/2        2 Ψ (k-1)/n

With expert parallelism (issue 32) the expert parameters' class is partitioned over its
expert-DP group; both options split that group by host the same way
(:func:`expert_partition_groups`, :func:`expert_secondary_group`; the groups:
:meth:`~hybrid.parallel_state.ParallelState.require_expert_host_groups`). EP groups are runs of
consecutive DP ranks, so a host may hold one rank of an expert-DP group (h_e = 1): hybrid sharding
then keeps the experts whole on each rank and all-reduces their gradients over the hosts, and
hpZ's secondary partition of an expert unit is the whole unit (2 Ψ_e / h_e extra bytes). An
expert-DP group on one host has no slow link: both options leave the expert class as plain ZeRO.

With NCCL's rings, a DP ring over k hosts in blocks crosses at k of its n hops: plain stage 3 moves
3 Ψ (n-1)/n x k/n across, hpZ 2 Ψ (n-1)/n x k/n, hybrid sharding as above.
"""

from __future__ import annotations

from dataclasses import replace

from hybrid.comm import Group
from hybrid.parallel_state import ParallelState
from hybrid.zero.config import ZeroConfig
from hybrid.zero.param_classes import ParamClass

HYBRID_FLAG, HPZ_FLAG = "--zero-hybrid-shard", "--zero-hpz"


def partition_groups(state: ParallelState, config: ZeroConfig) -> tuple[Group, Group | None]:
    """(the group model states are partitioned over, the group holding copies of each partition
    or None): (DP x CP, None) plainly (the DP group at CP 1; under context parallelism each CP
    rank's gradients cover only its tokens, so they are summed and partitioned over DP x CP,
    issue 31), (intra-host, inter-host) with hybrid sharding."""
    if not config.hybrid_shard:
        return state.dp_cp, None
    return _host_groups(state, HYBRID_FLAG)


def secondary_group(state: ParallelState, config: ZeroConfig) -> Group | None:
    """hpZ's intra-host group (the secondary partition's), or None without hpZ."""
    if not config.hpz:
        return None
    intra, _ = _host_groups(state, HPZ_FLAG)
    return intra


def _host_groups(state: ParallelState, flag: str) -> tuple[Group, Group]:
    if state.cp_size > 1:
        raise ValueError(f"{flag} splits the DP groups by host, but under context parallelism "
                         f"(CP {state.cp_size}) ZeRO partitions span DP x CP, whose host split is "
                         f"not built; drop {flag} or use CP 1")
    intra, inter = state.require_host_groups(flag)
    if inter.size == 1:
        raise ValueError(f"{flag}: the {state.dp_size} DP ranks of each group are all on one host "
                         f"({state.topology.gpus_per_node} ranks per host), so there is no slow "
                         f"link to avoid and the option would change nothing; drop the flag, or "
                         f"launch on several hosts (LOCAL_WORLD_SIZE / --gpus-per-node below DP)")
    return intra, inter


def place_classes(state: ParallelState, config: ZeroConfig, classes: list[ParamClass],
                  dense_replicas: Group | None) -> list[ParamClass]:
    """The parameter classes with the groups their partitions live in: the dense class's as
    given (:func:`partition_groups`), the expert class's split by host under hybrid sharding
    (:func:`expert_partition_groups`)."""
    out = []
    for c in classes:
        if c.name == "expert":
            group, replicas = expert_partition_groups(state, config, c.group)
            out.append(replace(c, group=group, replicas=replicas))
        else:
            out.append(replace(c, replicas=dense_replicas))
    return out


def expert_partition_groups(state: ParallelState, config: ZeroConfig, expert_dp: Group
                            ) -> tuple[Group, Group | None]:
    """The expert class's (partition group, replicas): (``expert_dp``, None) plainly, its
    (intra-host, inter-host) split with hybrid sharding (replicas None when the expert-DP group
    sits on one host)."""
    if not config.hybrid_shard:
        return expert_dp, None
    intra, inter = _expert_host_groups(state, HYBRID_FLAG, expert_dp)
    return intra, (inter if inter.size > 1 else None)


def expert_secondary_group(state: ParallelState, config: ZeroConfig, expert_dp: Group
                           ) -> Group | None:
    """hpZ's group for the expert units: the expert-DP ranks on this host, None without hpZ or
    when the expert-DP group sits on one host (no cross-host gather to avoid)."""
    if not config.hpz:
        return None
    intra, inter = _expert_host_groups(state, HPZ_FLAG, expert_dp)
    return intra if inter.size > 1 else None


def _expert_host_groups(state: ParallelState, flag: str, expert_dp: Group) -> tuple[Group, Group]:
    intra, inter = state.require_expert_host_groups(flag)
    if expert_dp.ranks != state.expert_dp.ranks:
        raise ValueError(f"{flag}: the expert-DP group given to the engine ({expert_dp.ranks}) is "
                         f"not the parallel state's ({state.expert_dp.ranks}), whose host split "
                         f"it uses; build the state with --expert-model-parallel-size instead of "
                         f"passing expert_dp")
    return intra, inter
