"""Parameter classes of a ZeRO engine: each class of parameters has its own data-parallel group,
over which its gradients are reduced and its model states partitioned (issue 32, ZeRO with experts).

A dense parameter is replicated over the whole DP group (ZeRO paper §5: partitioned over Nd ranks).
With expert parallelism (EP carved out of DP, DeepSpeed-MoE / Megatron-Core) an expert's weights
exist on the EP rank that holds the expert only, replicated over the expert-data-parallel group of
DP / EP ranks: its gradients are summed and its states partitioned over that smaller group. Every
class gets flat buffers / buckets / sharding units of its own, so a collective never mixes groups.

    class    members                               group          partitions per rank
    dense    every parameter not claimed below     state.dp_cp    Ψ_dense / DP (x CP)
    expert   ``param.expert_parallel`` is True     expert-DP      (Ψ_expert / EP) / (DP / EP)

The expert-DP group is ``state.expert_dp`` (a :class:`hybrid.comm.Group`; it equals
``state.dp_cp``, the DP group at CP 1, while EP = 1) or the one passed to the engine. When it has the DP group's size (EP = 1) the expert
parameters are dense ones: one class, the dense-only engine unchanged.

Gradient scale: every class is divided by the DP size. An expert's gradient on one rank already
sums the contributions of the tokens that the EP group's ranks routed to it (the all-to-all's
backward carries them home), so the sum over expert-DP is the sum over all DP ranks' losses and
the mean over the global batch divides it by DP (as Megatron-Core's expert gradient scaling).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from hybrid.comm import Group
from hybrid.parallel_state import ParallelState

EXPERT_ATTRIBUTE = "expert_parallel"   # contract 3 of issue 32


@dataclass(frozen=True)
class ParamClass:
    """One class of parameters: ``name`` ("dense", "expert"), the DP ``group`` its gradients are
    reduced and its states partitioned over, and its members' indices in the engine's list;
    ``replicas``: hybrid sharding's inter-host group holding copies of each partition (None:
    none; :func:`hybrid.zero.host_groups.place_classes`)."""

    name: str
    group: Group
    members: tuple[int, ...]
    replicas: Group | None = None


def is_expert(param: nn.Parameter) -> bool:
    return bool(getattr(param, EXPERT_ATTRIBUTE, False))


def expert_dp_group(state: ParallelState, explicit: Group | None = None) -> Group | None:
    """The expert-DP group: ``explicit``, else ``state.expert_dp`` (None when the state has none)."""
    return explicit if explicit is not None else getattr(state, "expert_dp", None)


def split_classes(params: list[nn.Parameter], dense_group: Group, expert_group: Group | None,
                  dp_size: int) -> list[ParamClass]:
    """The classes of ``params``: one dense class (all of them, over ``dense_group``) unless some
    are expert-parallel and the expert-DP group is smaller than the DP group (``dp_size`` ranks);
    then the dense class (if it has members) first, the expert class second."""
    experts = tuple(i for i, p in enumerate(params) if is_expert(p))
    if not experts or expert_group is None or expert_group.size == dp_size:
        return [ParamClass("dense", dense_group, tuple(range(len(params))))]
    if dp_size % expert_group.size:
        raise ValueError(f"the expert-data-parallel group has {expert_group.size} ranks, which does "
                         f"not divide the {dp_size} data-parallel ranks; expert-DP must be "
                         f"DP / --expert-model-parallel-size")
    dense = tuple(i for i in range(len(params)) if i not in set(experts))
    out = [ParamClass("dense", dense_group, dense)] if dense else []
    return out + [ParamClass("expert", expert_group, experts)]

