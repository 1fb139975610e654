"""Gradient-accumulation fusion: weight gradients summed straight into the gradient buffer (the
"gradient accumulation fusion" of Megatron-LM's linear layers, Narayanan et al. 2021 §4; here on
CPU as well).

Autograd hands every weight gradient to the parameter's ``AccumulateGrad`` node, which adds it to
``param.grad`` (``grad += new``): after the GEMM has written a weight-sized gradient, one more pass
over the weight's size per backward. The embedding is worse: its lookup gradient is a zero-filled
``[V, h]`` table with a few rows set, added whole, and a tied word embedding first sums that table
with the output layer's ``[V, h]`` gradient. Where an engine keeps ``param.grad`` as a view of its
gradient buffer for the whole step (ZeRO stages 0 and 1, which call :func:`allow` and
:func:`zeroed`), the products go there directly: into a buffer still zero the weight gradient's GEMM
writes its product in place (``torch.mm(..., out=grad)``), into one holding a sum it adds
(``addmm_`` in fp32 and on GPUs; on CPU a 16-bit ``addmm_`` is slower than the product and an add,
measured, so those two), for the column- and row-parallel linears and the output layer; the
embedding's lookup adds its per-token rows into the rows of the table that the tokens touch. The
autograd Function then returns no gradient for the weight, and autograd still runs the parameter's
post-accumulate hooks (the engines' bucket counting) with ``param.grad`` already holding the sum.

Exactness: on a zeroed buffer (a step's first micro-batch) the result is bit-equal to autograd's,
in fp32 and bf16 (the product written in place is the product; the lookup sums a token's rows in
autograd's order, then adds them once, as autograd adds its summed gradient once), and so are later
16-bit micro-batches on CPU but for a tied embedding table (the output layer's product and the
lookup's rows are added one after the other, autograd adds their sum); fp32's ``addmm_`` rounds a
later micro-batch's sum once instead of twice.
Whatever adds first, fused product or autograd, a post-accumulate hook records that the buffer no
longer holds zeros, so a product is never written over a sum.

Not used, so autograd's path runs unchanged: while ``torch.compile`` traces (the compiled layers'
weight gradients are graph outputs), for parameters of engines that stage or partition gradients
(stages 2 and 3: ``param.grad`` is None during backward), and where the buffer's dtype differs from
the product's (``torch.autocast`` over fp32 parameters). A parameter that :func:`allow` marked gets
no gradient from ``torch.autograd.grad``: the engines only call ``backward``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_ALLOWED = "_hybrid_grad_accumulation_fusion"


class _BufferState:
    """Whether a parameter's buffer still holds the zeros its owner wrote (so the first product
    may overwrite it instead of adding: a 16-bit ``addmm_`` on CPU is slower than the product and
    a separate add, measured) or a sum already."""

    def __init__(self):
        self.zeroed = True

    def after_accumulate(self, param: torch.Tensor) -> None:
        """Post-accumulate hook: autograd (or a fused product) has added into the buffer."""
        if getattr(param, _ALLOWED, None) is self:
            self.zeroed = False


def allow(params, enabled: bool = True) -> None:
    """Mark ``params`` (whose buffers are zero now): their ``param.grad``, while set, is a buffer
    the weight-gradient products may accumulate into; the owner calls :func:`zeroed` whenever it
    zeroes them."""
    for p in params:
        state = _BufferState() if enabled else None
        setattr(p, _ALLOWED, state)
        if state is not None:   # any accumulation into it, fused or autograd's, ends "zeroed"
            p.register_post_accumulate_grad_hook(state.after_accumulate)


def zeroed(params) -> None:
    """The owner has zeroed the buffers of ``params``."""
    for p in params:
        state = getattr(p, _ALLOWED, None)
        if state is not None:
            state.zeroed = True


def accumulation_param(weight: torch.Tensor) -> torch.Tensor | None:
    """In a forward: ``weight`` if its backward may accumulate into its gradient buffer, else None.
    (Decided in forward so that a traced graph never reads ``.grad``.)"""
    if torch.compiler.is_compiling() or getattr(weight, _ALLOWED, None) is None:
        return None
    return weight


def _buffer(param: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """In a backward: the gradient buffer of ``param`` to accumulate ``dtype`` products into."""
    grad = None if param is None else param.grad
    if grad is None or grad.dtype != dtype or grad.shape != param.shape:
        return None
    return grad


def weight_grad(param: torch.Tensor | None, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor | None:
    """``a @ b`` (``[out, tokens] @ [tokens, in]``), or, where ``param`` (from
    :func:`accumulation_param`) has a buffer, that product added into it and None returned."""
    buffer = _buffer(param, a.dtype)
    if buffer is None:
        return a.matmul(b)
    state = getattr(param, _ALLOWED)
    if state.zeroed:                           # the product itself, written in place
        torch.mm(a, b, out=buffer)
    elif buffer.dtype == torch.float32 or buffer.device.type != "cpu":
        buffer.addmm_(a, b)                    # rounded once
    else:                                      # 16-bit on CPU: autograd's add, bit for bit
        buffer.add_(a.matmul(b))
    state.zeroed = False
    return None


class _Linear(torch.autograd.Function):
    """``F.linear(x, weight)`` (no bias) whose weight gradient is added into ``param``'s buffer."""

    @staticmethod
    def forward(ctx, x, weight, param):
        ctx.save_for_backward(x, weight)
        ctx.param = param
        return F.linear(x, weight)                                    # [*, out]

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_x = grad.matmul(weight) if ctx.needs_input_grad[0] else None   # [*, in]
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = weight_grad(ctx.param, grad.reshape(-1, grad.size(-1)).t(),
                                      x.reshape(-1, x.size(-1)))
        return grad_x, grad_weight, None


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, weight)``; the weight gradient goes straight into its buffer where
    :func:`allow` permits it."""
    param = accumulation_param(weight)
    if (param is None or not torch.is_grad_enabled() or not weight.requires_grad
            or torch.is_autocast_enabled(x.device.type)):   # autocast: F.linear casts, autograd's path
        return F.linear(x, weight)
    return _Linear.apply(x, weight, param)


class _EmbeddingLookup(torch.autograd.Function):
    """``F.embedding(ids, weight)`` whose backward adds into ``param``'s buffer (module docstring)."""

    @staticmethod
    def forward(ctx, ids, weight, param):
        ctx.save_for_backward(ids)
        ctx.param, ctx.table_shape = param, weight.shape
        return F.embedding(ids, weight)                               # [*, h]

    @staticmethod
    def backward(ctx, grad):
        ids, = ctx.saved_tensors
        rows = grad.reshape(-1, grad.size(-1))                        # [tokens, h]
        buffer = _buffer(ctx.param, grad.dtype)
        if buffer is None:   # what autograd's embedding backward returns, bit for bit
            table = grad.new_zeros(ctx.table_shape)
            return None, table.index_put_((ids.reshape(-1),), rows, accumulate=True), None
        # each id's rows summed as autograd's backward sums them, then added to the buffer once
        touched, slot = ids.reshape(-1).unique(return_inverse=True)
        sums = rows.new_zeros(touched.numel(), rows.size(1)).index_put_((slot,), rows, accumulate=True)
        buffer.index_put_((touched,), sums, accumulate=True)
        return None, None, None


def embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.embedding(ids, weight)``; its gradient goes straight into the weight's buffer where
    :func:`allow` permits it."""
    param = accumulation_param(weight)
    if param is None or not torch.is_grad_enabled() or not weight.requires_grad:
        return F.embedding(ids, weight)
    return _EmbeddingLookup.apply(ids, weight, param)
