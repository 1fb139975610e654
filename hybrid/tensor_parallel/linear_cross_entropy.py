"""The output layer and the vocab-parallel cross-entropy as one operation (Megatron-LM §3's
"parallelizing the output embedding", with the loss's gradient formed in forward).

``loss = CE(X W^T, target)`` with ``W`` this rank's vocab shard ``[V/tp, h]`` and ``X`` the final
hidden states (``f(X)``, or ``g-bar(X)`` with sequence parallelism, as in
:mod:`hybrid.tensor_parallel.async_linear`). The gradient of the per-token loss ``l_t`` with respect
to the logits is ``d l_t / d z = P_t`` with ``P = softmax(z) - onehot(target)``: it does not depend
on the incoming gradient ``g_t = d L / d l_t`` except through a factor per row. So the forward, which
walks the logits anyway (:mod:`hybrid.tensor_parallel.cross_entropy`), writes ``P`` over them in
place, and backward never touches a ``[tokens, V/tp]`` tensor outside the two GEMMs:

    dX = diag(g) (P W)           the row scale applied to the [tokens, h] product
    dW = P^T (diag(g) X)         the row scale applied to the [tokens, h] input

Against a separate output GEMM and cross-entropy this saves the cross-entropy's backward pass, which
recomputes the exponentials of 16-bit logits block by block (or scales the kept fp32 ones), and an
fp32 copy of the logits at the forward's peak (``P`` lives in the logits' own buffer). At one TP rank
the forward is a single pass over the logits; with several ranks it needs the all-reduced maximum and
sum before it can normalise: fp32 logits then hold their exponentials after the first pass and are
scaled in place, 16-bit ones get a second pass (the one the separate backward made).

Precision: ``P`` is rounded once into the logits' dtype (as the separate path rounds its logit
gradient), and the two row-scaled ``[tokens, h]`` operands once more. Where the per-token gradient is
a power of two (a mean over a power-of-two token count, times a loss scale) the row scale is exact and
the loss and both gradients are bit-equal to the separate path's (tested); otherwise they differ by
that one rounding.

Unlike the separate cross-entropy, backward only reads what it saved: a second backward (retain_graph)
gives the same gradient again.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybrid.comm import Group
from hybrid.tensor_parallel import grad_fusion
from hybrid.tensor_parallel.async_linear import _autocast_inputs, overlapped_backward
from hybrid.tensor_parallel.cross_entropy import (_local_max_and_sum, _write_gradient,
                                                  check_targets, loss_statistics, real_columns)
from hybrid.tensor_parallel.mappings import _gather_first, apply_eagerly


def _softmax_minus_target_in_place(z: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor,
                                                                                     torch.Tensor]:
    """One pass over ``z [n, v]`` (one TP rank: every target is local): ``z <- softmax(z) - onehot``
    in place, each block finished in fp32 while in cache and rounded once into z's dtype. Returns
    each row's max and ``sum exp(z - max)``, fp32 [n]."""
    columns = target.unsqueeze(-1)                                    # [n, 1]
    minus_one = torch.full(columns.shape, -1.0, device=z.device)

    def finish(block, work, rows, block_sum):
        work.mul_(block_sum.reciprocal().unsqueeze(-1)).scatter_add_(-1, columns[rows],
                                                                     minus_one[rows])
        if work.data_ptr() != block.data_ptr():                      # 16-bit z: round it back
            block.copy_(work)
    return _local_max_and_sum(z, z if z.dtype == torch.float32 else None, finish)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, target, group, sequence_parallel, vocab_size):
        ctx.grad_param = grad_fusion.accumulation_param(weight)       # dW added into its .grad
        x, weight, _ = _autocast_inputs(x, weight, None)
        total = _gather_first(x, group) if sequence_parallel else x   # [s, b, h]
        logits = F.linear(total, weight)                              # [s, b, V/tp]
        local_vocab = logits.size(-1)
        z_all = logits.view(-1, local_vocab)                          # [n, V/tp], P is written here
        start = group.rank * local_vocab
        valid = real_columns(local_vocab, start, vocab_size)
        z = z_all[:, :valid]
        flat_target = target.reshape(-1)
        if group.size == 1:   # one pass: the local max and sum are the global ones
            target_logit = z.gather(-1, flat_target.unsqueeze(-1)).squeeze(-1).float()
            z_max, sum_exp = _softmax_minus_target_in_place(z, flat_target)
            loss = torch.log(sum_exp) - (target_logit - z_max)        # rounded as the separate path
        else:
            # fp32: the first pass leaves exp(z - local max) in z, so P is one scaling away;
            # 16-bit: a second pass recomputes the exponentials at the global max
            in_place = z.dtype == torch.float32
            stats = loss_statistics(z, flat_target, group, start, valid, z if in_place else None)
            owned = (~stats.outside).float().unsqueeze(-1)             # [n, 1]: 1 at a local target
            if valid and in_place:
                z.mul_((stats.rescale / stats.sum_exp).unsqueeze(-1))
                z.scatter_add_(-1, stats.local_target.unsqueeze(-1), owned.neg())
            elif valid:   # P = exp(z - m) / S - [owned target]
                _write_gradient(z, z, stats.z_max, stats.sum_exp.reciprocal(), stats.local_target,
                                owned.squeeze(-1))
            loss = torch.log(stats.sum_exp) - stats.target_logit
        z_all[:, valid:].zero_()                                      # padding columns: no gradient
        ctx.save_for_backward(x, weight, logits)                      # SP: x is this rank's shard
        ctx.group, ctx.sequence_parallel = group, sequence_parallel
        return loss.view(target.shape)                                # [s, b] fp32

    @staticmethod
    def backward(ctx, grad_loss):
        x, weight, p = ctx.saved_tensors
        row_scale = grad_loss.reshape(-1, 1).float()                  # [n, 1]
        p = p.view(-1, p.size(-1))                                    # [n, V/tp]

        def input_grad(total):                                        # [s, b, h], partial over TP
            return torch.mul(p.matmul(weight), row_scale).to(p.dtype).view(total.shape)

        def param_grads(total):
            if not ctx.needs_input_grad[1]:
                return (None,)
            rows = torch.mul(total.reshape(-1, total.size(-1)), row_scale).to(p.dtype)
            return (grad_fusion.weight_grad(ctx.grad_param, p.t(), rows),)   # [V/tp, h] or None
        grad_input, grad_weight = overlapped_backward(ctx, x, input_grad, param_grads)
        return grad_input, grad_weight, None, None, None, None


def linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, group: Group, *,
                         sequence_parallel: bool = False,
                         vocab_size: int | None = None, check_ids: bool = True) -> torch.Tensor:
    """Per-token cross-entropy ``[s, b]`` (fp32) of the vocab-parallel logits ``X W^T`` without
    keeping them: x ``[s, b, h]`` (``[s/tp, b, h]`` with SP), weight ``[V_padded/tp, h]``, target
    ``[s, b]`` global ids in ``[0, vocab_size)``. Equal to
    ``vocab_parallel_cross_entropy(column_parallel_linear(x, weight, None, group, sp), target, ...)``."""
    rows = x.size(0) * (group.size if sequence_parallel else 1)
    if (rows, *x.shape[1:-1]) != tuple(target.shape):
        raise ValueError(f"hidden states {tuple(x.shape)} and targets {tuple(target.shape)} disagree: "
                         f"targets must be [s, b] for hidden states [s{'/tp' if sequence_parallel else ''}"
                         f", b, h]")
    if check_ids:   # off where the data loader checked the ids on the host (issue 36)
        check_targets(target, weight.size(0) * group.size, vocab_size)
    # Always eager, a graph break under torch.compile (of a whole model; --compile compiles the
    # layers only): AOT autograd's functionalization of the in-place passes over row blocks of
    # the logits (fp32 writes exp(z - m) over z through its split views) gave wrong losses and
    # gradients once there were several blocks (tests/tensor_parallel/test_linear_cross_entropy.py)
    return apply_eagerly(_LinearCrossEntropy, x, weight, target, group, sequence_parallel,
                         vocab_size)
