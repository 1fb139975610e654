"""The vocab-parallel cross-entropy's block-wise passes against ``F.cross_entropy`` (Megatron-LM §3).

Forward and backward walk the logits in blocks of rows (hybrid/tensor_parallel/cross_entropy.py);
the block is made tiny here so that several blocks, a partial last block, padding columns, a shard
of padding only and -inf logits are all exercised at test sizes. The reference is ``F.cross_entropy``
on fp64 copies of the unsharded, unpadded logits:

- the loss (fp32 in every dtype) within 1e-6 relative;
- fp32 logits: the gradient within 1e-6 of the largest gradient entry;
- bf16/fp16 logits: the gradient is the fp32 one rounded once, so each entry is within half a unit in
  the last place of the reference (2**-8 relative for bf16, 2**-11 for fp16), plus fp32 rounding
  and, for fp16, the smallest subnormal.
"""

import pytest
import torch
import torch.nn.functional as F

from hybrid.parallel_state import ParallelState
from hybrid.tensor_parallel import cross_entropy
from hybrid.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from hybrid.testing.multirank import run_on_ranks
from hybrid.topology import Topology

ROWS, PADDED = 37, 96          # 37 rows: blocks of a few rows end with a partial one
BLOCK_ELEMENTS = 200           # rows per block: 2 at width 96, 4 at width 48
HALF_ULP = {torch.float32: 0.0, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}


def _reference(full, target, grad_loss, vocab_size):
    """fp64 loss [rows] and gradient [rows, PADDED] (zero in padding columns)."""
    x = full[:, :vocab_size].double().requires_grad_()
    loss = F.cross_entropy(x, target, reduction="none")
    loss.backward(grad_loss.double())
    grad = torch.zeros(full.shape, dtype=torch.float64)
    grad[:, :vocab_size] = x.grad
    return loss.detach(), grad


def check_against_torch(group, dtype, vocab_size):
    gen = torch.Generator().manual_seed(3)
    full = (4 * torch.randn(ROWS, PADDED, generator=gen)).to(dtype)
    full[1, 1::3] = float("-inf")          # masked logits: zero probability and zero gradient
    target = torch.randint(0, vocab_size, (ROWS,), generator=gen)
    target[1] = 0
    grad_loss = torch.rand(ROWS, generator=gen)
    local = PADDED // group.size
    columns = slice(group.rank * local, (group.rank + 1) * local)
    shard = full[:, columns].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(shard, target, group, vocab_size=vocab_size)
    loss.backward(grad_loss)
    ref_loss, ref_grad = _reference(full, target, grad_loss, vocab_size)
    ref_grad = ref_grad[:, columns]
    what = f"{dtype} vocab {vocab_size} tp {group.size} rank {group.rank}"
    assert loss.dtype == torch.float32 and shard.grad.dtype == dtype
    torch.testing.assert_close(loss.double(), ref_loss, rtol=1e-6, atol=0, msg=lambda m: f"{what}: {m}")
    error = (shard.grad.double() - ref_grad).abs()
    if dtype == torch.float32:
        bound = 1e-6 * ref_grad.abs().max()
    else:
        bound = (HALF_ULP[dtype] + 1e-6) * ref_grad.abs() + (2.0 ** -24 if dtype == torch.float16 else 0.0)
    bound = bound.expand_as(error)
    worst = (error - bound).argmax()
    assert bool((error <= bound).all()), (f"{what}: gradient entry {worst.item()} off by "
                                    f"{error.flatten()[worst].item():.3e} (allowed {bound.flatten()[worst]:.3e})")
    assert not shard.grad[:, max(0, vocab_size - group.rank * local):].any(), f"{what}: padding gradient"


def _vocabs(tp):
    """No padding, a partly padded last shard and (tp > 1) a last shard of padding only."""
    return [PADDED, PADDED - 5] + ([PADDED - PADDED // tp - 3] if tp > 1 else [])


def _check_all(group):
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for vocab_size in _vocabs(group.size):
            check_against_torch(group, dtype, vocab_size)


def test_blocks_match_torch_single_rank(monkeypatch):
    monkeypatch.setattr(cross_entropy, "_BLOCK_ELEMENTS", BLOCK_ELEMENTS)
    _check_all(ParallelState.single_process().tp)


def _rank_checks(rank, world_size, tp):
    cross_entropy._BLOCK_ELEMENTS = BLOCK_ELEMENTS      # this spawned rank's process only
    _check_all(ParallelState.initialize(Topology(world_size, tp, gpus_per_node=world_size)).tp)


@pytest.mark.parametrize("tp", [2])
def test_blocks_match_torch_tensor_parallel(tp):
    run_on_ranks(_rank_checks, world_size=tp, args=(tp,))
