"""Vocab-parallel cross-entropy (Megatron-LM §3, "parallelizing the output embedding").

The output layer leaves the logits split by vocabulary, ``[..., V/tp]`` on each TP rank. Gathering
them would move ``s * b * V`` elements; instead each rank reduces its shard to a few numbers per token
and only those cross the TP group:

    m   = max_v z_v                          all-reduce(max)   [...]
    S   = sum_v exp(z_v - m)                 \\  one all-reduce(sum) of both, stacked: [2, ...]
    z_t = the target's (shifted) logit       /  (only the rank owning the target contributes)
    loss = log S - z_t

Backward needs no communication: d loss / d z_v = softmax_v - [v == t], computed on the local shard.

Columns ``>= vocab_size`` (padding that makes the vocabulary divisible by tp) are masked to ``-inf``, so
the result equals an unpadded ``F.cross_entropy`` and padded columns receive zero gradient.
"""

from __future__ import annotations

import torch

from hybrid import comm
from hybrid.comm import Group


def _mask_padding(logits: torch.Tensor, start: int, vocab_size: int | None) -> torch.Tensor:
    """Set the logits of columns ``start + j >= vocab_size`` to -inf."""
    local = logits.size(-1)
    if vocab_size is None or start + local <= vocab_size:
        return logits
    columns = torch.arange(start, start + local, device=logits.device)
    return logits.masked_fill(columns >= vocab_size, float("-inf"))


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, vocab_size):
        local_vocab = logits.size(-1)
        start = group.rank * local_vocab
        z = _mask_padding(logits, start, vocab_size)                   # [..., V/tp] input dtype
        z_max = z.amax(dim=-1).float()                                 # [...] (exact in any dtype)
        comm.all_reduce(z_max, group, op="max")
        z = z - z_max.unsqueeze(-1)   # [..., V/tp] fp32: the cast to fp32 in the same pass

        outside = (target < start) | (target >= start + local_vocab)   # target owned elsewhere
        local_target = (target - start).masked_fill(outside, 0)
        target_logit = z.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)

        exp_z = z.exp_()                                               # reuse the buffer
        stats = torch.stack([exp_z.sum(dim=-1), target_logit])         # [2, ...]
        comm.all_reduce(stats, group)
        sum_exp, target_logit = stats[0], stats[1]

        softmax = exp_z.div_(sum_exp.unsqueeze(-1))                    # [..., V/tp]
        ctx.save_for_backward(softmax, local_target, outside)
        ctx.logits_dtype, ctx.used = logits.dtype, False
        return torch.log(sum_exp) - target_logit                       # [...] fp32

    @staticmethod
    def backward(ctx, grad_loss):
        if ctx.used:
            raise RuntimeError("a second backward through the vocab-parallel cross-entropy "
                               "(retain_graph) is not supported: its first backward turned the "
                               "saved softmax into the gradient; run the forward again")
        ctx.used = True
        softmax, local_target, outside = ctx.saved_tensors
        grad = softmax   # d loss / d z = p - onehot, in the softmax's buffer (as Megatron does)
        hit = (~outside).to(grad.dtype).unsqueeze(-1)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -hit)
        scale = grad_loss.unsqueeze(-1)
        if ctx.logits_dtype == grad.dtype:
            return grad.mul_(scale), None, None, None
        # bf16/fp16 logits: product in fp32, rounded once as it is written (one pass, not two)
        out = torch.empty_like(grad, dtype=ctx.logits_dtype)
        return torch.mul(grad, scale, out=out), None, None, None


def vocab_parallel_cross_entropy(logits_shard: torch.Tensor, target: torch.Tensor, group: Group, *,
                                 vocab_size: int | None = None) -> torch.Tensor:
    """Per-token cross-entropy ``[...]`` (fp32) from vocab-sharded logits ``[..., V_padded/tp]``.

    ``target [...]`` holds global token ids in ``[0, vocab_size)``; ``vocab_size`` is the true
    vocabulary (None: no padding). Equal to ``F.cross_entropy(full_logits[..., :vocab_size], target,
    reduction="none")`` without ever gathering the logits.
    """
    if logits_shard.shape[:-1] != target.shape:
        raise ValueError(f"logits {tuple(logits_shard.shape)} and targets {tuple(target.shape)} "
                         f"disagree: logits must be targets' shape plus a vocabulary dimension")
    padded = logits_shard.size(-1) * group.size
    if vocab_size is not None and not 0 < vocab_size <= padded:
        raise ValueError(f"vocab_size {vocab_size} must be in [1, {padded}] (the padded vocabulary "
                         f"of {group.size} shards of {logits_shard.size(-1)} logits)")
    if target.device.type == "cpu" and target.numel():
        limit = padded if vocab_size is None else vocab_size
        if int(target.min()) < 0 or int(target.max()) >= limit:
            raise ValueError(f"target ids must lie in [0, {limit}); got [{int(target.min())}, "
                             f"{int(target.max())}] (mask ignored positions with a loss mask instead)")
    return _VocabParallelCrossEntropy.apply(logits_shard, target, group, vocab_size)
