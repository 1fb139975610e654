"""The attention core ``softmax(q k^T / sqrt(d) + causal mask) v`` with attention-probability dropout
(Megatron-LM §3, Fig. 3: "self attention" between the QKV and the output projection) as explicit
batched matrix products, for CPU.

On CPU, torch's SDPA runs a flash-attention kernel whose forward and backward cost several times the
four batched matrix products they contain at GPT shapes (short sequences, head dim 64): blocking,
per-block rescaling and the recomputation of the probabilities in backward dominate. Here the core is
one autograd Function: forward ``baddbmm`` (scale and causal mask folded in), the native row-wise
softmax, dropout, ``bmm``; backward from the saved probabilities with four ``bmm`` and the softmax
backward formula ``dS = P * (dP - rowsum(dP * P))``. It keeps the probabilities ``[b, a, s, t]``
(Megatron's core keeps them too; the recompute planner counts them, hybrid/recompute/planner.py).

Grouped-query attention needs no copies of keys and values: the ``a/g`` query heads of a group are
stacked along the rows, ``q [b g, (a/g) s, d] @ k^T [b g, d, t]``, and the backward products over
those rows sum the heads' key and value gradients.

Layout: the inputs are ``[b, heads, s, d]`` views of the QKV projection's ``[s, b, heads, d]``
output, the result a ``[b, a, s, d]`` view of an ``[s, b, a, d]`` tensor, so the output projection
reads it without a copy; the casts to and from the compute dtype ride on the copies that make the
operands contiguous, and the gradients come back in the projection's ``[s, b, heads, d]`` layout too.
"""

from __future__ import annotations

import math

import torch


def attention_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, start: int = 0,
                   dropout_p: float = 0.0, compute_dtype: torch.dtype | None = None) -> torch.Tensor:
    """q ``[b, a, s, d]``, k and v ``[b, g, t, d]`` (``t = start + s``; query i sits at position
    ``start + i`` and sees keys ``0 .. start + i``; query head j reads key/value head ``j // (a/g)``)
    -> ``[b, a, s, d]`` in q's dtype, computed in ``compute_dtype`` (q's dtype by default). Dropout
    draws from torch's current random stream (the caller chooses it)."""
    b, a, s, d = q.shape
    g, t = k.size(1), k.size(2)
    if a % g or k.shape != (b, g, t, d) or v.shape != k.shape or t != start + s:
        raise ValueError(f"attention core: q {tuple(q.shape)}, k {tuple(k.shape)}, v "
                         f"{tuple(v.shape)}, start {start}: expected k and v [b, g, start + s, d] "
                         f"with g dividing the query heads")
    return _Core.apply(q, k, v, start, dropout_p, compute_dtype or q.dtype)


# query rows per causal block: with s >= 128 the products skip the keys a block of 64 positions
# cannot see (at s = 128 a quarter of the work, at 256 three eighths); below that one block
BLOCK = 64


def _rows(x: torch.Tensor, dtype: torch.dtype, groups: int) -> torch.Tensor:
    """``[b, n, s, d]`` (any strides) -> contiguous ``[b groups, s (n / groups), d]`` in ``dtype``,
    rows position-major (a position's heads of one group are adjacent): one copy that also casts."""
    b, n, s, d = x.shape
    per_group = n // groups
    out = torch.empty(b, groups, s, per_group, d, dtype=dtype, device=x.device)
    out.copy_(x.view(b, groups, per_group, s, d).transpose(2, 3))
    return out.view(b * groups, s * per_group, d)


def _sbhd(b: int, n: int, s: int, d: int, dtype: torch.dtype, device) -> torch.Tensor:
    """A new ``[s, b, n, d]`` tensor (the projections' layout) that :func:`_put` fills."""
    return torch.empty(s, b, n, d, dtype=dtype, device=device)


