"""FP8 linear layers: ``Y = X W^T + b`` with the three GEMMs of forward and backward in fp8 through
``torch._scaled_mm`` (issue 36 item 4; recipes and scales: :mod:`.fp8_scaling`, docs/fp8.md).

Forward casts X ``[M, K]`` and W ``[N, K]`` to E4M3 with the recipe's scales and runs
``_scaled_mm`` with the input's dtype (bf16) as output; backward casts the output gradient dY
``[M, N]`` (E5M2 with ``--fp8-format hybrid``, E4M3 with ``e4m3``) and runs ``dX = dY W`` and
``dW = dY^T X`` through ``_scaled_mm`` too; the bias gradient is summed in fp32. The parameters, their
gradients, the masters and the optimizer are untouched: the fp8 copies live only inside one call.

What backward keeps: with one scale per tensor (``tensorwise``, ``delayed``) the fp8 X and W of the
forward and their scales (half the bytes of a bf16 input); with ``rowwise`` the high-precision X
and W, because backward scales them along the other dimension.

Tensor parallelism (Megatron-LM §3): the column-parallel linear splits W's rows (N), the
row-parallel one W's columns and X's (K). Every amax that covers a split dimension is maxed over
the TP group (a 4-byte all-reduce per tensor, an ``[M]``/``[K]`` one for rowwise), so every rank
casts with the scales a single device would use for the whole tensors: a TP run casts the same
values to the same fp8 numbers as one device (tests/tensor_parallel/test_fp8_linear.py). The
column-parallel fp8 linear takes its input through ``f`` (``g-bar`` under sequence parallelism) as
a separate step, without the overlap of the bf16 path's backward collective with the
weight-gradient GEMM (hybrid/tensor_parallel/async_linear.py).

Delayed scaling keeps its amax histories as a buffer of :class:`Fp8Scaling` (one per linear,
``[3, history]``: input, weight, output gradient; newest first). It is not saved in checkpoints
(a non-persistent buffer): a resumed run starts with empty histories, whose first call falls back
to the current amax, as the first step of a run does. Only training-mode calls push an amax.

Shapes: on CUDA ``_scaled_mm`` needs K, N and the tokens M to be multiples of 16 (the trainer checks
the model's shapes, pretrain/sections.py); the CPU kernel takes any shape.
"""

from __future__ import annotations

import torch
from torch import nn

from hybrid import comm
from hybrid.comm import Group
from hybrid.tensor_parallel.fp8_scaling import (Fp8Recipe, amax, history_amax, push_history,
                                                quantize, scale_from_amax)
from hybrid.tensor_parallel.mappings import apply_communicating

INPUT, WEIGHT, GRAD = 0, 1, 2   # rows of the delayed-scaling history


class Fp8Scaling(nn.Module):
    """The FP8 state of one linear layer: its :class:`Fp8Recipe` and, for delayed scaling, the amax
    histories ``amax_history [3, L]`` fp32 (a non-persistent buffer; module docstring)."""

    def __init__(self, recipe: Fp8Recipe, device=None):
        super().__init__()
        self.recipe = recipe
        if recipe.recipe == "delayed":
            self.register_buffer("amax_history", torch.zeros(3, recipe.amax_history_len,
                                                             dtype=torch.float32, device=device),
                                 persistent=False)
        else:
            self.amax_history = None

    def tensor_scale(self, t: torch.Tensor, role: int, dtype: torch.dtype, group: Group | None,
                     record: bool) -> torch.Tensor:
        """The 0-dim scale of ``t`` (``tensorwise`` or ``delayed``); ``group``: max the amax over it
        (``t`` is split across its ranks); ``record``: push the amax into the history (delayed)."""
        a = _shared_amax(t, None, group)
        r = self.recipe
        if self.amax_history is not None:
            history = self.amax_history[role]
            past = history_amax(history, r.amax_compute_algo)
            used = torch.where(past > 0, past, a)          # empty history: the current amax
            if record:
                with torch.no_grad():
                    push_history(history, a)
            a = used
        return scale_from_amax(a, dtype, r.margin)

    def extra_repr(self) -> str:
        r = self.recipe
        extra = (f", history={r.amax_history_len}, algo={r.amax_compute_algo}"
                 if r.recipe == "delayed" else "")
        return f"format={r.format}, recipe={r.recipe}{extra}"


def _shared_amax(t: torch.Tensor, dim: int | None, group: Group | None) -> torch.Tensor:
    a = amax(t, dim)
    if group is not None and group.size > 1:
        comm.all_reduce(a, group, op="max")
    return a


def _axis_scale(t: torch.Tensor, dim: int, dtype: torch.dtype, group: Group | None,
                margin: int) -> torch.Tensor:
    """rowwise: power-of-two scales of 2-D ``t`` along ``dim`` (1: one per row, 0: per column)."""
    return scale_from_amax(_shared_amax(t, dim, group), dtype, margin, power_of_two=True)


