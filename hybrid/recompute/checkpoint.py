"""The recompute autograd Function: activation checkpointing (Chen et al. 2016), Megatron's full and
selective recompute (Korthikanti et al. 2022, §5) and ZeRO-R's Pa / Pa+cpu (ZeRO §6.1).

``checkpoint(fn, x, *rest, rng=..., store=...)`` runs ``fn`` in forward without recording a graph
(nothing inside ``fn`` is saved for backward), keeps only its inputs, and in backward

1. gets the first input back from its :class:`~hybrid.recompute.partitioned.CheckpointStore`
   (whole, all-gathered across TP for Pa, fetched from the host tier for Pa+cpu),
2. restores the RNG states captured at forward time - the default generator and the TP-region
   generator of :class:`~hybrid.tensor_parallel.random.RNGTracker` (``get_states``/``set_states``) -
   so every dropout mask is identical to the forward one,
3. reruns ``fn`` with autograd on and backpropagates through it; parameter gradients accumulate
   as usual (so ZeRO's gradient hooks see them), input gradients are returned.

Without a store every tensor input is saved by autograd (selective recompute of the attention core
keeps q, k, v, exactly what the activation model of that paper counts).
"""

from __future__ import annotations

from typing import Callable

import torch

from hybrid.recompute.partitioned import CheckpointStore


class TorchRNG:
    """Fallback RNG capture when no ``RNGTracker`` is given: the default CPU generator (and every
    CUDA generator when CUDA is present). Same ``get_states``/``set_states`` protocol."""

    def get_states(self) -> dict:
        states = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            states["cuda"] = torch.cuda.get_rng_state_all()
        return states

    def set_states(self, states: dict) -> None:
        torch.set_rng_state(states["cpu"])
        if "cuda" in states:
            torch.cuda.set_rng_state_all(states["cuda"])


class _Recompute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn, rng, store, *args):
        ctx.fn, ctx.rng, ctx.store = fn, rng, store
        ctx.rng_states = rng.get_states()
        ctx.is_tensor = [torch.is_tensor(a) for a in args]
        ctx.grad_wanted = [torch.is_tensor(a) and a.requires_grad for a in args]
        ctx.plain = [None if torch.is_tensor(a) else a for a in args]
        tensors = [a for a in args if torch.is_tensor(a)]
        if store is not None:
            # the store decides what waits for backward (whole / 1/tp slice / host tier); what it
            # keeps still goes through save_for_backward so saved-tensor hooks measure it.
            ctx.handle = store.save(tensors[0])
            ctx.device = tensors[0].device
            ctx.save_for_backward(ctx.handle.kept, *tensors[1:])
        else:
            ctx.save_for_backward(*tensors)
        with torch.no_grad():
            out = fn(*args)
        ctx.single = torch.is_tensor(out)
        return out

    @staticmethod
    def backward(ctx, *grads):
        inputs = _restore_inputs(ctx)
        current = ctx.rng.get_states()
        ctx.rng.set_states(ctx.rng_states)
        try:
            with torch.enable_grad():
                out = ctx.fn(*inputs)
        finally:
            ctx.rng.set_states(current)
        outs = (out,) if ctx.single else tuple(out)
        pairs = [(o, g) for o, g in zip(outs, grads)
                 if torch.is_tensor(o) and o.requires_grad and g is not None]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        in_grads = tuple(a.grad if w else None for a, w in zip(inputs, ctx.grad_wanted))
        return (None, None, None) + in_grads


def _restore_inputs(ctx) -> list:
    """The forward inputs, detached, requiring grad where they did."""
    saved = list(ctx.saved_tensors)
    if ctx.store is not None:
        saved[0] = ctx.store.load(ctx.handle, ctx.device)
        ctx.handle = None   # the store's slot is released; drop our reference too
    it = iter(saved)
    inputs = []
    for is_t, want, plain in zip(ctx.is_tensor, ctx.grad_wanted, ctx.plain):
        if is_t:
            t = next(it).detach()
            inputs.append(t.requires_grad_(want))
        else:
            inputs.append(plain)
    return inputs


def checkpoint(fn: Callable, *args, rng=None, store: CheckpointStore | None = None):
    """Run ``fn(*args)`` keeping only its inputs; recompute it during backward.

    ``rng``: an object with ``get_states()``/``set_states()`` (the model's ``RNGTracker``); default
    :class:`TorchRNG`. ``store``: where the first argument (a hidden state ``[s, b, h]`` or its
    sequence shard) waits - ``None`` keeps every tensor input as autograd would. With autograd
    disabled (evaluation) ``fn`` simply runs.
    """
    if not torch.is_grad_enabled():
        return fn(*args)
    if store is not None and not (args and torch.is_tensor(args[0])):
        raise TypeError("checkpoint(..., store=...) keeps the first argument in the store; pass "
                        "the hidden state tensor first")
    return _Recompute.apply(fn, rng if rng is not None else TorchRNG(), store, *args)
