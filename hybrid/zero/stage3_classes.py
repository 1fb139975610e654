"""ZeRO stage 3 with parameter classes (issue 32; :mod:`hybrid.zero.param_classes`): a sharding unit
whose module holds both dense and expert-parallel parameters gets one
:class:`~hybrid.zero.stage3_unit.ShardedUnit` per class, the dense one partitioned over DP, the
expert one over expert-DP (its all-gathers and reduce-scatters run in that group only, so the
expert weights of this EP rank are gathered from the DP / EP ranks that replicate them). The
gather schedule sees the module's units as one :class:`UnitSet`.
"""

from __future__ import annotations

from torch import nn

from hybrid.zero.stage3_unit import ShardedUnit

Pairs = list[tuple[str, nn.Parameter]]


def split_pairs(groups: list[Pairs], expert_ids: set[int]) -> tuple[list[Pairs], list[Pairs]]:
    """Per unit, its (name, parameter) pairs split into (dense, expert) by ``id(param)``."""
    dense = [[(n, p) for n, p in pairs if id(p) not in expert_ids] for pairs in groups]
    experts = [[(n, p) for n, p in pairs if id(p) in expert_ids] for pairs in groups]
    return dense, experts


class UnitSet:
    """The units of one sharding module, gathered and released together (what
    :class:`hybrid.zero.stage3_hooks.Stage3Scheduler` and the working-memory report read)."""

    def __init__(self, members: list[ShardedUnit]):
        self.members = members

    @property
    def gathered(self) -> bool:
        return all(m.gathered for m in self.members)

    @property
    def in_flight(self) -> bool:
        return any(m.in_flight for m in self.members)

    @property
    def numel(self) -> int:
        return sum(m.numel for m in self.members)

    @property
    def padded(self) -> int:
        return sum(m.padded for m in self.members)

    def gather(self, async_op: bool = True) -> None:
        for m in self.members:            # both in flight at once
            m.gather(async_op=True)
        if not async_op:
            for m in self.members:
                m.gather(async_op=False)

    def release(self) -> None:
        for m in self.members:
            m.release()


def merge_units(dense: list[ShardedUnit | None], expert: list[ShardedUnit | None]
                ) -> tuple[list, list[list[ShardedUnit]]]:
    """Per module: what the scheduler gathers (a unit, a :class:`UnitSet`, or None) and its
    member units (dense first)."""
    scheduled, members = [], []
    for d, e in zip(dense, expert):
        mine = [u for u in (d, e) if u is not None]
        members.append(mine)
        scheduled.append(None if not mine else mine[0] if len(mine) == 1 else UnitSet(mine))
    return scheduled, members
