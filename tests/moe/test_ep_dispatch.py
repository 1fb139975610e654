"""Expert-parallel token dispatchers (issue 32 item 2) against the local computation on gloo ranks:
EP 2 (by default inside tests/moe/test_ep_parity.py's ranks), EP 4 and EP 2 in two groups (slow), ``alltoall`` and ``allgather``; outputs and the gradients of the
hidden states, the probs and the expert weights equal a single-process computation of the same
routing. The routing has an expert that receives no token from rank 0, an expert no rank chooses,
dropped routes (index -1), and a rank that sends nothing (all its routes dropped). The ledger's
all-to-all bytes equal docs/moe.md's formula, counted from the routing."""

import pytest
import torch

from hybrid.moe.dispatch import make_dispatcher
from hybrid.parallel_state import ParallelState
from hybrid.testing.multirank import run_on_ranks
from hybrid.topology import Topology

T, H, K, E = 6, 5, 2, 8   # tokens per rank, hidden, top-k, experts


def _routing(ep: int):
    """The whole EP group's tokens, routes, probs, expert weights and output gradient."""
    g = torch.Generator().manual_seed(7 + ep)
    hidden = torch.randn(ep * T, H, generator=g, dtype=torch.float64)
    index = torch.stack([torch.randperm(E - 1, generator=g)[:K] for _ in range(ep * T)])  # E-1 unused
    index[:T][index[:T] == 1] = 2                    # expert 1 gets nothing from rank 0
    index[1, 0] = index[4, 1] = -1                   # two dropped routes on rank 0
    index[(ep - 1) * T:] = -1                        # the last rank sends nothing
    probs = torch.rand(ep * T, K, generator=g, dtype=torch.float64)
    weight = torch.randn(E, H, H, generator=g, dtype=torch.float64)
    grad_out = torch.randn(ep * T, H, generator=g, dtype=torch.float64)
    return hidden, index, probs, weight, grad_out


def _reference(hidden, index, probs, weight, grad_out):
    hidden, probs, weight = (t.clone().requires_grad_() for t in (hidden, probs, weight))
    out = torch.zeros_like(hidden)
    for j in range(K):
        sel = index[:, j] >= 0
        rows = torch.einsum("th,tho->to", hidden[sel], weight[index[sel, j]])
        out = out.index_add(0, sel.nonzero().squeeze(1), probs[sel, j:j + 1] * rows)
    (out * grad_out).sum().backward()
    return out.detach(), hidden.grad, probs.grad, weight.grad


