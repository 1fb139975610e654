"""The all-gather-KV baseline of context parallelism (issue 31, ``--cp-comm-type allgather``; the
scheme of Llama 3's long-context training, §3.3.2): every CP rank all-gathers the keys and values
(with their indices and document ids), attends with its own queries to the whole sequence and, in
backward, reduce-scatters the key/value gradients back to their owners. Simple, but it holds the
whole sequence's keys and values on every rank and nothing overlaps the communication; it is the
reference the ring and the all-to-all are measured against (benchmarks/context_parallel.py).

The gathered keys are put in token order (by their global index), so every local query chunk
multiplies only the prefix of keys up to its own position (:func:`.block_attention.plan` over the
``2C`` chunks of the sequence).

Bytes per step, per CP rank (notation of :mod:`.ring`):

    forward   all_gather      (C - 1) * (2 b g s d e + 8 m s)
    backward  reduce_scatter  (C - 1) * 2 b g s d 4      (fp32 gradients)
"""

from __future__ import annotations

import torch

from hybrid import comm
from hybrid.context_parallel import block_attention as blocks
from hybrid.context_parallel.ring import _meta, _split_meta


def allgather_attention(q, k, v, group, token_index, document_ids, compute_dtype):
    return _AllGather.apply(q, k, v, group, token_index, document_ids, compute_dtype)


class _AllGather(torch.autograd.Function):

    @staticmethod
    def forward(ctx, q, k, v, group, token_index, document_ids, compute_dtype):
        size = group.size
        b, g, s, d = k.shape
        kv = torch.stack([k, v])                                            # [2, b, g, s, d]
        meta = _meta(token_index, document_ids)                             # [m, s]
        gathered = kv.new_empty(size * kv.numel())
        metas = meta.new_empty(size * meta.numel())
        comm.all_gather_into(metas, meta.view(-1), group)
        comm.all_gather_into(gathered, kv.view(-1), group)
        metas = metas.view(size, -1, s)                                     # [C, m, s]
        all_index = metas[:, 0].reshape(size * s)                           # rank-major order
        order = torch.argsort(all_index)                                    # -> token order
        k_index = all_index[order]
        k_doc = None
        if document_ids is not None:
            k_doc = metas[:, 1:].permute(1, 0, 2).reshape(b, size * s)[:, order]
        kv_all = (gathered.view(size, 2, b, g, s, d).permute(1, 2, 3, 0, 4, 5)
                  .reshape(2, b, g, size * s, d).index_select(3, order))    # [2, b, g, C s, d]
        count = blocks.part_count(s, 2, q.device)
        tiles = blocks.plan(blocks.parts(token_index, count), blocks.parts(k_index, count * size),
                            token_index, k_index, document_ids, k_doc,
                            flash=blocks.flash_kernel(q.device))
        out = q.new_zeros(q.shape, dtype=torch.float32)
        lse = q.new_full(q.shape[:-1], float("-inf"), dtype=torch.float32)
        blocks.forward_tiles(tiles, q, kv_all[0], kv_all[1], token_index, k_index, document_ids,
                             k_doc, out, lse, compute_dtype)
        result = out.to(q.dtype)
        ctx.save_for_backward(q, kv_all, result, lse, token_index, k_index, order)
        ctx.docs, ctx.group, ctx.tiles, ctx.compute_dtype = ((document_ids, k_doc), group, tiles,
                                                             compute_dtype)
        return result

    @staticmethod
    def backward(ctx, grad):
        q, kv_all, out, lse, q_index, k_index, order = ctx.saved_tensors
        (q_doc, k_doc), group = ctx.docs, ctx.group
        size = group.size
        _, b, g, total, d = kv_all.shape
        s = total // size
        grad = grad.contiguous()
        delta = (grad.float() * out.float()).sum(-1)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dkv = torch.zeros(kv_all.shape, dtype=torch.float32, device=q.device)  # token order
        blocks.backward_tiles(ctx.tiles, q, kv_all[0], kv_all[1], q_index, k_index, q_doc, k_doc,
                              lse, grad, delta, out, dq, dkv[0], dkv[1], ctx.compute_dtype)
        ranked = torch.empty_like(dkv).index_copy_(3, order, dkv)           # rank-major order
        full = ranked.view(2, b, g, size, s, d).permute(3, 0, 1, 2, 4, 5).contiguous()
        own = torch.empty(full.shape[1:], dtype=torch.float32, device=q.device)
        comm.reduce_scatter_into(own.view(-1), full.view(-1), group)
        return (dq.to(q.dtype), own[0].to(kv_all.dtype), own[1].to(kv_all.dtype), None, None, None,
                None)
