"""The attention core ``softmax(q k^T / sqrt(d) + causal mask) v`` with attention-probability dropout
(Megatron-LM §3, Fig. 3: "self attention" between the QKV and the output projection) as explicit
batched matrix products, for CPU.

On CPU, torch's SDPA runs a flash-attention kernel whose blocking, per-block rescaling and
recomputation of the probabilities in backward cost more than the matrix products at GPT shapes
(short sequences, head dim 64; measured at [4, 4, 128, 64] forward + backward with the layout
copies: fp32 4.5 -> 3.2 ms, bf16 7.4 -> 2.5 ms, one thread). Here the core is one autograd Function:
forward ``baddbmm`` (scale and causal mask folded in), the native row-wise softmax, dropout,
``bmm``; backward from the saved probabilities with four ``bmm`` and the softmax backward formula
``dS = P * (dP - rowsum(dP * P))``. Causal blocks of query positions (64 in fp32, 128 in 16-bit)
multiply only the keys they can see. It keeps the probabilities ``[b, a, s, t]`` and a bool dropout
mask (Megatron's core keeps them too; the recompute planner counts them, hybrid/recompute/planner.py
``cpu_core``).

Grouped-query attention needs no copies of keys and values: the ``r = a/g`` query heads of a group
are stacked along the rows, position-major, ``q [b g, s r, d] @ k^T [b g, d, t]``, and the backward
products over those rows sum the heads' key and value gradients.

Layout: :func:`attention_core` takes ``[b, heads, s, d]`` views of the QKV projection's
``[s, b, heads, d]`` output and returns a ``[b, a, s, d]`` view of an ``[s, b, a, d]`` tensor, so the
output projection reads it without a copy; :func:`packed_attention_core` takes the QKV output itself
and returns its gradient as one tensor. The casts to and from the compute dtype ride on the copies
that make the operands contiguous.
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


def packed_attention_core(qkv: torch.Tensor, *, dropout_p: float = 0.0,
                          compute_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The causal core straight from the QKV projection's output viewed ``[s, b, g, r + 2, d]``
    (per key/value group its r query heads, then key, then value) -> ``[s, b, g r, d]`` in its
    dtype. Its gradient is one ``[s, b, g, r + 2, d]`` tensor: no zero-filled gradients of the q, k
    and v slices summed in backward."""
    if qkv.dim() != 5 or qkv.size(3) < 3:
        raise ValueError(f"attention core: qkv {tuple(qkv.shape)}: expected [s, b, groups, "
                         f"query heads per group + 2, d]")
    return _PackedCore.apply(qkv, dropout_p, compute_dtype or qkv.dtype)


# query rows per causal block: with s >= 2 BLOCK the products skip the keys a block cannot see (a
# quarter of the work at s = 2 BLOCK, three eighths at 8 BLOCK); below that one block. Smaller
# blocks skip more work but multiply smaller matrices, which the 16-bit products pay for more:
# forward + backward, one thread, blocks of 64 -> 128 -> 256 at [b 4, heads 4, s 128, d 64],
# [1, 12, 256, 64], s = 512, s = 1024: bf16 2.19 -> 2.09 -> 2.08, 4.92 -> 4.54 -> 5.07,
# 16.3 -> 14.7 -> 15.3, 56.6 -> 51.2 -> 50.8 ms; fp32 2.97 -> 3.59 -> 3.56, 7.17 -> 8.08 -> 10.1,
# 23.7 -> 25.6 -> 29.9, 87.3 -> 88.3 -> 101 ms
BLOCK = 64            # fp32 and fp64
BLOCK_16BIT = 128     # bf16 and fp16


