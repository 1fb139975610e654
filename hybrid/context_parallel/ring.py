"""Ring attention (issue 31, ``--cp-comm-type p2p``; Liu et al., Ring Attention, §3; Megatron-Core's
context parallelism): the keys and values travel around the CP ring while every rank keeps its
queries.

Forward, ``C`` steps. At step ``i`` CP rank ``r`` holds the key/value block of rank ``r - i`` (its
own first), posts the send of that block to ``r + 1`` and the receive of the next one from
``r - 1`` (:func:`hybrid.comm.p2p`), attends to the held block while they fly, merges the partial
output with the log-sum-exp in fp32 (:mod:`.block_attention`) and then waits. Each block travels
with its tokens' global indices and document ids, from which the masks are built. Only the ``g``
key/value heads travel (GQA), k and v packed in one message.

With the load-balanced layout (:mod:`.layout`: rank ``r`` holds chunks ``r`` and ``2C-1-r``) a
remote block is, by whole-chunk index ranges, either seen by both local query chunks in its first
chunk only (it comes from a lower rank) or seen by the second local query chunk only (a higher
rank), without a causal mask: every step after the first computes half a block
(:func:`.block_attention.plan`).

Backward, a second ring: the key/value blocks travel again in the same order; rank ``r`` computes
the block's key/value gradients for its own queries (the probabilities recomputed from the saved
``lse``, as flash attention does) and adds them to the block's gradient accumulator, which it
received from ``r - 1`` and passes to ``r + 1``. The accumulator is created by the block's first
visitor after its owner and reaches the owner after ``C - 1`` hops; it is fp32 (the sum over ranks
keeps its precision in bf16 runs). The query gradient stays local. Each transfer is posted before the
step's compute and waited after it.

Bytes per step, per CP rank (``b`` samples, ``s`` = local tokens = S / C, ``g`` key/value heads of
dimension ``d``, ``e`` bytes per element of k and v, ``m = 1 + b`` index rows with document ids and
``1`` without; ``send`` and ``recv`` each record the same):

    forward   (C - 1) * (2 b g s d e + 8 m s)
    backward  (C - 1) * (2 b g s d e + 2 b g s d 4)

(the indices and document ids of the blocks are kept from the forward; docs/context-parallel.md).
"""

from __future__ import annotations

import torch

from hybrid import comm
from hybrid.context_parallel import block_attention as blocks

KV_TAG, META_TAG, GRAD_TAG = 0, 1, 2


def _tag(kind: int, step: int) -> int:
    return 3 * step + kind


def _meta(token_index: torch.Tensor, document_ids: torch.Tensor | None) -> torch.Tensor:
    """The indices ``[1, s]`` (and document ids below them: ``[1 + b, s]``) of one block, int64."""
    rows = [token_index[None]] if document_ids is None else [token_index[None], document_ids]
    return torch.cat(rows).contiguous()


def _split_meta(meta: torch.Tensor, documents: bool):
    return meta[0], (meta[1:] if documents else None)


def ring_attention(q, k, v, group, token_index, document_ids, compute_dtype):
    return _Ring.apply(q, k, v, group, token_index, document_ids, compute_dtype)


class _Ring(torch.autograd.Function):

    @staticmethod
    def forward(ctx, q, k, v, group, token_index, document_ids, compute_dtype):
        size, rank = group.size, group.rank
        after, before = (rank + 1) % size, (rank - 1) % size
        documents = document_ids is not None
        kv = torch.stack([k, v])                                            # [2, b, g, s, d]
        meta = _meta(token_index, document_ids)                             # [m, s]
        count = blocks.part_count(token_index.numel(), 2, q.device)      # the layout's two chunks, cut
        q_parts = blocks.parts(token_index, count)
        area = token_index.numel() ** 2 // 2          # the diagonal step: [s/2, s] (one row merged)
        out = q.new_zeros(q.shape, dtype=torch.float32)                     # [b, a, s, d]
        lse = q.new_full(q.shape[:-1], float("-inf"), dtype=torch.float32)  # [b, a, s]
        metas, plans = [], []
        for step in range(size):
            handle = None
            if step < size - 1:
                next_kv, next_meta = torch.empty_like(kv), torch.empty_like(meta)
                handle = comm.p2p([comm.P2POp("send", kv, after, _tag(KV_TAG, step)),
                                   comm.P2POp("send", meta, after, _tag(META_TAG, step)),
                                   comm.P2POp("recv", next_kv, before, _tag(KV_TAG, step)),
                                   comm.P2POp("recv", next_meta, before, _tag(META_TAG, step))],
                                  group)
            k_index, k_doc = _split_meta(meta, documents)
            tiles = blocks.plan(q_parts, blocks.parts(k_index, count), token_index, k_index,
                                document_ids, k_doc, max_area=area,
                                flash=blocks.flash_kernel(q.device))
            blocks.forward_tiles(tiles, q, kv[0], kv[1], token_index, k_index, document_ids, k_doc,
                                 out, lse, compute_dtype)
            metas.append(meta)
            plans.append(tiles)
            if handle is not None:
                handle.wait()
                kv, meta = next_kv, next_meta
        result = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, result, lse)
        ctx.group, ctx.metas, ctx.plans = group, metas, plans
        ctx.documents, ctx.compute_dtype = documents, compute_dtype
        return result

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        group, dtype = ctx.group, ctx.compute_dtype
        size, rank = group.size, group.rank
        after, before = (rank + 1) % size, (rank - 1) % size
        q_index, q_doc = _split_meta(ctx.metas[0], ctx.documents)
        grad = grad.contiguous()
        delta = (grad.float() * out.float()).sum(-1)                        # [b, a, s]
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])                                            # [2, b, g, s, d]
        own = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)   # own block's dK, dV
        sending = []
        for step in range(size):
            # posted in the order the peer sent them (NCCL matches by order, gloo by tag): the
            # accumulator left r - 1 at the end of its step - 1, before the next block left it
            ops = []
            if step >= 2:           # the accumulator of this block, from its earlier visitors
                incoming = torch.empty_like(own)
                ops.append(comm.P2POp("recv", incoming, before, _tag(GRAD_TAG, step - 1)))
            if step < size - 1:
                next_kv = torch.empty_like(kv)
                ops += [comm.P2POp("send", kv, after, _tag(KV_TAG, step)),
                        comm.P2POp("recv", next_kv, before, _tag(KV_TAG, step))]
            handle = comm.p2p(ops, group) if ops else None
            local = own if step == 0 else torch.zeros_like(own)
            k_index, k_doc = _split_meta(ctx.metas[step], ctx.documents)
            blocks.backward_tiles(ctx.plans[step], q, kv[0], kv[1], q_index, k_index, q_doc, k_doc,
                                  lse, grad, delta, out, dq, local[0], local[1], dtype)
            if handle is not None:
                handle.wait()
            if step >= 1:
                if step >= 2:
                    local += incoming
                sending.append(comm.p2p([comm.P2POp("send", local, after,
                                                    _tag(GRAD_TAG, step))], group))
            if step < size - 1:
                kv = next_kv
        if size > 1:                # the own block's accumulator, back from its last visitor
            incoming = torch.empty_like(own)
            comm.p2p([comm.P2POp("recv", incoming, before, _tag(GRAD_TAG, size - 1))],
                     group).wait()
            own += incoming
        for handle in sending:
            handle.wait()
        return (dq.to(q.dtype), own[0].to(k.dtype), own[1].to(v.dtype), None, None, None, None)
