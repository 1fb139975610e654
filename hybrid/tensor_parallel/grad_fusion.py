"""Gradient-accumulation fusion: weight gradients summed straight into the gradient buffer (the
"gradient accumulation fusion" of Megatron-LM's linear layers, Narayanan et al. 2021 §4; here on
CPU as well).

Autograd hands every weight gradient to the parameter's ``AccumulateGrad`` node, which adds it to
``param.grad`` (``grad += new``): after the GEMM has written a weight-sized gradient, one more pass
over the weight's size per backward. The embedding is worse: its lookup gradient is a zero-filled
``[V, h]`` table with a few rows set, added whole, and a tied word embedding first sums that table
with the output layer's ``[V, h]`` gradient. Where an engine has a buffer for them, the products go
there directly (the engines attach a :class:`GradTarget` per parameter with :func:`allow`):
``param.grad`` itself where it views the engine's gradient buffer for the whole step (ZeRO stages 0
and 1: :class:`OwnGrad`, zeroed between steps), or the parameter's slot of the staging bucket that
would otherwise receive a copy of ``param.grad`` (stage 2, :mod:`hybrid.zero.reducer`). The
column- and row-parallel linears and the output layer write their weight gradient's product in
place into a buffer still zero (``torch.mm(..., out=...)``) and add it into one holding a sum
(``addmm_`` in fp32 and on GPUs; on CPU a 16-bit ``addmm_`` is slower than the product and an add,
measured, so those two); the embedding's lookup adds its per-token rows into the rows of the table
that the tokens touch. The autograd Function then returns no gradient for the weight, and autograd
still runs the parameter's post-accumulate hooks (the engines' bucket counting).

Exactness: into a zeroed buffer (a step's first micro-batch; stage 2's every micro-batch, each
staged afresh) the result is bit-equal to autograd's, in fp32 and bf16 (the product written in
place is the product; the lookup sums a token's rows in autograd's order, then adds them once, as
autograd adds its summed gradient once). Later micro-batches of stages 0 and 1 are bit-equal too in
16-bit on CPU but for a tied embedding table (the output layer's product and the lookup's rows are
added one after the other, autograd adds their sum); fp32's ``addmm_`` rounds such a sum once
instead of twice. Whatever adds first, fused product or autograd, the target records that the
buffer no longer holds zeros, so a product is never written over a sum.

Not used, so autograd's path runs unchanged: while ``torch.compile`` traces (the compiled layers'
weight gradients are graph outputs), for stage 3 (its hooks take the gradients of parameters
gathered for the layer), and where the buffer's dtype differs from the product's (``torch.autocast``
over fp32 parameters). A parameter with a target gets no gradient from ``torch.autograd.grad``: the
engines only call ``backward``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_ALLOWED = "_hybrid_grad_accumulation_fusion"
_HOOKED = "_hybrid_grad_accumulation_fusion_hooked"


class GradTarget:
    """Where the weight-gradient products of one parameter go during a backward; an engine
    attaches one per parameter with :func:`allow`. ``zeroed``: the buffer still holds the zeros
    its owner wrote, so the first product may be written over it instead of added (a 16-bit
    ``addmm_`` on CPU is slower than the product and an add, measured)."""

    zeroed: bool = True

    def buffer(self, param: torch.Tensor) -> torch.Tensor | None:
        """The ``param``-shaped tensor to accumulate into now (None: autograd's path)."""
        raise NotImplementedError

    def written(self) -> None:
        """A product has been written or added into the buffer."""
        self.zeroed = False


class OwnGrad(GradTarget):
    """``param.grad`` itself, a view of a buffer the owner keeps for the whole step and zeroes
    (:func:`zeroed`) between steps (ZeRO stages 0 and 1). Any accumulation into it, fused or
    autograd's (seen by :func:`_after_accumulate`), ends ``zeroed``."""

    def buffer(self, param: torch.Tensor) -> torch.Tensor | None:
        return param.grad

    def cleared(self) -> None:
        """The owner has zeroed the buffer."""
        self.zeroed = True


def _after_accumulate(param: torch.Tensor) -> None:
    """Post-accumulate hook (one per parameter, whichever engine attached its target last):
    autograd added into ``param.grad``, so an :class:`OwnGrad` buffer no longer holds zeros."""
    target = getattr(param, _ALLOWED, None)
    if isinstance(target, OwnGrad):
        target.written()


def allow(params, targets=None, enabled: bool = True) -> None:
    """Attach to each of ``params`` its :class:`GradTarget` (``targets``, one per parameter;
    default: :class:`OwnGrad`, whose buffers must be zero now); ``enabled`` False detaches."""
    params = list(params)
    targets = list(targets) if targets is not None else [OwnGrad() for _ in params]
    for p, target in zip(params, targets):
        setattr(p, _ALLOWED, target if enabled else None)
        if enabled and isinstance(target, OwnGrad) and not getattr(p, _HOOKED, False):
            p.register_post_accumulate_grad_hook(_after_accumulate)   # once, not per engine
            setattr(p, _HOOKED, True)


def zeroed(params) -> None:
    """The owner has zeroed the ``param.grad`` buffers of ``params`` (their :class:`OwnGrad`)."""
    for p in params:
        target = getattr(p, _ALLOWED, None)
        if isinstance(target, OwnGrad):
            target.cleared()


def accumulation_param(weight: torch.Tensor) -> torch.Tensor | None:
    """In a forward: ``weight`` if its backward may accumulate into its gradient buffer, else None.
    (Decided in forward so that a traced graph never reads ``.grad``.)"""
    if torch.compiler.is_compiling() or getattr(weight, _ALLOWED, None) is None:
        return None
    return weight


def _buffer(param: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """In a backward: the buffer of ``param`` to accumulate ``dtype`` products into."""
    target = None if param is None else getattr(param, _ALLOWED, None)
    grad = None if target is None else target.buffer(param)
    if grad is None or grad.dtype != dtype or grad.shape != param.shape:
        return None
    return grad


def weight_grad(param: torch.Tensor | None, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor | None:
    """``a @ b`` (``[out, tokens] @ [tokens, in]``), or, where ``param`` (from
    :func:`accumulation_param`) has a buffer, that product added into it and None returned."""
    buffer = _buffer(param, a.dtype)
    if buffer is None:
        return a.matmul(b)
    target = getattr(param, _ALLOWED)
    if target.zeroed:                          # the product itself, written in place
        torch.mm(a, b, out=buffer)
    elif buffer.dtype == torch.float32 or buffer.device.type != "cpu":
        buffer.addmm_(a, b)                    # rounded once
    else:                                      # 16-bit on CPU: autograd's add, bit for bit
        buffer.add_(a.matmul(b))
    target.written()
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
        getattr(ctx.param, _ALLOWED).written()
        return None, None, None


def embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.embedding(ids, weight)``; its gradient goes straight into the weight's buffer where
    :func:`allow` permits it."""
    param = accumulation_param(weight)
    if param is None or not torch.is_grad_enabled() or not weight.requires_grad:
        return F.embedding(ids, weight)
    return _EmbeddingLookup.apply(ids, weight, param)