def _rows(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[s, b, g, r, d]`` (any strides) -> contiguous ``[b g, s r, d]`` in ``dtype``, rows
    position-major (a position's ``r`` heads of one group adjacent): one copy that also casts."""
    s, b, g, r, d = x.shape
    out = torch.empty(b, g, s, r, d, dtype=dtype, device=x.device)
    out.copy_(x.permute(1, 2, 0, 3, 4))
    return out.view(b * g, s * r, d)


def _put(out: torch.Tensor, lo: int, x: torch.Tensor) -> None:
    """Copy rows ``[b g, c r, d]`` of positions ``lo .. lo + c`` (ordered as :func:`_rows` orders
    them) into ``out [s, b, g, r, d]`` (any strides), casting."""
    _, b, g, r, d = out.shape
    c = x.size(1) // r
    out[lo:lo + c].copy_(x.view(b, g, c, r, d).permute(2, 0, 1, 3, 4))


def _heads(x: torch.Tensor, groups: int) -> torch.Tensor:
    """``[b, n, s, d]`` -> its ``[s, b, groups, n / groups, d]`` view."""
    return x.permute(2, 0, 1, 3).unflatten(2, (groups, -1))


def _causal_bias(s: int, per_group: int, t: int, start: int, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
    """Additive mask ``[s per_group, t]``: row i (position ``start + i // per_group``) has 0 for the
    keys it sees and -inf for the later ones."""
    position = torch.arange(s, device=device).repeat_interleave(per_group) + start   # [R]
    hidden = torch.arange(t, device=device) > position[:, None]                      # [R, t]
    return torch.zeros(s * per_group, t, dtype=dtype, device=device).masked_fill_(hidden, -math.inf)


def _blocks(s: int, start: int, dtype: torch.dtype) -> list[tuple[int, int, int]]:
    """Causal blocks of query positions ``[lo, hi)`` for a core computing in ``dtype``, each with
    the number of keys it sees, ``start + hi``."""
    block = BLOCK_16BIT if dtype.itemsize == 2 else BLOCK
    size = block if s >= 2 * block and s % block == 0 else s
    return [(lo, lo + size, start + lo + size) for lo in range(0, s, size)]


def _forward(ctx, q, k, v, start: int, p: float, dtype: torch.dtype) -> torch.Tensor:
    """The core on q ``[s, b, g, r, d]``, k and v ``[t, b, g, 1, d]`` (any strides) -> a new
    ``[s, b, g r, d]`` tensor in q's dtype; saves on ``ctx`` what :func:`_backward` needs.
    ``B = b g`` batches of ``R = s r`` query rows; the causal block of positions ``[lo, hi)`` has
    the rows ``[lo r, hi r)`` and sees the keys ``[0, start + hi)``."""
    s, b, g, r, d = q.shape
    t, scale = k.size(0), 1.0 / math.sqrt(d)
    qc, kc, vc = _rows(q, dtype), _rows(k, dtype), _rows(v, dtype)     # [B, R, d], [B, t, d]
    bias = _causal_bias(s, r, t, start, dtype, q.device)                # [R, t]
    out = torch.empty(s, b, g, r, d, dtype=q.dtype, device=q.device)
    probs, keeps = [], []
    for lo, hi, end in _blocks(s, start, dtype):
        rows = slice(lo * r, hi * r)
        scores = torch.baddbmm(bias[rows, :end], qc[:, rows], kc[:, :end].transpose(1, 2),
                               alpha=scale)                             # [B, rows, end]
        probs.append(torch.softmax(scores, dim=-1))
        dropped = probs[-1]
        if p > 0.0:
            dropped, keep = torch.native_dropout(dropped, p, True)      # keep: bool
            keeps.append(keep)
        _put(out, lo, torch.bmm(dropped, vc[:, :end]))
    ctx.save_for_backward(qc, kc, vc, *probs, *keeps)
    ctx.sizes, ctx.p, ctx.scale, ctx.start = (s, b, g, r), p, scale, start
    return out.flatten(2, 3)


def _backward(ctx, grad: torch.Tensor, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor) -> None:
    """From the output's gradient ``[s, b, g, r, d]`` (any strides) write the gradients of q, k
    and v into ``dq [s, b, g, r, d]``, ``dk`` and ``dv [t, b, g, 1, d]`` (any strides)."""
    qc, kc, vc, *saved = ctx.saved_tensors
    (s, b, g, r), p, scale = ctx.sizes, ctx.p, ctx.scale
    blocks = _blocks(s, ctx.start, qc.dtype)
    probs, keeps = saved[:len(blocks)], saved[len(blocks):]
    do = _rows(grad, qc.dtype)                                          # [B, R, d]
    dkc = dvc = None                 # [B, t, d]: the last block sees every key, so it goes first
    for i, (lo, hi, end) in reversed(list(enumerate(blocks))):
        rows = slice(lo * r, hi * r)
        dp = torch.bmm(do[:, rows], vc[:, :end].transpose(1, 2))        # [B, rows, end]
        dropped = probs[i]
        if keeps:
            dropped = torch.ops.aten.native_dropout_backward(probs[i], keeps[i], 1.0 / (1.0 - p))
            dp = torch.ops.aten.native_dropout_backward(dp, keeps[i], 1.0 / (1.0 - p))
        ds = torch._softmax_backward_data(dp, probs[i], -1, qc.dtype).mul_(scale)
        _put(dq, lo, torch.bmm(ds, kc[:, :end]))
        dk_i = torch.bmm(ds.transpose(1, 2), qc[:, rows])                # [B, end, d]
        dv_i = torch.bmm(dropped.transpose(1, 2), do[:, rows])
        if dkc is None:
            dkc, dvc = dk_i, dv_i
        else:
            dkc[:, :end] += dk_i
            dvc[:, :end] += dv_i
    _put(dk, 0, dkc)
    _put(dv, 0, dvc)


class _Core(torch.autograd.Function):
    """q ``[b, a, s, d]``, k and v ``[b, g, t, d]`` -> ``[b, a, s, d]`` (a view of ``[s, b, a, d]``)."""

    @staticmethod
    def forward(ctx, q, k, v, start, p, dtype):
        g = k.size(1)
        out = _forward(ctx, _heads(q, g), _heads(k, g), _heads(v, g), start, p, dtype)
        return out.permute(1, 2, 0, 3)

    @staticmethod
    def backward(ctx, grad):
        s, b, g, r = ctx.sizes
        d, t = grad.size(3), ctx.saved_tensors[1].size(1)
        dq = grad.new_empty(s, b, g, r, d)
        dk, dv = grad.new_empty(t, b, g, 1, d), grad.new_empty(t, b, g, 1, d)
        _backward(ctx, _heads(grad, g), dq, dk, dv)
        return (dq.flatten(2, 3).permute(1, 2, 0, 3), dk.flatten(2, 3).permute(1, 2, 0, 3),
                dv.flatten(2, 3).permute(1, 2, 0, 3), None, None, None)


class _PackedCore(torch.autograd.Function):
    """qkv ``[s, b, g, r + 2, d]`` (per group its r query heads, then key and value) ->
    ``[s, b, g r, d]``; its gradient is written straight into one ``[s, b, g, r + 2, d]`` tensor."""

    @staticmethod
    def forward(ctx, qkv, p, dtype):
        r = qkv.size(3) - 2
        return _forward(ctx, qkv[:, :, :, :r], qkv[:, :, :, r:r + 1], qkv[:, :, :, r + 1:], 0, p,
                        dtype)

    @staticmethod
    def backward(ctx, grad):
        s, b, g, r = ctx.sizes
        dqkv = grad.new_empty(s, b, g, r + 2, grad.size(3))
        _backward(ctx, grad.unflatten(2, (g, r)), dqkv[:, :, :, :r], dqkv[:, :, :, r:r + 1],
                  dqkv[:, :, :, r + 1:])
        return dqkv, None, None
