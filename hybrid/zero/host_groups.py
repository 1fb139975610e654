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

With NCCL's rings, a DP ring over k hosts in blocks crosses at k of its n hops: plain stage 3 moves
3 Ψ (n-1)/n x k/n across, hpZ 2 Ψ (n-1)/n x k/n, hybrid sharding as above.
"""

from __future__ import annotations

from hybrid.comm import Group
from hybrid.parallel_state import ParallelState
from hybrid.zero.config import ZeroConfig

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
