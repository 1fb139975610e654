"""Vocab-parallel cross-entropy (Megatron-LM §3, "parallelizing the output embedding").

The output layer leaves the logits split by vocabulary, ``[..., V/tp]`` on each TP rank. Gathering
them would move ``s * b * V`` elements; instead each rank reduces its shard to a few numbers per token
and only those cross the TP group:

    m   = max_v z_v                          all-reduce(max)   [...]
    S   = sum_v exp(z_v - m)                 \\  one all-reduce(sum) of both, stacked: [2, ...]
    z_t = the target's (shifted) logit       /  (only the rank owning the target contributes)
    loss = log S - z_t

Backward needs no communication: d loss / d z_v = softmax_v - [v == t], computed on the local shard.

Columns ``>= vocab_size`` (padding that makes the vocabulary divisible by tp) are left out of every
reduction, so the result equals an unpadded ``F.cross_entropy`` and padded columns receive zero
gradient.

Cost on a CPU. A ``[tokens, V/tp]`` fp32 intermediate (16 MiB at 512 x 8192) does not fit in a core's
L2 cache, so every full-size elementwise pass over it is memory bound. The forward therefore walks the
logits in blocks of rows whose fp32 working copy is about one L2 cache (:data:`_BLOCK_ELEMENTS`) and
reads them once: each block gives its rows' local max ``m_r`` and ``S_r = sum exp(z - m_r)``; after
the max all-reduce, ``S_r * exp(m_r - m)`` rescales them to the global max (the online-softmax
identity), so the two collectives are unchanged. What backward works from depends on the dtype:

- fp32 logits: the forward writes ``exp(z - m_r)`` into a tensor of the logits' size, which autograd
  keeps (the same bytes as a fp32 softmax); backward scales it by ``grad * exp(m_r - m) / S`` in
  place, subtracts ``grad`` at the target and returns it (one pass, no new allocation);
- bf16/fp16 logits: autograd keeps the logits themselves (half the bytes of a fp32 softmax: 8 MiB
  instead of 16 MiB at 512 x 8192) and two floats a token; backward recomputes
  ``exp(z - m) * grad / S`` block by block in fp32, subtracts ``grad`` at the target and rounds each
  block once into the logits' dtype (a mixed-dtype ``mul(out=)`` would take a slow scalar path).

Because the fp32 backward consumes what it saved, a second backward through the same graph is refused
with a clear error, in every dtype alike (one contract).

``exp`` is taken as ``exp2(x * log2 e)``: PyTorch's vectorised ``exp2`` is about three times faster
than its ``exp`` on CPU, and the extra rounding of ``x * log2 e`` (``x = z - m <= 0``) changes
``exp(x)`` by at most ``|x| * 2**-24`` relative, 2.2e-8 at most in absolute terms. Against fp64, the
fp32 gradient's largest error is no larger than that of an ``exp``-then-divide softmax, and bf16/fp16
gradients round to the same values in all but about 1e-4 of the entries (one unit in the last place).
"""

from __future__ import annotations

import itertools
import math
from typing import NamedTuple

import torch

from hybrid import comm
from hybrid.comm import Group

# Rows per block are chosen so a block of fp32 logits holds about this many elements (2 MiB, one
# core's L2 cache here). Measured on the benchmark GPT's [512, 8192] and GPT-2 small's [256, 50304]
# logits, one thread (forward + backward): smaller blocks lose more to the per-operation overhead than
# they gain in cache hits (64K elements: 40-60% slower), and whole-tensor passes are memory bound
# (15-30% slower at [512, 8192], 1.8-2.9 times slower at [256, 50304]).
# Accelerators take all rows at once (one kernel per operation).
_BLOCK_ELEMENTS = 1 << 19
_LOG2_E = 1.0 / math.log(2.0)


