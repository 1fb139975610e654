"""Topology: rank coordinates and groups for small jobs and the paper's 400-GPU DGX-2 layout."""

import pytest

from hybrid.topology import Topology, TopologyError


def _check_partition(topo: Topology) -> None:
    """Every rank is in exactly one TP and one DP group, and both views agree with coords()."""
    for groups in (topo.tp_groups(), topo.dp_groups()):
        flat = sorted(r for g in groups for r in g)
        assert flat == list(range(topo.world_size))
    for rank in range(topo.world_size):
        c = topo.coords(rank)
        assert topo.tp_group_of(rank)[c.tp_rank] == rank
        assert topo.dp_group_of(rank)[c.dp_rank] == rank
        assert topo.rank_of(c.tp_rank, c.dp_rank) == rank


def test_small_layout_tp_is_fastest():
    topo = Topology(8, 2, gpus_per_node=4)
    assert topo.tp_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert topo.dp_groups() == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert topo.coords(5) == topo.coords(5).__class__(rank=5, node=1, local_rank=1, tp_rank=1, dp_rank=2)
    _check_partition(topo)


def test_paper_400_gpus_tp16_stays_inside_dgx2_nodes():
    topo = Topology(400, 16, gpus_per_node=16)
    assert (topo.num_nodes, topo.dp_size, topo.tp_size) == (25, 25, 16)
    assert not topo.tp_crosses_nodes
    for group in topo.tp_groups():
        assert len(topo.nodes_of(group)) == 1
    for group in topo.dp_groups():  # each DP group has one rank on every node
        assert topo.nodes_of(group) == list(range(25))
    _check_partition(topo)


def test_megatron_baseline_384_gpus_tp128_is_reported_crossing():
    with pytest.raises(TopologyError, match="larger than a node"):
        Topology(384, 128, gpus_per_node=16)
    topo = Topology(384, 128, gpus_per_node=16, allow_tp_across_nodes=True)
    assert topo.tp_crosses_nodes and topo.dp_size == 3 and topo.num_nodes == 24
    assert all(len(topo.nodes_of(g)) == 8 for g in topo.tp_groups())
    _check_partition(topo)


@pytest.mark.parametrize("kwargs, message", [
    (dict(world_size=6, tensor_parallel_size=4, gpus_per_node=6), "not divisible by tensor-model-parallel size 4"),
    (dict(world_size=24, tensor_parallel_size=2, gpus_per_node=16), "not a whole number of nodes"),
    (dict(world_size=32, tensor_parallel_size=3, gpus_per_node=16), "not divisible"),
    (dict(world_size=24, tensor_parallel_size=24, gpus_per_node=16, allow_tp_across_nodes=True), "whole number of nodes"),
    (dict(world_size=0, tensor_parallel_size=1), "positive integer"),
    (dict(world_size=4, tensor_parallel_size=0), "positive integer"),
])
def test_invalid_layouts_name_the_fix(kwargs, message):
    with pytest.raises(TopologyError, match=message):
        Topology(**kwargs)


def test_coords_outside_world():
    with pytest.raises(TopologyError, match="outside the world"):
        Topology(4, 2, 4).coords(4)
