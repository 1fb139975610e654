"""Tensor-parallel layers against unsharded torch (Megatron-LM §3; sequence parallelism).

Every rank builds the same full weights and inputs from a fixed seed, runs the unsharded torch
reference locally, and checks that its shards of outputs and gradients equal the matching slices of
the reference (all ranks together cover the full tensors). One spawn per layout runs every check.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hybrid import comm
from hybrid.parallel_state import ParallelState
from hybrid.tensor_parallel import (ColumnParallelLinear, LayerNorm, RowParallelLinear,
                                    VocabParallelEmbedding, full_init, gather_from_sequence,
                                    gather_from_tp, reduce_scatter_to_sequence, scatter_to_sequence,
                                    scatter_to_tp, shard, vocab_parallel_cross_entropy)
from hybrid.testing.multirank import run_on_ranks
from hybrid.topology import Topology

S, B, H = 8, 2, 8          # sequence, micro-batch, hidden: divisible by every TP degree tested
TOL = dict(rtol=1e-5, atol=1e-6)


def _close(actual, expected, what):
    torch.testing.assert_close(actual, expected, **TOL, msg=lambda m: f"{what}: {m}")


def _slice(t, dim, group):
    part = t.size(dim) // group.size
    return t.narrow(dim, group.rank * part, part)


def _randomize(module, gen, std=0.3):
    """Same values on every rank (the default generator is not seeded alike in spawned ranks)."""
    for p in module.parameters():
        p.data.normal_(0, std, generator=gen)
    return module


def _gather_rows(t, group):
    """Concatenate every TP rank's ``t`` along dim 0 (a test-side gather through hybrid.comm)."""
    out = torch.empty((t.size(0) * group.size, *t.shape[1:]), dtype=t.dtype)
    comm.all_gather_into(out, t.contiguous(), group)
    return out


# ---- checks run on every rank ----------------------------------------------------------------
def check_mlp(group, sp):
    """ColumnParallel -> GELU -> RowParallel equals nn.Linear -> GELU -> nn.Linear, fwd and bwd."""
    gen = torch.Generator().manual_seed(1)
    ref1, ref2 = _randomize(nn.Linear(H, 4 * H), gen), _randomize(nn.Linear(4 * H, H), gen)
    x_full = torch.randn(S, B, H, generator=gen, requires_grad=True)
    grad_out = torch.randn(S, B, H, generator=gen)
    y_ref = ref2(F.gelu(ref1(x_full)))
    y_ref.backward(grad_out)

    col = ColumnParallelLinear(H, 4 * H, group, sequence_parallel=sp)
    row = RowParallelLinear(4 * H, H, group, sequence_parallel=sp)
    col.load_full_(weight=ref1.weight, bias=ref1.bias)
    row.load_full_(weight=ref2.weight, bias=ref2.bias)
    x = (_slice(x_full, 0, group) if sp else x_full).detach().clone().requires_grad_()
    y = row(F.gelu(col(x)))
    y.backward(_slice(grad_out, 0, group) if sp else grad_out)

    seq = (lambda t: _slice(t, 0, group)) if sp else (lambda t: t)
    _close(y, seq(y_ref), f"mlp output sp={sp}")
    _close(x.grad, seq(x_full.grad), f"mlp input grad sp={sp}")
    _close(col.weight.grad, _slice(ref1.weight.grad, 0, group), "column weight grad")
    _close(col.bias.grad, _slice(ref1.bias.grad, 0, group), "column bias grad")
    _close(row.weight.grad, _slice(ref2.weight.grad, 1, group), "row weight grad")
    _close(row.bias.grad, ref2.bias.grad, "row bias grad (replicated, summed over TP under SP)")
    _close(_gather_rows(col.weight.detach(), group), ref1.weight.detach(), "gathered column weight")


def check_column_gather_output(group):
    gen = torch.Generator().manual_seed(2)
    ref = _randomize(nn.Linear(H, 2 * H), gen)
    x_full = torch.randn(S, B, H, generator=gen, requires_grad=True)
    grad_out = torch.randn(S, B, 2 * H, generator=gen)
    ref(x_full).backward(grad_out)
    col = ColumnParallelLinear(H, 2 * H, group, gather_output=True)
    col.load_full_(weight=ref.weight, bias=ref.bias)
    x = x_full.detach().clone().requires_grad_()
    y = col(x)
    y.backward(grad_out)
    _close(y, ref(x_full), "gather_output forward")
    _close(x.grad, x_full.grad, "gather_output input grad")
    _close(col.weight.grad, _slice(ref.weight.grad, 0, group), "gather_output weight grad")
    col.zero_grad()
    col(x_full.detach()).backward(grad_out)      # an input without grad: no input-grad collective
    _close(col.weight.grad, _slice(ref.weight.grad, 0, group), "weight grad, input without grad")