def _put(out: torch.Tensor, lo: int, x: torch.Tensor, groups: int) -> None:
    """Copy rows ``[b groups, c (n / groups), d]`` of positions ``lo .. lo + c`` (ordered as
    :func:`_rows` orders them) into ``out [s, b, n, d]``, casting."""
    s, b, n, d = out.shape
    c = x.size(1) * groups // n
    out[lo:lo + c].view(c, b, groups, n // groups, d).copy_(
        x.view(b, groups, c, n // groups, d).permute(2, 0, 1, 3, 4))


def _causal_bias(s: int, per_group: int, t: int, start: int, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
    """Additive mask ``[s per_group, t]``: row i (position ``start + i // per_group``) has 0 for the
    keys it sees and -inf for the later ones."""
    position = torch.arange(s, device=device).repeat_interleave(per_group) + start   # [R]
    hidden = torch.arange(t, device=device) > position[:, None]                      # [R, t]
    return torch.zeros(s * per_group, t, dtype=dtype, device=device).masked_fill_(hidden, -math.inf)


def _blocks(s: int, start: int) -> list[tuple[int, int, int]]:
    """Causal blocks of query positions ``[lo, hi)``, each with the number of keys it sees,
    ``start + hi``."""
    size = BLOCK if s >= 2 * BLOCK and s % BLOCK == 0 else s
    return [(lo, lo + size, start + lo + size) for lo in range(0, s, size)]


class _Core(torch.autograd.Function):
    """See the module docstring; ``B = b g`` batches of ``R = s a/g`` query rows, per causal block
    of positions ``[lo, hi)`` its rows ``[lo a/g, hi a/g)`` and keys ``[0, start + hi)``."""

    @staticmethod
    def forward(ctx, q, k, v, start, p, dtype):
        b, a, s, d = q.shape
        g, t = k.size(1), k.size(2)
        r, scale = a // g, 1.0 / math.sqrt(d)
        qc = _rows(q, dtype, g)                                             # [B, R, d]
        kc, vc = _rows(k, dtype, g), _rows(v, dtype, g)                     # [B, t, d]
        bias = _causal_bias(s, r, t, start, dtype, q.device)                # [R, t]
        out = _sbhd(b, a, s, d, q.dtype, q.device)
        probs, keeps = [], []
        for lo, hi, end in _blocks(s, start):
            rows = slice(lo * r, hi * r)
            scores = torch.baddbmm(bias[rows, :end], qc[:, rows], kc[:, :end].transpose(1, 2),
                                   alpha=scale)                             # [B, rows, end]
            probs.append(torch.softmax(scores, dim=-1))
            dropped = probs[-1]
            if p > 0.0:
                dropped, keep = torch.native_dropout(dropped, p, True)      # keep: bool
                keeps.append(keep)
            _put(out, lo, torch.bmm(dropped, vc[:, :end]), g)
        ctx.save_for_backward(qc, kc, vc, *probs, *keeps)
        ctx.shape, ctx.p, ctx.scale, ctx.start = (b, a, g, s), p, scale, start
        return out.permute(1, 2, 0, 3)                                      # [b, a, s, d]

    @staticmethod
    def backward(ctx, grad):
        qc, kc, vc, *saved = ctx.saved_tensors
        (b, a, g, s), p, scale = ctx.shape, ctx.p, ctx.scale
        blocks = _blocks(s, ctx.start)
        probs, keeps = saved[:len(blocks)], saved[len(blocks):]
        r, d = a // g, qc.size(2)
        do = _rows(grad, qc.dtype, g)                                       # [B, R, d]
        dq = _sbhd(b, a, s, d, grad.dtype, grad.device)
        dk = dv = None                   # [B, t, d]: the last block sees every key, so it goes first
        for i, (lo, hi, end) in reversed(list(enumerate(blocks))):
            rows = slice(lo * r, hi * r)
            dp = torch.bmm(do[:, rows], vc[:, :end].transpose(1, 2))        # [B, rows, end]
            dropped = probs[i]
            if keeps:
                dropped = torch.ops.aten.native_dropout_backward(probs[i], keeps[i], 1.0 / (1.0 - p))
                dp = torch.ops.aten.native_dropout_backward(dp, keeps[i], 1.0 / (1.0 - p))
            ds = torch._softmax_backward_data(dp, probs[i], -1, qc.dtype).mul_(scale)
            _put(dq, lo, torch.bmm(ds, kc[:, :end]), g)
            dk_i = torch.bmm(ds.transpose(1, 2), qc[:, rows])                # [B, end, d]
            dv_i = torch.bmm(dropped.transpose(1, 2), do[:, rows])
            if dk is None:
                dk, dv = dk_i, dv_i
            else:
                dk[:, :end] += dk_i
                dv[:, :end] += dv_i
        dk_out, dv_out = (_sbhd(b, g, dk.size(1), d, grad.dtype, grad.device) for _ in "kv")
        _put(dk_out, 0, dk, g)
        _put(dv_out, 0, dv, g)
        return (dq.permute(1, 2, 0, 3), dk_out.permute(1, 2, 0, 3), dv_out.permute(1, 2, 0, 3),
                None, None, None)
