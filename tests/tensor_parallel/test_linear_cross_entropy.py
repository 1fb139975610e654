"""The output layer fused with the vocab-parallel cross-entropy
(hybrid/tensor_parallel/linear_cross_entropy.py) against the separate path it replaces
(``column_parallel_linear`` then ``vocab_parallel_cross_entropy``, itself checked against fp64
``F.cross_entropy`` in tests/tensor_parallel/test_cross_entropy_blocks.py) and against fp64 directly.

- Per-token gradients that are powers of two (a mean over 2^k tokens, a loss scale): the row scale
  is exact, so the loss and the input and weight gradients must be BIT-EQUAL to the separate path's
  in fp32 and bf16, at TP 1 and 2, with and without sequence parallelism, with padding columns and a
  shard of padding only. fp16 (whose small scaled values fall into its subnormal range, where a
  power of two no longer scales exactly) must agree within one fp16 unit of the largest entry.
- Arbitrary per-token gradients: the loss within 1e-5 of fp64 ``F.cross_entropy`` over the true
  vocabulary of the logits rounded as the GEMM rounds them; both gradients within a few roundings
  of the dtype of fp64 autograd through ``x @ w.T``.
- Backward only reads what forward saved: a second backward gives the same gradients.
The block of rows is made tiny so that several blocks and a partial last block run at test sizes.
"""

import pytest
import torch
import torch.nn.functional as F

from hybrid.parallel_state import ParallelState
from hybrid.tensor_parallel import cross_entropy
from hybrid.tensor_parallel import (column_parallel_linear, linear_cross_entropy,
                                    vocab_parallel_cross_entropy)
from hybrid.testing.multirank import run_on_ranks
from hybrid.topology import Topology

S, B, H, PADDED = 12, 3, 16, 96     # 36 tokens: blocks of 2 rows end with a full one, 4 with a partial
BLOCK_ELEMENTS = 200
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ROUNDING = {torch.float32: 1e-5, torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}


def _inputs(dtype, vocab_size, power_of_two_grads):
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(S, B, H, generator=gen).to(dtype)
    w = (0.5 * torch.randn(PADDED, H, generator=gen)).to(dtype)
    target = torch.randint(0, vocab_size, (S, B), generator=gen)
    if power_of_two_grads:
        grad_loss = 2.0 ** torch.randint(-3, 2, (S, B), generator=gen).float()
    else:
        grad_loss = torch.rand(S, B, generator=gen) + 0.05
    return x, w, target, grad_loss


def _shards(group, sp, x, w):
    """This rank's x (its sequence shard under SP) and vocab rows of w, as leaves."""
    rows = PADDED // group.size
    w_local = w[group.rank * rows:(group.rank + 1) * rows]
    x_local = x.chunk(group.size)[group.rank] if sp else x
    return x_local.clone().requires_grad_(), w_local.clone().requires_grad_()


def _run(fused, group, sp, x, w, target, grad_loss, vocab_size):
    x, w = _shards(group, sp, x, w)
    if fused:
        loss = linear_cross_entropy(x, w, target, group, sequence_parallel=sp, vocab_size=vocab_size)
    else:
        logits = column_parallel_linear(x, w, None, group, sp)
        loss = vocab_parallel_cross_entropy(logits, target, group, vocab_size=vocab_size)
    loss.backward(grad_loss)
    return loss.detach(), x.grad, w.grad