def check_embedding(group, sp):
    gen = torch.Generator().manual_seed(3)
    vocab = 4 * group.size + 4                     # padded vocabulary, divisible by tp
    ref = _randomize(nn.Embedding(vocab, H), gen, std=1.0)
    ids = torch.randint(0, vocab, (S, B), generator=gen)
    grad_out = torch.randn(S, B, H, generator=gen)
    ref(ids).backward(grad_out)
    emb = VocabParallelEmbedding(vocab, H, group, reduce_scatter_output=sp)
    emb.load_full_(weight=ref.weight)
    y = emb(ids)
    expected = ref(ids).detach()
    y.backward(_slice(grad_out, 0, group) if sp else grad_out)
    _close(y, _slice(expected, 0, group) if sp else expected, f"embedding output sp={sp}")
    _close(emb.weight.grad, _slice(ref.weight.grad, 0, group), f"embedding weight grad sp={sp}")


def check_layer_norm(group, sp):
    gen = torch.Generator().manual_seed(4)
    ref = _randomize(nn.LayerNorm(H), gen, std=0.2)
    x_full = torch.randn(S, B, H, generator=gen, requires_grad=True)
    grad_out = torch.randn(S, B, H, generator=gen)
    ref(x_full).backward(grad_out)
    ln = LayerNorm(H, group, sequence_parallel=sp)
    ln.load_full_(weight=ref.weight, bias=ref.bias)
    seq = (lambda t: _slice(t, 0, group)) if sp else (lambda t: t)
    x = seq(x_full).detach().clone().requires_grad_()
    y = ln(x)
    y.backward(seq(grad_out))
    _close(y, seq(ref(x_full)), f"layer norm output sp={sp}")
    _close(x.grad, seq(x_full.grad), f"layer norm input grad sp={sp}")
    # under SP each rank saw a sequence shard: f must have summed the parameter grads over TP
    _close(ln.weight.grad, ref.weight.grad, f"layer norm weight grad sp={sp}")
    _close(ln.bias.grad, ref.bias.grad, f"layer norm bias grad sp={sp}")


def check_cross_entropy(group, vocab_size, padded):
    gen = torch.Generator().manual_seed(5)
    full = (3 * torch.randn(S, B, padded, generator=gen)).requires_grad_()
    target = torch.randint(0, vocab_size, (S, B), generator=gen)
    grad_loss = torch.rand(S, B, generator=gen)
    ref = F.cross_entropy(full[..., :vocab_size].reshape(-1, vocab_size), target.reshape(-1),
                          reduction="none").view(S, B)
    ref.backward(grad_loss)
    logits = _slice(full, -1, group).detach().clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(logits, target, group, vocab_size=vocab_size)
    loss.backward(grad_loss)
    what = f"cross-entropy vocab {vocab_size} padded {padded}"
    _close(loss, ref.detach(), what)
    _close(logits.grad, _slice(full.grad, -1, group), what + " grad (padded columns zero)")


def check_bf16(group):
    """bf16 layers match the fp32 reference within bf16's documented tolerance (2e-2); the
    cross-entropy of bf16 logits is computed in fp32, so it matches to fp32 rounding."""
    gen = torch.Generator().manual_seed(8)
    ref1, ref2 = _randomize(nn.Linear(H, 4 * H), gen), _randomize(nn.Linear(4 * H, H), gen)
    x_full = torch.randn(S, B, H, generator=gen)
    col = ColumnParallelLinear(H, 4 * H, group, sequence_parallel=True, dtype=torch.bfloat16)
    row = RowParallelLinear(4 * H, H, group, sequence_parallel=True, dtype=torch.bfloat16)
    col.load_full_(weight=ref1.weight, bias=ref1.bias)
    row.load_full_(weight=ref2.weight, bias=ref2.bias)
    y = row(F.gelu(col(_slice(x_full, 0, group).bfloat16())))
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), _slice(ref2(F.gelu(ref1(x_full))), 0, group).detach(),
                               rtol=2e-2, atol=2e-2)
    full = (3 * torch.randn(S, B, 8 * group.size, generator=gen)).bfloat16()
    target = torch.randint(0, full.size(-1) - 1, (S, B), generator=gen)
    loss = vocab_parallel_cross_entropy(_slice(full, -1, group), target, group,
                                        vocab_size=full.size(-1) - 1)
    ref = F.cross_entropy(full[..., :-1].float().reshape(-1, full.size(-1) - 1), target.reshape(-1),
                          reduction="none").view(S, B)
    assert loss.dtype == torch.float32
    _close(loss, ref, "cross-entropy of bf16 logits (computed in fp32)")


