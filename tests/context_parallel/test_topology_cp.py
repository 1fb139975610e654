"""The CP dimension of the rank grid (issue 31): Megatron's order TP, CP, DP, PP; CP, DP and DP x CP
groups; every rank in exactly one group of each kind; the parallel state's CP groups (dry run and
two real gloo ranks)."""

import pytest
import torch

from hybrid.parallel_state import ParallelState
from hybrid.testing.multirank import run_on_ranks
from hybrid.topology import Topology, TopologyError


def test_grid_is_tp_then_cp_then_dp_then_pp():
    topo = Topology(16, 2, gpus_per_node=16, pipeline_parallel_size=2, cp=2)
    assert topo.dp_size == 2 and topo.cp_size == 2 and topo.dp_cp_size == 4
    assert topo.grid4d.tolist() == torch.arange(16).view(2, 2, 2, 2).tolist()
    # rank 13 = pp 1, dp 1, cp 0, tp 1
    c = topo.coords(13)
    assert (c.pp_rank, c.dp_rank, c.cp_rank, c.tp_rank) == (1, 1, 0, 1)
    assert topo.rank_of(1, 1, 1, 0) == 13
    assert topo.tp_group_of(13) == [12, 13]
    assert topo.cp_group_of(13) == [13, 15]
    assert topo.dp_group_of(13) == [9, 13]
    assert topo.dp_cp_group_of(13) == [9, 11, 13, 15]
    assert topo.pp_group_of(13) == [5, 13]
    assert topo.mp_group_of(13) == [4, 5, 12, 13]
    assert topo.cp_groups()[:2] == [[0, 2], [1, 3]]
    assert topo.dp_cp_groups() == [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]]
    for groups, of in ((topo.tp_groups(), topo.tp_group_of), (topo.cp_groups(), topo.cp_group_of),
                       (topo.dp_groups(), topo.dp_group_of), (topo.pp_groups(), topo.pp_group_of),
                       (topo.dp_cp_groups(), topo.dp_cp_group_of), (topo.mp_groups(), topo.mp_group_of)):
        for rank in range(16):   # exactly one group of each kind, the one *_group_of names
            assert [g for g in groups if rank in g] == [of(rank)]
    assert "CP 2" in topo.describe()


def test_cp_one_keeps_the_old_grid():
    topo = Topology(16, 2, gpus_per_node=4, pipeline_parallel_size=2)
    assert topo.grid3d.tolist() == torch.arange(16).view(2, 4, 2).tolist()
    assert topo.cp_groups() == [[r] for r in range(16)]
    assert topo.dp_cp_groups() == topo.dp_groups()
    assert "CP" not in topo.describe()


def test_world_not_divisible_by_cp_is_one_error():
    with pytest.raises(TopologyError, match="context-parallel size 3"):
        Topology(8, 2, gpus_per_node=8, cp=3)
    with pytest.raises(TopologyError, match="context-parallel size must be a positive integer"):
        Topology(8, 2, gpus_per_node=8, cp=0)


def test_dry_run_state_has_cp_and_dp_cp_groups():
    topo = Topology(64, 2, gpus_per_node=8, cp=4)   # dp 8
    state = ParallelState.dry_run(topo, 11)          # tp 1, cp 1, dp 1
    assert (state.cp_rank, state.cp_size, state.dp_rank, state.dp_size) == (1, 4, 1, 8)
    assert state.cp.kind == "cp" and state.cp.ranks == [9, 11, 13, 15]
    assert state.dp_cp.size == 32 and state.dp_cp.ranks[state.dp_cp.rank] == 11
    single = ParallelState.dry_run(Topology(8, 2, gpus_per_node=8), 3)
    assert single.cp_size == 1 and single.dp_cp is single.dp


def _groups(rank, world):
    state = ParallelState.initialize(Topology(world, 1, gpus_per_node=world, cp=2))
    from hybrid import comm
    t = torch.tensor([float(rank + 1)])
    comm.all_reduce(t, state.cp)
    kinds = sorted({r.group for r in state.ledger.records})
    return state.cp.ranks, state.dp_cp.ranks, state.dp.ranks, t.item(), kinds


@pytest.mark.slow
def test_initialized_state_cp_groups_communicate():
    out = run_on_ranks(_groups, 4)
    assert out[1][:3] == ([0, 1], [0, 1, 2, 3], [1, 3])
    assert [o[3] for o in out] == [3.0, 3.0, 7.0, 7.0]
    assert out[0][4] == ["cp"]
