"""All-to-all context parallelism (issue 31, ``--cp-comm-type a2a``; Jacobs et al., DeepSpeed
Ulysses, §3.1): one all-to-all trades the sequence shards of q, k and v for head shards, every CP
rank attends with ``a/C`` query heads (and ``g/C`` key/value heads) over the whole sequence, and a
second all-to-all trades the output back.

Forward: q ``[b, a, s, d]`` -> ``[b, a/C, C s, d]`` (k, v alike, with their ``g`` heads; q, k and v
travel in one all-to-all), the sequence put in token order by the all-gathered global indices (the
ranks' parts arrive in the load-balanced layout), document ids all-gathered beside them. Query head
``j`` of rank ``p``'s shard is global head ``p a/C + j`` and reads key/value head ``p g/C + j //
(a/g)``: the GQA pairing is kept when ``g`` is divisible by ``C``. The local attention runs in tiles
of one layout chunk (``S / 2C`` tokens) that skip the tiles above the causal diagonal and the tiles
with no pair in one document (:mod:`.block_attention`). Backward: the same two all-to-alls in reverse
on the gradients. With TP, heads are split by TP first (the caller passes its TP rank's heads).

Bytes per step, per CP rank (notation of :mod:`.ring`, ``a`` query heads, ``e`` bytes per
element of q):

    forward   all_to_all  (C - 1) / C * b (a + 2 g) s d e  +  (C - 1) / C * b a s d e
              all_gather  (C - 1) * 8 m s                  (indices and document ids)
    backward  all_to_all  (C - 1) / C * b a s d e  +  (C - 1) / C * b (a + 2 g) s d e
"""

from __future__ import annotations

import torch

from hybrid import comm
from hybrid.context_parallel import block_attention as blocks
from hybrid.context_parallel.ring import _meta


def _to_sequence(xs, group, order) -> list[torch.Tensor]:
    """Each ``[b, h, s, d]`` -> ``[b, h/C, C s, d]`` in token order (one all-to-all for all)."""
    size = group.size
    source = torch.cat([x.reshape(x.size(0), size, -1).transpose(0, 1).reshape(size, -1)
                        for x in xs], dim=1)                                # [C, N]
    received = torch.empty_like(source)
    comm.all_to_all(received, source, group)                                # row j: rank j's tokens
    outs, offset = [], 0
    for x in xs:
        b, h, s, d = x.shape
        n = x.numel() // size
        part = received[:, offset:offset + n].view(size, b, h // size, s, d)
        outs.append(part.permute(1, 2, 0, 3, 4).reshape(b, h // size, size * s, d)
                    .index_select(2, order))
        offset += n
    return outs


def _to_heads(xs, group, order) -> list[torch.Tensor]:
    """Inverse of :func:`_to_sequence`: each ``[b, h/C, C s, d]`` (token order) -> ``[b, h, s, d]``."""
    size = group.size
    parts = []
    for x in xs:
        b, hc, total, d = x.shape
        ranked = torch.empty_like(x).index_copy_(2, order, x)               # rank-major order
        parts.append(ranked.view(b, hc, size, total // size, d).permute(2, 0, 1, 3, 4)
                     .reshape(size, -1))
    source = torch.cat(parts, dim=1)
    received = torch.empty_like(source)
    comm.all_to_all(received, source, group)                                # row j: head shard j
    outs, offset = [], 0
    for x in xs:
        b, hc, total, d = x.shape
        n = x.numel() // size
        outs.append(received[:, offset:offset + n].view(size, b, hc, total // size, d)
                    .transpose(0, 1).reshape(b, size * hc, total // size, d))
        offset += n
    return outs


class _ToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, order, q, k, v):
        ctx.group, ctx.order = group, order
        return tuple(_to_sequence([q, k, v], group, order))

    @staticmethod
    def backward(ctx, dq, dk, dv):
        return (None, None, *_to_heads([dq.contiguous(), dk.contiguous(), dv.contiguous()],
                                       ctx.group, ctx.order))


class _ToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, order, x):
        ctx.group, ctx.order = group, order
        return _to_heads([x], group, order)[0]

    @staticmethod
    def backward(ctx, grad):
        return None, None, _to_sequence([grad.contiguous()], ctx.group, ctx.order)[0]


class _Local(torch.autograd.Function):
    """Tiled masked attention of whole sequences in token order (:mod:`.block_attention`)."""

    @staticmethod
    def forward(ctx, q, k, v, index, doc, tiles, compute_dtype):
        out = q.new_zeros(q.shape, dtype=torch.float32)
        lse = q.new_full(q.shape[:-1], float("-inf"), dtype=torch.float32)
        blocks.forward_tiles(tiles, q, k, v, index, index, doc, doc, out, lse, compute_dtype)
        result = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, result, lse, index)
        ctx.doc, ctx.tiles, ctx.compute_dtype = doc, tiles, compute_dtype
        return result

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse, index = ctx.saved_tensors
        grad = grad.contiguous()
        delta = (grad.float() * out.float()).sum(-1)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dk = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
        dv = torch.zeros(v.shape, dtype=torch.float32, device=q.device)
        blocks.backward_tiles(ctx.tiles, q, k, v, index, index, ctx.doc, ctx.doc, lse, grad, delta,
                              out, dq, dk, dv, ctx.compute_dtype)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


def a2a_attention(q, k, v, group, token_index, document_ids, compute_dtype):
    size = group.size
    b, _, s, _ = q.shape
    meta = _meta(token_index, document_ids)                                 # [m, s]
    metas = meta.new_empty(size * meta.numel())
    comm.all_gather_into(metas, meta.view(-1), group)
    metas = metas.view(size, -1, s)                                         # [C, m, s]
    all_index = metas[:, 0].reshape(size * s)                               # rank-major order
    order = torch.argsort(all_index)                                        # -> token order
    index = all_index[order]
    doc = None
    if document_ids is not None:
        doc = metas[:, 1:].permute(1, 0, 2).reshape(b, size * s)[:, order]
    pieces = blocks.parts(index, blocks.part_count(size * s, 2 * size, q.device))    # the layout's chunks, cut
    tiles = blocks.plan(pieces, pieces, index, index, doc, doc, max_area=s * s,   # <= [s, s]
                        flash=blocks.flash_kernel(q.device))
    qs, ks, vs = _ToSequence.apply(group, order, q, k, v)
    out = _Local.apply(qs, ks, vs, index, doc, tiles, compute_dtype)
    return _ToHeads.apply(group, order, out)