def check_mappings(group):
    """Round trips of the split/gather operators and the SP reduce-scatter, forward and backward."""
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(S, B, H, generator=gen, requires_grad=True)
    g = torch.randn(S, B, H, generator=gen)
    for split, gather, dim in ((scatter_to_tp, gather_from_tp, -1),
                               (scatter_to_sequence, gather_from_sequence, 0)):
        part = split(x, group)
        _close(part, _slice(x, dim, group), f"{split.__name__} forward")
        y = gather(part, group)
        _close(y, x, f"{gather.__name__} forward")
        x.grad = None
        y.backward(g)
        # gather_from_sequence's backward reduce-scatters: the TP ranks' identical grads sum up
        scale = group.size if gather is gather_from_sequence else 1
        _close(x.grad, g * scale, f"{split.__name__}/{gather.__name__} backward")
    mine = (x * (group.rank + 1)).detach().requires_grad_()
    out = reduce_scatter_to_sequence(mine, group)
    total = group.size * (group.size + 1) // 2
    _close(out, _slice(x.detach() * total, 0, group), "reduce_scatter_to_sequence forward")
    out.backward(_slice(g, 0, group))
    _close(mine.grad, g, "reduce_scatter_to_sequence backward (all-gather)")


def check_init_independence(group):
    """Each layer's shards, gathered, equal the TP=1 layer built from the same seed and name."""
    col = ColumnParallelLinear(H, 2 * H, group, device="meta")
    row = RowParallelLinear(2 * H, H, group, device="meta")
    emb = VocabParallelEmbedding(4 * group.size, H, group, device="meta")
    assert col.weight.is_meta and row.weight.is_meta and emb.weight.is_meta
    gathered = {}
    for name, layer in (("col", col), ("row", row), ("emb", emb)):
        layer.to_empty(device="cpu")
        layer.init_weights(seed=7, std=0.02, prefix=f"{name}.")
        w = layer.weight.detach()
        gathered[name] = (_gather_rows(w.t(), group).t() if name == "row"
                          else _gather_rows(w, group))
    _close(gathered["col"], full_init("col.weight", (2 * H, H), 0.02, 7), "column init")
    _close(gathered["row"], full_init("row.weight", (H, 2 * H), 0.02, 7), "row init")
    assert torch.count_nonzero(row.bias) == 0
    return {k: v.sum().item() for k, v in gathered.items() if k != "emb"}