def _rows_per_block(n: int, width: int, device: torch.device) -> int:
    """Rows per block for ``n`` rows of ``width`` logits."""
    if device.type != "cpu":
        return max(n, 1)
    return max(1, _BLOCK_ELEMENTS // max(width, 1))


def _exp_shifted(source: torch.Tensor, shift: torch.Tensor, work: torch.Tensor) -> torch.Tensor:
    """``work <- exp(source - shift)``: ``source`` fp32 [r, v] (may be ``work`` itself), ``shift``
    [r, 1]; returns ``work``."""
    return torch.sub(source, shift, out=work).mul_(_LOG2_E).exp2_()


def _as_fp32(source: torch.Tensor, work: torch.Tensor) -> torch.Tensor:
    """``source`` if it is fp32, else its copy into ``work`` (one vectorised conversion)."""
    return source if source.dtype == torch.float32 else work.copy_(source)


def _local_max_and_sum(z: torch.Tensor, exps: torch.Tensor | None,
                       finish=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of ``z [n, v]`` (any float dtype): its max ``m_r`` and ``sum exp(z - m_r)``, fp32 [n].

    ``exps [n, v]`` fp32, if given, receives ``exp(z - m_r)`` (it may be z itself); otherwise each
    block is computed in a scratch buffer. ``finish(block, work, rows, block_sum)``, if given, runs on
    each block while it is in cache: ``block`` is z's rows ``rows`` (a slice), ``work`` their
    exponentials in fp32 (``block`` itself for fp32 z and ``exps`` = z), ``block_sum`` [rows] their
    sums. A row of only -inf gets ``m_r`` = the lowest finite float and a sum of 0, so rescaling it
    to the global max gives 0 instead of NaN.
    """
    n, width = z.shape
    step = _rows_per_block(n, width, z.device)
    row_max = torch.empty(n, 1, device=z.device)                         # [n, 1] fp32
    row_sum = torch.empty(n, device=z.device)                            # [n] fp32
    if exps is None:   # every block in one scratch buffer [rows, v] fp32, in cache
        works = itertools.repeat(torch.empty(min(step, n), width, device=z.device))
    else:
        works = exps.split(step)
    lowest = torch.finfo(torch.float32).min
    blocks = zip(z.split(step), works, row_max.split(step), row_sum.split(step))
    for i, (source, work, block_max, block_sum) in enumerate(blocks):
        work = work[: source.size(0)]
        block = _as_fp32(source, work)
        torch.amax(block, dim=-1, keepdim=True, out=block_max).clamp_min_(lowest)
        torch.sum(_exp_shifted(block, block_max, work), dim=-1, out=block_sum)
        if finish is not None:
            finish(source, work, slice(i * step, i * step + source.size(0)), block_sum)
    return row_max.squeeze(-1), row_sum


def real_columns(local_vocab: int, start: int, vocab_size: int | None) -> int:
    """How many of a shard's ``local_vocab`` columns, the first at global column ``start``, are
    real vocabulary: a prefix, since padding only ever ends the last shards."""
    return local_vocab if vocab_size is None else max(0, min(local_vocab, vocab_size - start))


class LossStatistics(NamedTuple):
    """Per token (fp32 [n] unless said): the global max ``z_max``, ``sum_exp`` = sum exp(z - z_max)
    over every rank's shard, ``target_logit`` = z_target - z_max, this rank's column of the target
    (``local_target``, int64, 0 where another rank owns it: ``outside``), and ``rescale`` =
    exp(local max - z_max), which turns exponentials taken at the local max into global ones."""

    z_max: torch.Tensor
    sum_exp: torch.Tensor
    target_logit: torch.Tensor
    local_target: torch.Tensor
    outside: torch.Tensor
    rescale: torch.Tensor


def loss_statistics(z: torch.Tensor, flat_target: torch.Tensor, group: Group, start: int, valid: int,
                    exps: torch.Tensor | None = None) -> LossStatistics:
    """The softmax statistics of this rank's real columns ``z [n, valid]`` (starting at global
    column ``start``) and the tokens' targets, with the two TP all-reduces (max, then the stacked
    sums and target logits). ``exps``, if given, receives ``exp(z - local max)`` (it may be z
    itself, for fp32 z)."""
    n = z.size(0)
    outside = (flat_target < start) | (flat_target >= start + valid)  # target owned elsewhere
    local_target = (flat_target - start).masked_fill(outside, 0)
    # the targets' logits first: ``exps`` may be z itself
    target_logit = (z.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).float() if valid
                    else torch.zeros(n, device=z.device))
    if valid:
        local_max, local_sum = _local_max_and_sum(z, exps)
    else:   # a shard of padding only: it contributes nothing
        local_max = torch.full((n,), float("-inf"), device=z.device)
        local_sum = torch.zeros(n, device=z.device)
    z_max = local_max.clone()
    comm.all_reduce(z_max, group, op="max")
    target_logit = (target_logit - z_max).masked_fill(outside, 0.0)
    rescale = (local_max - z_max).exp_()                          # [n] <= 1; exactly 1 at tp 1
    stats = torch.stack([local_sum * rescale, target_logit])       # [2, n]
    comm.all_reduce(stats, group)
    return LossStatistics(z_max, stats[0], stats[1], local_target, outside, rescale)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, vocab_size):
        local_vocab = logits.size(-1)
        start = group.rank * local_vocab
        valid = real_columns(local_vocab, start, vocab_size)
        z = logits.reshape(-1, local_vocab)[:, :valid]                  # [n, valid] input dtype
        n = z.size(0)

        # fp32 logits: keep exp(z - m_r) [n, V/tp] (the logits' own size, padding columns 0), which
        # backward turns into the gradient in place; narrower logits are kept themselves (half the
        # bytes of a fp32 softmax) and backward recomputes the exponentials from them
        keep_exps = logits.dtype == torch.float32
        kept = torch.empty(n, local_vocab, device=z.device) if keep_exps else logits
        if keep_exps:
            kept[:, valid:].zero_()
        stats = loss_statistics(z, target.reshape(-1), group, start, valid,
                                kept[:, :valid] if keep_exps else None)
        ctx.save_for_backward(kept, stats.rescale if keep_exps else stats.z_max, stats.sum_exp,
                              stats.local_target, stats.outside)
        ctx.keep_exps, ctx.valid, ctx.logits_shape, ctx.used = keep_exps, valid, logits.shape, False
        return (torch.log(stats.sum_exp) - stats.target_logit).view(target.shape)   # [...] fp32

    @staticmethod
    def backward(ctx, grad_loss):
        if ctx.used:
            raise RuntimeError("a second backward through the vocab-parallel cross-entropy "
                               "(retain_graph) is not supported: its first backward turned what "
                               "it saved into the gradient; run the forward again")
        ctx.used = True
        kept, shift_or_rescale, sum_exp, local_target, outside = ctx.saved_tensors
        shape, valid = ctx.logits_shape, ctx.valid
        grad_loss = grad_loss.reshape(-1).float()                       # [n]
        target_grad = grad_loss.masked_fill(outside, 0.0)
        if ctx.keep_exps:    # exp(z - m_r) * grad * exp(m_r - m) / S, in the buffer it came in
            grad = kept
            if valid:
                grad[:, :valid].mul_((grad_loss * shift_or_rescale / sum_exp).unsqueeze(-1))
                grad[:, :valid].scatter_add_(-1, local_target.unsqueeze(-1), -target_grad.unsqueeze(-1))
            return grad.view(shape), None, None, None
        grad = torch.empty(local_target.size(0), shape[-1], dtype=kept.dtype, device=kept.device)
        grad[:, valid:].zero_()                                         # padding columns
        if valid:
            z = kept.reshape(-1, shape[-1])[:, :valid]                  # [n, valid]
            _write_gradient(grad[:, :valid], z, shift_or_rescale, grad_loss / sum_exp,
                            local_target, target_grad)
        return grad.view(shape), None, None, None


def _write_gradient(grad, z, z_max, scale, local_target, target_grad):
    """``grad [n, v] <- exp(z - m) * scale - target_grad at the target column``, rows in blocks.

    ``scale = grad_loss / S`` and ``target_grad = grad_loss`` (0 where another rank owns the
    target), fp32 [n]. Each block is computed in fp32 and rounded once into ``grad``'s dtype.
    """
    n, width = z.shape
    step = _rows_per_block(n, width, z.device)
    buffer = torch.empty(min(step, n), width, device=z.device)          # [rows, v] fp32, in cache
    per_row = (t.unsqueeze(-1).split(step) for t in (z_max, scale, local_target, target_grad.neg()))
    for out, block, shift, factor, column, minus_target in zip(grad.split(step), z.split(step), *per_row):
        work = buffer[: out.size(0)]
        _exp_shifted(work.copy_(block), shift, work).mul_(factor)
        work.scatter_add_(-1, column, minus_target)
        out.copy_(work)


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
    check_targets(target, padded, vocab_size)
    return _VocabParallelCrossEntropy.apply(logits_shard, target, group, vocab_size)


def check_targets(target: torch.Tensor, padded: int, vocab_size: int | None) -> None:
    """Target ids outside ``[0, vocab_size)`` (the padded vocabulary when None) would read a padding
    column or another array; refused with the range found (checked where it is free: on the host)."""
    if target.device.type == "cpu" and target.numel():
        limit = padded if vocab_size is None else vocab_size
        if int(target.min()) < 0 or int(target.max()) >= limit:
            raise ValueError(f"target ids must lie in [0, {limit}); got [{int(target.min())}, "
                             f"{int(target.max())}] (mask ignored positions with a loss mask instead)")
