"""Autograd communication operators of tensor parallelism (Megatron-LM §3, Fig. 3; Korthikanti et al.
2022 "Reducing Activation Recomputation", §4.2.2, Fig. 5).

Megatron's MLP and attention blocks are bracketed by two conjugate operators:

* ``f`` (:func:`copy_to_tp`): identity forward, all-reduce backward - in front of a column-parallel
  linear, whose input gradient is a partial sum over the TP ranks.
* ``g`` (:func:`reduce_from_tp`): all-reduce forward, identity backward - after a row-parallel linear,
  whose output is a partial sum.

With sequence parallelism the activations between blocks are sharded along the sequence (dim 0 of the
``[s, b, h]`` layout), and the all-reduces split into their two halves:

* ``g-bar`` (:func:`gather_from_sequence`): all-gather dim 0 forward, reduce-scatter dim 0 backward -
  in front of a column-parallel linear.
* ``g`` of SP (:func:`reduce_scatter_to_sequence`): reduce-scatter dim 0 forward, all-gather dim 0
  backward - after a row-parallel linear.

Each public wrapper takes the TP :class:`~hybrid.comm.Group` explicitly; every collective goes
through :mod:`hybrid.comm`, so the ledger sees it. On a single-rank group every operator is the
identity and sends nothing.

Under ``torch.compile`` (regional compile of the layers, models/gpt/compile.py) an operator on a
group of several ranks runs eagerly, a graph break around it (:func:`apply_communicating`): the
ledger is Python bookkeeping per call, and the column-parallel backward waits on asynchronous handles
(docs/compile.md). On one rank the operators are traced with the rest of the layer.
"""

from __future__ import annotations

import torch

from hybrid import comm
from hybrid.comm import Group


# ---- primitives (no autograd) ----------------------------------------------------------------
def _all_reduce(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Sum of ``x`` over the group, in a fresh tensor (the input may be saved by autograd)."""
    if group.size == 1:
        return x
    out = x.contiguous().clone()
    comm.all_reduce(out, group)
    return out


def _check_divisible(x: torch.Tensor, dim: int, group: Group, what: str) -> int:
    size = x.size(dim)
    if size % group.size:
        raise ValueError(f"{what}: dimension {dim} of a {tuple(x.shape)} tensor has size {size}, "
                         f"not divisible by the tensor-parallel size {group.size}; pad it to a "
                         f"multiple of {group.size}")
    return size // group.size


def _split(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """This rank's contiguous slice of ``x`` along ``dim``."""
    if group.size == 1:
        return x
    part = _check_divisible(x, dim, group, "splitting across tensor-parallel ranks")
    return x.narrow(dim, group.rank * part, part).contiguous()


def _gather_first(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Concatenate every rank's ``x`` along dim 0: [n, ...] -> [n * tp, ...]."""
    if group.size == 1:
        return x
    out = torch.empty((x.size(0) * group.size, *x.shape[1:]), dtype=x.dtype, device=x.device)
    comm.all_gather_into(out, x.contiguous(), group)
    return out


def _gather_last(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Concatenate every rank's ``x`` along the last dim: [..., n] -> [..., n * tp]."""
    if group.size == 1:
        return x
    stacked = _gather_first(x.unsqueeze(0), group)           # [tp, ..., n]
    return torch.cat(stacked.unbind(0), dim=-1).contiguous()  # [..., tp * n]


def _reduce_scatter_first(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Sum over the group and keep this rank's slice of dim 0: [n * tp, ...] -> [n, ...]."""
    if group.size == 1:
        return x
    part = _check_divisible(x, 0, group, "reduce-scatter along the sequence")
    out = torch.empty((part, *x.shape[1:]), dtype=x.dtype, device=x.device)
    comm.reduce_scatter_into(out, x.contiguous(), group)
    return out


@torch.compiler.disable
def apply_eagerly(function, *args):
    """``function.apply(*args)`` always eagerly: a graph break under torch.compile."""
    return function.apply(*args)


def apply_communicating(function, *args, group: Group):
    """``function.apply(*args)`` for an autograd Function that communicates over ``group``: eager
    (a graph break under torch.compile) when the group has several ranks, traced when it has one."""
    if group.size == 1:
        return function.apply(*args)
    return apply_eagerly(function, *args)


# ---- autograd Functions ----------------------------------------------------------------------
class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split(x, -1, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_last(grad, ctx.group), None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _split(grad, -1, ctx.group), None


class _ScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split(x, 0, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_first(grad, ctx.group), None


class _GatherFromSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_first(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_first(grad, ctx.group), None


class _GatherSequenceReplicated(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_first(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _split(grad, 0, ctx.group), None


class _ReduceScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_first(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_first(grad, ctx.group), None


# ---- public wrappers -------------------------------------------------------------------------
def copy_to_tp(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Megatron ``f``: identity forward, all-reduce of the gradient backward."""
    return apply_communicating(_CopyToTP, x, group, group=group)


def reduce_from_tp(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Megatron ``g``: all-reduce forward, identity backward."""
    return apply_communicating(_ReduceFromTP, x, group, group=group)


def scatter_to_tp(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Keep this rank's slice of the last dim forward; all-gather the last dim backward."""
    return apply_communicating(_ScatterToTP, x, group, group=group)


def gather_from_tp(x: torch.Tensor, group: Group) -> torch.Tensor:
    """All-gather the last dim forward; keep this rank's slice of the gradient backward."""
    return apply_communicating(_GatherFromTP, x, group, group=group)


def scatter_to_sequence(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Enter the sequence-parallel region: keep this rank's slice of dim 0 (the sequence) forward,
    all-gather dim 0 backward. ``[s, b, h] -> [s/tp, b, h]``."""
    return apply_communicating(_ScatterToSequence, x, group, group=group)


def gather_from_sequence(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Megatron SP ``g-bar``: all-gather dim 0 forward, reduce-scatter dim 0 backward.
    ``[s/tp, b, h] -> [s, b, h]``; the incoming gradient is a partial sum over TP ranks."""
    return apply_communicating(_GatherFromSequence, x, group, group=group)


def gather_sequence_replicated(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Leave the sequence-parallel region for a replicated computation: all-gather dim 0 forward,
    keep this rank's slice of the gradient backward (every TP rank computed the same full gradient:
    Megatron's gather with ``tensor_parallel_output_grad=False``; the MoE router, issue 32)."""
    return apply_communicating(_GatherSequenceReplicated, x, group, group=group)


def reduce_scatter_to_sequence(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Megatron SP ``g``: reduce-scatter dim 0 forward, all-gather dim 0 backward.
    ``[s, b, h]`` (partial sums) ``-> [s/tp, b, h]`` (summed, this rank's sequence shard)."""
    return apply_communicating(_ReduceScatterToSequence, x, group, group=group)