def scaled_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
              out_dtype: torch.dtype) -> torch.Tensor:
    """``(a / scale_a) @ (b / scale_b)`` for fp8 ``a [M, K]``, ``b [K, N]`` and their scales (0-dim,
    or ``[M, 1]`` and ``[1, N]``) via ``torch._scaled_mm``, which takes the inverse scales, a
    row-major ``a`` and a column-major ``b`` (cuBLASLt's layout; the CPU kernel accepts both)."""
    a = a.contiguous()
    if not b.t().is_contiguous():
        b = b.t().contiguous().t()
    return torch._scaled_mm(a, b, scale_a=scale_a.reciprocal().contiguous(),
                            scale_b=scale_b.reciprocal().contiguous(), out_dtype=out_dtype)


class _Fp8LinearFn(torch.autograd.Function):
    """``split``: which dimension of the GEMM the TP group splits: "N" (column-parallel: W's rows,
    dY's columns), "K" (row-parallel: X's and W's columns) or None (module docstring)."""

    @staticmethod
    def forward(ctx, x, weight, bias, scaling, group, split):
        r = scaling.recipe
        fwd = r.forward_dtype
        x2 = x.reshape(-1, x.size(-1))                                     # [M, K]
        on_k = group if split == "K" else None
        ctx.scaling, ctx.group, ctx.split = scaling, group, split
        ctx.has_bias, ctx.out_dtype, ctx.w_dtype = bias is not None, x.dtype, weight.dtype
        if r.recipe == "rowwise":
            sx = _axis_scale(x2, 1, fwd, on_k, r.margin)                   # [M, 1]
            sw = _axis_scale(weight, 1, fwd, on_k, r.margin)               # [N, 1]
            y = scaled_mm(quantize(x2, sx, fwd), quantize(weight, sw, fwd).t(), sx, sw.t(),
                          x.dtype)
            ctx.save_for_backward(x2, weight)
        else:
            record = scaling.training
            sx = scaling.tensor_scale(x2, INPUT, fwd, on_k, record)
            sw = scaling.tensor_scale(weight, WEIGHT, fwd, group if split else None, record)
            xq, wq = quantize(x2, sx, fwd), quantize(weight, sw, fwd)      # [M, K], [N, K]
            y = scaled_mm(xq, wq.t(), sx, sw, x.dtype)                     # [M, N]
            ctx.save_for_backward(xq, wq, sx, sw)
        y = y.view(*x.shape[:-1], weight.size(0))
        return y if bias is None else y + bias

    @staticmethod
    def backward(ctx, grad):
        scaling, group = ctx.scaling, ctx.group
        r = scaling.recipe
        gd = r.grad_dtype
        g2 = grad.reshape(-1, grad.size(-1))                               # [M, N]
        on_n = group if ctx.split == "N" else None
        grad_x = grad_w = grad_b = None
        if r.recipe == "rowwise":
            x2, weight = ctx.saved_tensors
            if ctx.needs_input_grad[0]:                                    # dX = dY W
                sg = _axis_scale(g2, 1, gd, on_n, r.margin)                # [M, 1]
                sw = _axis_scale(weight, 0, r.forward_dtype, on_n, r.margin)   # [1, K]
                grad_x = scaled_mm(quantize(g2, sg, gd), quantize(weight, sw, r.forward_dtype),
                                   sg, sw, ctx.out_dtype)
            if ctx.needs_input_grad[1]:                                    # dW = dY^T X
                sg = _axis_scale(g2, 0, gd, None, r.margin)                # [1, N]
                sx = _axis_scale(x2, 0, r.forward_dtype, None, r.margin)   # [1, K]
                grad_w = scaled_mm(quantize(g2, sg, gd).t(), quantize(x2, sx, r.forward_dtype),
                                   sg.t(), sx, ctx.w_dtype)
        else:
            xq, wq, sx, sw = ctx.saved_tensors
            sg = scaling.tensor_scale(g2, GRAD, gd, on_n, scaling.training)
            gq = quantize(g2, sg, gd)                                      # [M, N]
            if ctx.needs_input_grad[0]:
                grad_x = scaled_mm(gq, wq, sg, sw, ctx.out_dtype)          # [M, K]
            if ctx.needs_input_grad[1]:
                grad_w = scaled_mm(gq.t(), xq, sg, sx, ctx.w_dtype)        # [N, K]
        if grad_x is not None:
            grad_x = grad_x.view(*grad.shape[:-1], grad_x.size(-1))
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = g2.sum(dim=0, dtype=torch.float32).to(ctx.w_dtype)
        return grad_x, grad_w, grad_b, None, None, None


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               scaling: Fp8Scaling, group: Group | None = None, split: str | None = None):
    """``x [*, K] @ weight[N, K]^T + bias`` with fp8 GEMMs (module docstring). ``group`` and
    ``split`` ("N": column-parallel shard, "K": row-parallel shard) make the amaxes of split
    tensors the TP group's maxima; no other communication happens here."""
    if split not in (None, "N", "K"):
        raise ValueError(f"split must be None, 'N' or 'K', got {split!r}")
    if group is None or group.size == 1 or split is None:
        return _Fp8LinearFn.apply(x, weight, bias, scaling, None, None)
    return apply_communicating(_Fp8LinearFn, x, weight, bias, scaling, group, split, group=group)
