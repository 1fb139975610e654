"""Communication layer: collectives are correct and the ledger records ring volumes."""

import torch

from hybrid import comm
from hybrid.parallel_state import ParallelState
from hybrid.topology import Topology
from tests.multirank import run_on_ranks


def test_single_process_state_needs_no_process_group():
    state = ParallelState.single_process()
    t = torch.arange(4.0)
    comm.all_reduce(t, state.dp)
    out = torch.empty(4)
    comm.all_gather_into(out, t, state.tp, async_op=True).wait()
    assert torch.equal(out, t) and (state.tp_size, state.dp_size) == (1, 1)
    assert state.ledger.records == []  # nothing is sent, so nothing is counted


def _collectives(rank, world_size, tp):
    state = ParallelState.initialize(Topology(world_size, tp, gpus_per_node=world_size))
    assert state.tp.ranks == [r for r in range(world_size) if r // tp == rank // tp]
    n, g = 6, state.dp.size
    x = torch.arange(n * g, dtype=torch.float32) + rank
    comm.all_reduce(x.clone(), state.dp)
    shard = torch.empty(n)
    comm.reduce_scatter_into(shard, x, state.dp, async_op=True).wait()
    expected = sum(torch.arange(n * g, dtype=torch.float32) + r for r in state.dp.ranks)
    assert torch.equal(shard, expected.view(g, n)[state.dp_rank])
    full = torch.empty(n * g)
    comm.all_gather_into(full, shard, state.dp)
    assert torch.equal(full, expected)
    ledger = state.ledger
    elem = 4 * n * g  # fp32 bytes of the full tensor
    assert ledger.bytes("dp", "all_reduce") == 2 * elem * (g - 1) / g
    assert ledger.bytes("dp", "reduce_scatter") == elem * (g - 1) / g
    assert ledger.bytes("dp", "all_gather") == elem * (g - 1) / g
    assert ledger.bytes("tp") == 0
    return state.dp.ranks


def test_collectives_and_ledger_on_four_ranks():
    dp_groups = run_on_ranks(_collectives, 4, args=(2,))
    assert dp_groups == [[0, 2], [1, 3], [0, 2], [1, 3]]


def _raises(rank, world_size):
    if rank == 1:
        raise ValueError("boom on purpose")
    torch.distributed.barrier()  # rank 0 waits for a peer that has died


def test_failing_rank_is_reported_not_hung():
    import pytest
    from tests.multirank import RankFailure
    with pytest.raises(RankFailure, match="(?s)rank 1 of 2 failed.*boom on purpose"):
        run_on_ranks(_raises, 2, timeout=60)


def test_dry_run_state_has_400_gpu_groups_and_refuses_to_communicate():
    import pytest
    state = ParallelState.dry_run(Topology(400, 16, gpus_per_node=16), rank=37)
    assert (state.tp_rank, state.dp_rank, state.tp.ranks[0], state.dp.ranks[:3]) == (5, 2, 32, [5, 21, 37])
    with pytest.raises(RuntimeError, match="dry-run"):
        comm.all_reduce(torch.ones(2), state.tp)


def test_ledger_stays_bounded_and_marks_survive_trimming():
    state = ParallelState.dry_run(Topology(2, 1, gpus_per_node=2), rank=0)
    ledger = state.ledger
    ledger.max_records = 10
    for _ in range(7):
        ledger.record("all_reduce", state.dp, 4, torch.float32)
    mark = ledger.position
    for _ in range(8):
        ledger.record("all_gather", state.dp, 4, torch.float32)
    assert len(ledger.records) <= 10 and ledger.position == 15
    assert [r.op for r in ledger.since(mark)] == ["all_gather"] * 8
    ledger.reset()
    assert ledger.since(mark) == [] and ledger.position == 0