def _vocabs(tp):
    """No padding, a partly padded last shard and (tp > 1) a last shard of padding only."""
    return [PADDED, PADDED - 5] + ([PADDED - PADDED // tp - 3] if tp > 1 else [])


def check_bit_equal(group, sp):
    for dtype in DTYPES:
        for vocab_size in _vocabs(group.size):
            inputs = _inputs(dtype, vocab_size, power_of_two_grads=True)
            fused = _run(True, group, sp, *inputs, vocab_size)
            separate = _run(False, group, sp, *inputs, vocab_size)
            for name, a, b in zip(("loss", "input gradient", "weight gradient"), fused, separate):
                if dtype == torch.float16 and name != "loss":
                    limit = ROUNDING[dtype] * b.abs().max()
                    assert (a.double() - b.double()).abs().max() <= limit, f"fp16 {name} differs"
                    continue
                assert a.dtype == b.dtype and torch.equal(a, b), (
                    f"{name} differs: {dtype} vocab {vocab_size} tp {group.size} sp {sp}, largest "
                    f"difference {(a.double() - b.double()).abs().max().item():.3e}")


def check_against_fp64(group, sp):
    for dtype in DTYPES:
        for vocab_size in _vocabs(group.size):
            x, w, target, grad_loss = _inputs(dtype, vocab_size, power_of_two_grads=False)
            loss, grad_x, grad_w = _run(True, group, sp, x, w, target, grad_loss, vocab_size)
            x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
            logits = (x64 @ w64.t())[..., :vocab_size]
            # the GEMM rounds the logits into the dtype: the reference loss does too (gradient
            # straight through)
            logits = logits + (logits.to(dtype).double() - logits).detach()
            ref = F.cross_entropy(logits.reshape(-1, vocab_size), target.reshape(-1),
                                  reduction="none").view(S, B)
            ref.backward(grad_loss.double())
            ref_x, ref_w = _shards(group, sp, x64.grad, w64.grad)
            what = f"{dtype} vocab {vocab_size} tp {group.size} sp {sp}"
            torch.testing.assert_close(loss.double(), ref.detach(), rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"{what} loss: {m}")
            for name, got, want in (("input", grad_x, ref_x), ("weight", grad_w, ref_w)):
                error = (got.double() - want.detach()).abs().max()
                bound = 4 * ROUNDING[dtype] * want.abs().max()
                assert error <= bound, f"{what} {name} gradient off by {error:.3e} (bound {bound:.3e})"
            real = max(0, vocab_size - group.rank * (PADDED // group.size))
            assert not grad_w[real:].any(), f"{what}: padding rows of the weight got a gradient"


def _check_all(group):
    for sp in ((False, True) if group.size > 1 else (False,)):
        check_bit_equal(group, sp)
        check_against_fp64(group, sp)


def test_fused_matches_separate_path_single_rank(monkeypatch):
    monkeypatch.setattr(cross_entropy, "_BLOCK_ELEMENTS", BLOCK_ELEMENTS)
    _check_all(ParallelState.single_process().tp)


def _rank_checks(rank, world_size):
    cross_entropy._BLOCK_ELEMENTS = BLOCK_ELEMENTS      # this spawned rank's process only
    _check_all(ParallelState.initialize(Topology(world_size, world_size, gpus_per_node=world_size)).tp)


def test_fused_matches_separate_path_tensor_parallel():
    run_on_ranks(_rank_checks, world_size=2)


def test_second_backward_gives_the_same_gradients():
    group = ParallelState.single_process().tp
    x, w, target, grad_loss = _inputs(torch.bfloat16, PADDED - 5, power_of_two_grads=False)
    x, w = x.requires_grad_(), w.requires_grad_()
    loss = linear_cross_entropy(x, w, target, group, vocab_size=PADDED - 5)
    loss.backward(grad_loss, retain_graph=True)
    first = (x.grad.clone(), w.grad.clone())
    x.grad = w.grad = None
    loss.backward(grad_loss)
    assert torch.equal(x.grad, first[0]) and torch.equal(w.grad, first[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inside_a_compiled_model_it_runs_eagerly_and_exactly(monkeypatch, dtype):
    """torch.compile of a whole model traced into the fused loss: with several row blocks AOT
    autograd's functionalization of its in-place passes gave a wrong fp32 loss (0.5 off) and
    gradients; it now breaks the graph and runs as in eager mode, bit for bit."""
    monkeypatch.setattr(cross_entropy, "_BLOCK_ELEMENTS", BLOCK_ELEMENTS)
    torch._dynamo.reset()
    group = ParallelState.single_process().tp
    x, w, target, grad_loss = _inputs(dtype, PADDED - 5, power_of_two_grads=False)

    def loss_of(x, w):
        return linear_cross_entropy(torch.tanh(x), w, target, group, vocab_size=PADDED - 5)
    results = []
    for run in (loss_of, torch.compile(loss_of, backend="aot_eager")):
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        loss = run(xs, ws)
        loss.backward(grad_loss)
        results.append((loss.detach(), xs.grad, ws.grad))
    for name, eager, compiled in zip(("loss", "input gradient", "weight gradient"), *results):
        assert torch.equal(eager, compiled), f"{name} differs under torch.compile"


def test_mismatched_targets_are_refused_with_the_shapes():
    group = ParallelState.single_process().tp
    x, w, target, _ = _inputs(torch.float32, PADDED, power_of_two_grads=False)
    with pytest.raises(ValueError, match=r"hidden states \(12, 3, 16\) and targets \(3, 12\)"):
        linear_cross_entropy(x, w, target.t(), group)
    with pytest.raises(ValueError, match=r"target ids must lie in \[0, 90\)"):
        linear_cross_entropy(x, w, torch.full((S, B), 95), group, vocab_size=90)