def _one_layout(state, kind):
    ep, r = state.ep_size, state.ep_rank
    hidden, index, probs, weight, grad_out = _routing(ep)
    ref_out, ref_dh, ref_dp, ref_dw = _reference(hidden, index, probs, weight, grad_out)
    mine = slice(r * T, (r + 1) * T)
    local = E // ep
    h = hidden[mine].clone().requires_grad_()
    p = probs[mine].clone().requires_grad_()
    w = weight[r * local:(r + 1) * local].clone().requires_grad_()
    dispatcher = make_dispatcher(kind, E, state.ep)
    mark = state.ledger.position
    tokens, counts = dispatcher.dispatch(h, index[mine], p)
    counts = counts.tolist()
    assert len(counts) == local and sum(counts) == tokens.shape[0]
    outs = [torch.einsum("th,ho->to", chunk, w[e]) for e, chunk in enumerate(tokens.split(counts))]
    out = dispatcher.combine(torch.cat(outs))
    (out * grad_out[mine]).sum().backward()
    torch.testing.assert_close(out, ref_out[mine], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(h.grad, ref_dh[mine], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(p.grad, ref_dp[mine], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(w.grad, ref_dw[r * local:(r + 1) * local], rtol=1e-12, atol=1e-12)
    # what routes into each local expert, from the routing itself
    expected = [int((index == r * local + e).sum()) for e in range(local)]
    assert counts == expected
    records = state.ledger.since(mark)
    if kind == "alltoall":
        owner = torch.where(index >= 0, index // local, -1)
        sent = int(((owner[mine] >= 0) & (owner[mine] != r)).sum())        # S_r
        others = torch.ones(ep * T, dtype=torch.bool)
        others[mine] = False
        received = int((owner[others] == r).sum())                          # R_r
        a2av = sum(x.bytes_per_rank for x in records if x.op == "all_to_all_v")
        assert a2av == 2 * (sent + received) * H * 8       # fp64 rows: dispatch + combine, fwd + bwd
        counts_bytes = sum(x.bytes_per_rank for x in records if x.op == "all_to_all")
        assert counts_bytes == E * 8 * (ep - 1) / ep       # one int64 count exchange, forward only
    else:   # all-gather + reduce-scatter of [ep T, H] both ways; indices, probs and their gradient
        assert sum(x.bytes_per_rank for x in records) == (4 * T * (ep - 1) * H * 8
                                                          + (ep - 1) * T * K * (8 + 8 + 8))
    assert {x.group for x in records} == {"ep"}
    return counts


def _check(rank, world_size, eps):
    for ep in eps:
        state = ParallelState.initialize(Topology(world_size, 1, gpus_per_node=world_size,
                                                  expert_model_parallel_size=ep),
                                         dp_transport="gloo")
        for kind in ("alltoall", "allgather"):
            _one_layout(state, kind)
    return True


def check_on_state(state) -> None:
    """Both dispatchers on an existing state's EP group (the default EP 2 run shares its ranks
    with tests/moe/test_ep_parity.py's, one spawn for both)."""
    for kind in ("alltoall", "allgather"):
        _one_layout(state, kind)


@pytest.mark.slow   # by default the same check runs inside test_ep_parity's EP 2 ranks
def test_dispatchers_match_local_computation_at_ep2():
    assert run_on_ranks(_check, 2, args=((2,),)) == [True] * 2


@pytest.mark.slow
def test_dispatchers_match_local_computation_at_ep4_and_two_ep2_groups():
    assert run_on_ranks(_check, 4, args=((4, 2),)) == [True] * 4


def test_single_rank_alltoall_is_local():
    """EP 1 (the group of this rank alone): the same code path, nothing sent or recorded."""
    state = ParallelState.single_process()
    hidden, index, probs, weight, grad_out = _routing(1)
    index[-T:] = torch.randint(0, E - 1, (T, K), generator=torch.Generator().manual_seed(3))
    index[:, 1] = torch.where(index[:, 1] == index[:, 0], (index[:, 0] + 1) % (E - 1), index[:, 1])
    ref_out = _reference(hidden, index, probs, weight, grad_out)[0]
    for kind in ("alltoall", "allgather"):
        d = make_dispatcher(kind, E, state.ep)
        tokens, counts = d.dispatch(hidden, index, probs)
        counts = counts.tolist()
        outs = [chunk @ weight[e] for e, chunk in enumerate(tokens.split(counts))]
        torch.testing.assert_close(d.combine(torch.cat(outs)), ref_out, rtol=1e-12, atol=1e-12)
    assert state.ledger.records == []


def test_experts_with_no_rows_keep_the_graph():
    """An EP rank that receives no token runs its experts on [0, h]: the output must still depend
    on the input, or that rank would skip the dispatcher's backward all-to-all its peers wait in."""
    from hybrid.moe.experts import GroupedSwiGLUExperts
    state = ParallelState.single_process()
    for grouped in (True, False):
        experts = GroupedSwiGLUExperts(2, 16, 8, state.tp)
        experts.to_empty(device="cpu")
        experts.use_grouped_mm = grouped
        x = torch.zeros(0, 16, requires_grad=True)
        y = experts(x, [0, 0])
        assert y.shape == (0, 16)
        y.sum().backward()
        assert x.grad is not None and x.grad.shape == (0, 16)
