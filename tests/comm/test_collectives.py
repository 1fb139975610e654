"""Communication layer: collectives are correct and the ledger records ring volumes."""

import torch

from hybrid import comm
from hybrid.parallel_state import ParallelState
from hybrid.testing.multirank import run_on_ranks
from hybrid.topology import Topology


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


def _match_native(rank, world_size):
    """comm's gloo reduce-scatter (all-to-all + local sum) and all-gather (point-to-point) against
    torch's own collectives (to the rounding of the summation order: fp32 1e-6, bf16 1e-2; the
    all-gather exactly); several async
    calls in flight at once complete in issue order with the right values."""
    import torch.distributed as dist
    state = ParallelState.initialize(Topology(world_size, 1, gpus_per_node=world_size))
    g = torch.Generator().manual_seed(rank)
    for dtype in (torch.float32, torch.bfloat16):
        fulls = [torch.randn(world_size * 5, 3, generator=g).to(dtype) for _ in range(3)]
        outs = [torch.empty(5, 3, dtype=dtype) for _ in fulls]
        handles = [comm.reduce_scatter_into(o, f, state.dp, async_op=True) for o, f in zip(outs, fulls)]
        shards = [torch.randn(7, generator=g).to(dtype) for _ in range(3)]
        gathered = [torch.empty(world_size * 7, dtype=dtype) for _ in shards]
        handles += [comm.all_gather_into(o, s, state.dp, async_op=True)
                    for o, s in zip(gathered, shards)]
        for h in handles:
            h.wait()
        for out, full in zip(outs, fulls):
            native = torch.empty(out.shape)      # the reference sums in fp32
            dist.reduce_scatter_tensor(native, full.float())
            tol = 1e-6 if dtype == torch.float32 else 1e-2
            torch.testing.assert_close(out.float(), native, rtol=tol, atol=tol)
        for out, shard in zip(gathered, shards):
            native = torch.empty_like(out)
            dist.all_gather_into_tensor(native, shard)
            assert torch.equal(out, native)
    return True


def test_gloo_reduce_scatter_and_all_gather_match_torch_on_four_ranks():
    assert all(run_on_ranks(_match_native, 4))


def _raises(rank, world_size):
    if rank == 1:
        raise ValueError("boom on purpose")
    torch.distributed.barrier()  # rank 0 waits for a peer that has died


def test_failing_rank_is_reported_not_hung():
    import pytest
    from hybrid.testing.multirank import RankFailure
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
