"""Column-parallel linear with the input-gradient collective overlapped with the weight-gradient GEMM
(Megatron-LM's asynchronous tensor-parallel all-reduce; Narayanan et al. 2021 §4; with sequence
parallelism the collective is SP's reduce-scatter, Korthikanti et al. 2022 §4.2.2).

Semantically this is ``F.linear(f(x), W, b)`` (``f`` = copy_to_tp) or ``F.linear(g_bar(x), W, b)``
with sequence parallelism. The difference is scheduling: in backward the input gradient ``dX = dY W``
is computed first and its all-reduce (or reduce-scatter) is started asynchronously; ``dW = dY^T X``
and ``db`` are computed while it is in flight, and only then the collective is waited on. On gloo the
collective runs on a background thread; on NCCL on its stream.

With sequence parallelism only this rank's input shard ``[s/tp, b, in]`` is saved for backward, not
the all-gathered ``[s, b, in]`` (Korthikanti et al. §4.2.2: this is what makes the activation memory
``(sbh/t)(34 + 5as/h)``); backward all-gathers it again, overlapped with the ``dX`` GEMM. So per
column-parallel linear SP moves one all-gather forward and one all-gather + one reduce-scatter
backward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybrid import comm
from hybrid.comm import Group
from hybrid.tensor_parallel import grad_fusion
from hybrid.tensor_parallel.mappings import _gather_first, apply_communicating


def _start_input_grad_reduction(grad_total: torch.Tensor, group: Group, sequence_parallel: bool):
    """Launch the sum of the partial input gradient over TP: all-reduce ``[s, b, in]`` or, with SP,
    reduce-scatter to this rank's sequence shard ``[s/tp, b, in]``. Returns (result, handle)."""
    if group.size == 1:
        return grad_total, None
    grad_total = grad_total.contiguous()
    if not sequence_parallel:
        return grad_total, comm.all_reduce(grad_total, group, async_op=True)
    if grad_total.size(0) % group.size:
        raise ValueError(f"sequence length {grad_total.size(0)} is not divisible by the "
                         f"tensor-parallel size {group.size}")
    shard = torch.empty((grad_total.size(0) // group.size, *grad_total.shape[1:]),
                        dtype=grad_total.dtype, device=grad_total.device)
    return shard, comm.reduce_scatter_into(shard, grad_total, group, async_op=True)


def _start_input_regather(x: torch.Tensor, ctx):
    """Under SP, launch the all-gather of the saved input shard, needed only for ``dW``.
    Returns (full input ``[s, b, in]``, handle or None)."""
    group = ctx.group
    if not (ctx.sequence_parallel and group.size > 1 and ctx.needs_input_grad[1]):
        return x, None
    total = torch.empty((x.size(0) * group.size, *x.shape[1:]), dtype=x.dtype, device=x.device)
    return total, comm.all_gather_into(total, x.contiguous(), group, async_op=True)


def _autocast_inputs(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """Under ``torch.autocast`` cast the GEMM's operands to the autocast dtype here, so what
    backward reads (saved in that dtype) has one dtype; autograd casts the returned gradients
    back to the parameters' dtype."""
    device = x.device.type
    if not torch.is_autocast_enabled(device):
        return x, weight, bias
    dtype = torch.get_autocast_dtype(device)
    return x.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype)


def overlapped_backward(ctx, x: torch.Tensor, input_grad, param_grads) -> tuple:
    """The column-parallel backward's schedule (module docstring), for any op of that shape:
    under SP launch the all-gather of the saved input shard ``x``; compute the partial input
    gradient ``input_grad(total)`` ``[s, b, in]``; start its all-reduce (SP: reduce-scatter); compute
    ``param_grads(total)`` (a tuple: weight, bias, ...) from the whole input ``total`` while the
    collective is in flight; wait. ``ctx`` carries ``group``, ``sequence_parallel`` and
    ``needs_input_grad`` (0: the input, 1: the weight). Returns ``(grad_input, *param_grads)``."""
    total, gather = _start_input_regather(x, ctx)                 # [s, b, in] for dW
    grad_total = input_grad(total) if ctx.needs_input_grad[0] else None
    if gather is not None:
        gather.wait()
    grad_input = handle = None
    if grad_total is not None:
        grad_input, handle = _start_input_grad_reduction(grad_total, ctx.group, ctx.sequence_parallel)
    grads = param_grads(total)                                    # overlaps the collective
    if handle is not None:
        handle.wait()
    return (grad_input, *grads)


class _ColumnParallelLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, group, sequence_parallel):
        ctx.grad_param = grad_fusion.accumulation_param(weight)       # dW added into its .grad
        x, weight, bias = _autocast_inputs(x, weight, bias)
        total = _gather_first(x, group) if sequence_parallel else x   # [s, b, in]
        ctx.save_for_backward(x, weight)                              # SP: the shard only
        ctx.group, ctx.sequence_parallel, ctx.has_bias = group, sequence_parallel, bias is not None
        return F.linear(total, weight, bias)                          # [s, b, out/tp]

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_2d = grad.reshape(-1, grad.size(-1))                     # [s*b, out/tp]

        def param_grads(total):
            grad_weight = grad_bias = None
            if ctx.needs_input_grad[1]:
                grad_weight = grad_fusion.weight_grad(                # [out/tp, in] or None
                    ctx.grad_param, grad_2d.t(), total.reshape(-1, total.size(-1)))
            if ctx.has_bias and ctx.needs_input_grad[2]:
                grad_bias = grad_2d.sum(dim=0)
            return grad_weight, grad_bias
        grad_input, grad_weight, grad_bias = overlapped_backward(
            ctx, x, lambda total: grad.matmul(weight), param_grads)   # dX [s, b, in], partial
        return grad_input, grad_weight, grad_bias, None, None


def column_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                           group: Group, sequence_parallel: bool) -> torch.Tensor:
    """``Y = f(X) W^T + b`` (``g-bar(X)`` with SP) with the backward collective overlapped.
    x ``[s, b, in]`` (``[s/tp, b, in]`` with SP), weight ``[out/tp, in]`` -> ``[s, b, out/tp]``."""
    return apply_communicating(_ColumnParallelLinearFn, x, weight, bias, group, sequence_parallel,
                               group=group)
