"""Expert-parallel groups carved out of DP (issue 32 item 2): EP groups are runs of EP consecutive
DP ranks, expert-DP groups the ranks with the same EP index; the dry-run state holds both."""

import pytest

from hybrid.parallel_state import ParallelState
from hybrid.topology import Topology, TopologyError, check_expert_split


def _partition(groups, world):
    return sorted(r for g in groups for r in g) == list(range(world))


def test_ep_and_expert_dp_groups_of_tp2_pp2():
    # world 16: pp 2 x dp 4 x tp 2; stage 0's DP groups are [0,2,4,6] and [1,3,5,7]
    topo = Topology(16, 2, gpus_per_node=8, pipeline_parallel_size=2, expert_model_parallel_size=2)
    assert (topo.dp_size, topo.ep_size, topo.expert_dp_size) == (4, 2, 2)
    assert topo.ep_groups()[:4] == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert topo.expert_dp_groups()[:4] == [[0, 4], [2, 6], [1, 5], [3, 7]]
    assert _partition(topo.ep_groups(), 16) and _partition(topo.expert_dp_groups(), 16)
    for rank in range(16):
        ep_rank, expert_dp_rank = topo.expert_coords(rank)
        ep, edp = topo.ep_group_of(rank), topo.expert_dp_group_of(rank)
        assert ep in topo.ep_groups() and edp in topo.expert_dp_groups()
        assert ep[ep_rank] == rank and edp[expert_dp_rank] == rank
        dp = topo.dp_group_of(rank)
        assert set(ep) <= set(dp) and set(edp) <= set(dp)      # both carved out of DP
        assert len(set(ep) & set(edp)) == 1                      # they meet in this rank only


def test_ep_equal_to_dp_and_ep_one():
    full = Topology(4, 1, gpus_per_node=4, expert_model_parallel_size=4)
    assert full.ep_groups() == [[0, 1, 2, 3]] and full.expert_dp_groups() == [[0], [1], [2], [3]]
    plain = Topology(4, 2, gpus_per_node=4)
    assert sorted(plain.ep_groups()) == [[0], [1], [2], [3]] and plain.expert_dp_groups() == plain.dp_groups()


def test_dry_run_state_has_ep_and_expert_dp():
    topo = Topology(8, 2, gpus_per_node=8, expert_model_parallel_size=2)
    state = ParallelState.dry_run(topo, rank=5)     # dp rank 2, tp rank 1
    assert (state.ep.kind, state.ep.ranks, state.ep_rank, state.ep_size) == ("ep", [5, 7], 0, 2)
    assert (state.expert_dp.kind, state.expert_dp.ranks) == ("expert_dp", [1, 5])
    one = ParallelState.single_process()
    assert one.ep_size == 1 and one.expert_dp is one.dp


@pytest.mark.parametrize("kwargs, message", [
    (dict(world_size=6, expert_model_parallel_size=4), "does not divide the data-parallel x context-parallel size 6"),
    (dict(world_size=4, tensor_parallel_size=2, expert_model_parallel_size=4),
     "does not divide the data-parallel x context-parallel size 2"),
    (dict(world_size=4, expert_model_parallel_size=0), "positive integer"),
])
def test_invalid_ep_names_the_fix(kwargs, message):
    with pytest.raises(TopologyError, match=message):
        Topology(gpus_per_node=kwargs["world_size"], **kwargs)


def test_experts_must_split_over_ep():
    check_expert_split(8, 4)
    check_expert_split(None, 1)
    with pytest.raises(TopologyError, match="6 experts do not split evenly over expert-model-parallel size 4"):
        check_expert_split(6, 4)
    with pytest.raises(TopologyError, match="needs a mixture-of-experts model"):
        check_expert_split(None, 2)


def test_expert_dp_host_split_for_hybrid_sharding_hpz_and_qgz():
    """The expert-DP groups split by host (hybrid sharding, hpZ and qgZ of the expert class)."""
    one_a_host = Topology(4, 1, gpus_per_node=2, expert_model_parallel_size=2)
    assert one_a_host.expert_dp_host_groups() == ([[0], [2], [1], [3]], [[0, 2], [1, 3]])
    two_a_host = Topology(8, 1, gpus_per_node=4, expert_model_parallel_size=2)
    intra, inter = two_a_host.expert_dp_host_groups()
    assert intra == [[0, 2], [4, 6], [1, 3], [5, 7]] and inter == [[0, 4], [2, 6], [1, 5], [3, 7]]
    state = ParallelState.dry_run(two_a_host, rank=6)
    hosts = state.require_expert_host_groups("--zero-hpz")
    assert [(g.kind, g.ranks, g.rank) for g in hosts] == [
        ("expert_dp_intra_host", [4, 6], 1), ("expert_dp_inter_host", [2, 6], 1)]
    uneven = Topology(6, 1, gpus_per_node=3, expert_model_parallel_size=2)   # [0, 2] | [4]
    assert "expert-DP group [0, 2, 4] has 2/1 ranks" in uneven.expert_dp_host_split_problem()
    with pytest.raises(ValueError, match="--zero-hpz splits every expert-DP group by host"):
        ParallelState.dry_run(uneven, rank=0).require_expert_host_groups("--zero-hpz")