def check_ledger(state, sp, bias):
    """Column -> Row, forward + backward: one all-reduce of s*b*h each way on the tp group, or with
    SP one all-gather + one reduce-scatter forward and, backward, the same plus the re-gather of the
    column input that SP saves as a shard (and the SP bias's small all-reduce)."""
    group, ledger = state.tp, state.ledger
    col = ColumnParallelLinear(H, 4 * H, group, sequence_parallel=sp, bias=bias)
    row = RowParallelLinear(4 * H, H, group, sequence_parallel=sp, bias=bias)
    x = torch.randn(S // group.size if sp else S, B, H, requires_grad=True)
    ledger.reset()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
        hidden = col(x)
    assert (S, B, H) not in saved or not sp or group.size == 1, f"SP saved a gathered input {saved}"
    y = row(hidden)
    forward = [(r.group, r.op, r.numel) for r in ledger.records]
    ledger.reset()
    y.sum().backward()
    backward = [(r.group, r.op, r.numel) for r in ledger.records]
    ledger.reset()
    if group.size == 1:
        assert forward == backward == [], "a single-rank TP group must send nothing"
        return
    sbh = S * B * H
    if not sp:
        assert forward == [("tp", "all_reduce", sbh)], forward
        assert backward == [("tp", "all_reduce", sbh)], backward
        return
    assert forward == [("tp", "all_gather", sbh), ("tp", "reduce_scatter", sbh)], forward
    extra = [("tp", "all_reduce", H)] if bias else []   # d bias summed over sequence shards by f
    assert sorted(backward) == sorted([("tp", "all_gather", sbh), ("tp", "all_gather", sbh),
                                       ("tp", "reduce_scatter", sbh), *extra]), backward


def check_rng(group, tp_rank):
    from hybrid.tensor_parallel.random import RNGTracker
    tracker = RNGTracker(seed=11, tp_rank=tp_rank)
    tracker.seed_all()
    ones = torch.ones(64)
    default_mask = F.dropout(ones, 0.5)
    states = tracker.get_states()
    with tracker.fork():
        tp_mask = F.dropout(ones, 0.5)
    after_fork = F.dropout(ones, 0.5)          # the default stream resumed where it was
    tracker.set_states(states)
    with tracker.fork():
        replay = F.dropout(ones, 0.5)
    assert torch.equal(replay, tp_mask), "set_states did not reproduce the forked dropout mask"
    with tracker.fork():
        assert not torch.equal(F.dropout(ones, 0.5), tp_mask), "the TP stream did not advance"
    assert torch.equal(F.dropout(ones, 0.5), after_fork), "fork disturbed the default stream"
    defaults, forked = _gather_rows(default_mask[None], group), _gather_rows(tp_mask[None], group)
    assert all(torch.equal(d, defaults[0]) for d in defaults), "default masks differ across TP"
    assert len({tuple(f.tolist()) for f in forked}) == group.size, "forked masks repeat across TP"
    return default_mask.tolist()


def _all_checks_on(state):
    group, tp = state.tp, state.tp_size
    for sp in (False, True):
        check_mlp(group, sp)
        check_embedding(group, sp)
        check_layer_norm(group, sp)
        for bias in (False, True):
            check_ledger(state, sp, bias)
    check_column_gather_output(group)
    padded = 8 * tp
    vocabs = [padded, padded - 3] + ([padded - padded // tp - 1] if tp > 1 else [])
    for vocab in vocabs:  # divisible / padded / the last shard entirely padding
        check_cross_entropy(group, vocab, padded)
    check_mappings(group)
    check_bf16(group)
    init_sums = check_init_independence(group)
    dropout = check_rng(group, state.tp_rank)
    assert state.ledger.bytes("dp") == 0, "TP layers must not touch the dp group"
    return init_sums, dropout


def _all_checks(rank, world_size, tp):
    return _all_checks_on(ParallelState.initialize(Topology(world_size, tp, gpus_per_node=world_size)))


def test_tp1_matches_torch_and_sends_nothing():
    _all_checks_on(ParallelState.single_process())


@pytest.mark.parametrize("world_size,tp", [(4, 2), (4, 4)])
def test_tensor_parallel_matches_unsharded_torch(world_size, tp):
    results = run_on_ranks(_all_checks, world_size, args=(tp,))
    tp1_sums, _ = _all_checks_on(ParallelState.single_process())
    for init_sums, _ in results:
        assert init_sums == pytest.approx(tp1_sums, rel=1e-6), "init depends on the TP degree"
    masks = [dropout for _, dropout in results]
    assert all(m == masks[0] for m in masks), "default-stream dropout must match on all ranks (DP too)"


def test_meta_build_allocates_nothing_and_keeps_attributes():
    state = ParallelState.dry_run(Topology(32, 16, gpus_per_node=16), rank=5)
    col = ColumnParallelLinear(1024, 4096, state.tp, device="meta", sequence_parallel=True)
    row = RowParallelLinear(4096, 1024, state.tp, device="meta", sequence_parallel=True)
    emb = VocabParallelEmbedding(50304, 1024, state.tp, device="meta")
    assert (col.weight.shape, row.weight.shape, emb.weight.shape) == (
        (256, 1024), (1024, 256), (3144, 1024))
    assert all(p.is_meta for m in (col, row, emb) for p in m.parameters())
    row.to_empty(device="cpu")   # replaces the Parameter objects; the attributes must survive
    assert (row.weight.tensor_model_parallel, row.weight.partition_dim) == (True, 1)
    assert (row.bias.tensor_model_parallel, row.bias.partition_dim, row.bias.sequence_parallel) == (
        False, -1, True)
    assert (col.weight.partition_dim, col.weight.sequence_parallel) == (0, False)


def test_init_is_a_pure_function_of_seed_and_name():
    a = full_init("layers.0.mlp.weight", (6, 4), 0.02, seed=1)
    assert torch.equal(a, full_init("layers.0.mlp.weight", (6, 4), 0.02, seed=1))
    assert not torch.equal(a, full_init("layers.1.mlp.weight", (6, 4), 0.02, seed=1))
    assert not torch.equal(a, full_init("layers.0.mlp.weight", (6, 4), 0.02, seed=2))
    assert torch.equal(torch.cat([shard(a, 1, r, 2) for r in range(2)], dim=1), a)
    assert 0.015 < full_init("big", (256, 256), 0.02, 0).std().item() < 0.025


def test_bad_input_raises_clear_errors():
    group = ParallelState.dry_run(Topology(4, 4, gpus_per_node=4)).tp
    with pytest.raises(ValueError, match="not divisible by the tensor-parallel size 4"):
        ColumnParallelLinear(8, 6, group, device="meta")
    with pytest.raises(ValueError, match="not divisible"):
        shard(torch.zeros(6, 2), 0, 0, 4)
    single = ParallelState.single_process().tp
    emb = VocabParallelEmbedding(8, 4, single)
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 8\)"):
        emb(torch.tensor([[3, 8]]))
    with pytest.raises(ValueError, match="target ids must lie in"):
        vocab_parallel_cross_entropy(torch.zeros(2, 8), torch.tensor([1, 7]), single, vocab_size=6)
    with pytest.raises(ValueError, match="disagree"):
        vocab_parallel_cross_entropy(torch.zeros(2, 8), torch.tensor([1, 2, 3]), single)
