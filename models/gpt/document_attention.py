"""Document-masked causal attention for packed samples (issue 31, Megatron's
``--reset-attention-mask``): inside a sample of several documents, query t sees key u iff ``u <= t``
and ``document_ids[u] == document_ids[t]`` (document of t = number of EOD tokens strictly before t,
so an EOD belongs to the document it ends).

No dense ``[s, s]`` mask at long lengths. Three backends, one result:

* ``"blocked"`` (CPU, and CUDA with attention dropout): the block-sparse core of
  :mod:`models.gpt.attention_core` made variable-length. Query positions are cut into blocks; a block
  ``[lo, hi)`` multiplies only the keys ``[klo, hi)``, where ``klo`` is the first token of the
  document that holds query ``lo`` (the earliest over the batch), so every key block left of a
  document border is skipped, like the causal blocks right of the diagonal. Inside the kept range a
  ``[b, hi - lo, hi - klo]`` additive mask (never ``[s, s]``) hides the other documents' keys. With
  documents of length L the work is about ``s (block + L)`` instead of ``s^2 / 2``. The products,
  softmax, dropout and backward are those of attention_core (saved probabilities, four ``bmm`` in
  backward); grouped-query heads are stacked along the rows, no key/value copies. The block plan
  reads the document ids on the host once per forward (shared by the layers; free on CPU, one
  small device read on CUDA).
* ``"flex"`` (CUDA at ``s > DENSE_MAX_SEQ`` without dropout): torch's FlexAttention, compiled, over a
  ``BlockMask`` built from the same predicate; its kernels skip the blocks the mask empties.
  FlexAttention has no backward on CPU in torch 2.13 (``NotImplementedError: FlexAttention does not
  support backward on CPU``), and eager FlexAttention materialises the full score matrix, so it is
  never chosen on CPU.
* ``"dense"``: SDPA with a boolean ``[b, 1, s, s]`` mask, the small-shape fallback (CUDA at
  ``s <= DENSE_MAX_SEQ``, where SDPA's masked kernels beat building a block mask) and the reference
  of the tests.
"""

from __future__ import annotations

import math
import weakref

import torch
import torch.nn.functional as F

from models.gpt.attention_core import BLOCK, BLOCK_16BIT, _heads, _put, _rows

# at or below this many tokens CUDA uses SDPA with a dense mask (b x 1 MiB of booleans at 1024)
DENSE_MAX_SEQ = 1024

BACKENDS = ("blocked", "flex", "dense")


def document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       document_ids: torch.Tensor, *, dropout_p: float = 0.0,
                       compute_dtype: torch.dtype | None = None,
                       backend: str | None = None) -> torch.Tensor:
    """q ``[b, a, s, d]``, k and v ``[b, g, s, d]`` (query head j reads key/value head
    ``j // (a/g)``), ``document_ids`` int64 ``[b, s]`` -> ``[b, a, s, d]`` in q's dtype, computed in
    ``compute_dtype`` (q's by default); softmax scale ``1/sqrt(d)``. Dropout draws from torch's
    current random stream. ``backend``: one of :data:`BACKENDS`, default chosen by device and length
    (module docstring)."""
    b, a, s, d = q.shape
    g = k.size(1)
    if a % g or k.shape != (b, g, s, d) or v.shape != k.shape:
        raise ValueError(f"document attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v "
                         f"{tuple(v.shape)}: expected k and v [b, g, s, d] with g dividing the "
                         f"query heads")
    if tuple(document_ids.shape) != (b, s):
        raise ValueError(f"document attention: document_ids {tuple(document_ids.shape)}, expected "
                         f"[{b}, {s}] (one id per token)")
    dtype = compute_dtype or q.dtype
    backend = backend or _choose(q.device, s, dropout_p)
    if backend == "blocked":
        return _DocumentCore.apply(q, k, v, document_ids, dropout_p, dtype)
    if backend == "dense":
        return _dense(q, k, v, document_ids, dropout_p, dtype)
    if backend == "flex":
        if dropout_p > 0:
            raise ValueError("FlexAttention has no attention dropout; use backend='blocked' or "
                             "--attention-dropout 0")
        return _flex(q, k, v, document_ids, dtype)
    raise ValueError(f"document attention backend {backend!r}: choose one of {BACKENDS}")


def _choose(device: torch.device, s: int, dropout_p: float) -> str:
    if device.type != "cuda" or dropout_p > 0:
        return "blocked"
    return "dense" if s <= DENSE_MAX_SEQ else "flex"


def document_mask(document_ids: torch.Tensor, queries: slice | None = None,
                  keys: slice | None = None) -> torch.Tensor:
    """Boolean ``[b, len(queries), len(keys)]``: True where the query may attend the key (same
    document, key not after the query); default all positions (a dense ``[b, s, s]`` mask)."""
    s = document_ids.size(1)
    queries, keys = queries or slice(0, s), keys or slice(0, s)
    qi = torch.arange(queries.start, queries.stop, device=document_ids.device)
    ki = torch.arange(keys.start, keys.stop, device=document_ids.device)
    same = document_ids[:, queries, None] == document_ids[:, None, keys]
    return same & (ki[None, :] <= qi[:, None])


# ---- dense (small shapes, the reference) ---------------------------------------------------------

def _dense(q, k, v, document_ids, p: float, dtype: torch.dtype) -> torch.Tensor:
    a, g = q.size(1), k.size(1)
    if a != g:   # explicit copies: the fallback is for small shapes only
        k, v = k.repeat_interleave(a // g, dim=1), v.repeat_interleave(a // g, dim=1)
    mask = document_mask(document_ids)[:, None]                              # [b, 1, s, s]
    out = F.scaled_dot_product_attention(q.to(dtype), k.to(dtype), v.to(dtype), attn_mask=mask,
                                         dropout_p=p)
    return out.to(q.dtype)


# ---- FlexAttention (CUDA) ------------------------------------------------------------------------

_flex_compiled = None
_block_mask_cache: dict = {}   # id(document_ids) -> (weakref to it, BlockMask): one per forward


def _flex(q, k, v, document_ids, dtype: torch.dtype) -> torch.Tensor:
    global _flex_compiled
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    run = flex_attention   # eager (CPU: forward only, the test of the mask and the heads)
    if q.device.type == "cuda":   # compiled: the fused kernel that skips empty blocks
        if _flex_compiled is None:
            _flex_compiled = torch.compile(flex_attention, dynamic=False)
        run = _flex_compiled
    b, s = document_ids.shape
    hit = _block_mask_cache.get(id(document_ids))
    if hit is not None and hit[0]() is document_ids:
        block_mask = hit[1]   # every layer of a forward shares the layout's ids: built once
    else:
        def mask_mod(bi, h, qi, ki):
            return (document_ids[bi, qi] == document_ids[bi, ki]) & (ki <= qi)
        block_mask = create_block_mask(mask_mod, b, None, s, s, device=q.device)
        _block_mask_cache.clear()
        _block_mask_cache[id(document_ids)] = (weakref.ref(document_ids), block_mask)
    out = run(q.to(dtype), k.to(dtype), v.to(dtype), block_mask=block_mask,
                         enable_gqa=q.size(1) != k.size(1))
    return out.to(q.dtype)


# ---- the blocked variable-length core ------------------------------------------------------------

def plan_blocks(document_ids: torch.Tensor, dtype: torch.dtype) -> list[tuple[int, int, int]]:
    """Query blocks ``(lo, hi, klo)``: positions ``[lo, hi)`` and the first key any of them can see
    (the start of the document of query ``lo``, the earliest over the batch). Ids that do not grow
    along the sequence (not the EOD-count layout) get ``klo = 0``: the mask alone is exact."""
    b, s = document_ids.shape
    block = BLOCK_16BIT if dtype.itemsize == 2 else BLOCK
    size = block if s > block else s
    los = list(range(0, s, size))
    ids = document_ids.detach().cpu()
    if s > 1 and bool((ids[:, 1:] < ids[:, :-1]).any()):
        klos = [0] * len(los)
    else:   # first index of each block's first document, per sample; the earliest over the batch
        first = torch.searchsorted(ids.contiguous(), ids[:, los].contiguous())   # [b, blocks]
        klos = first.min(dim=0).values.tolist()
    return [(lo, min(lo + size, s), klo) for lo, klo in zip(los, klos)]


_plan_cache: dict = {}   # (id(document_ids), dtype) -> (weakref to the ids, plan)


def _plan_once(document_ids: torch.Tensor, dtype: torch.dtype) -> list[tuple[int, int, int]]:
    """:func:`plan_blocks`, once per ids tensor: every layer of a forward (and its recompute) shares
    the layout's ids, so the host reads them once per forward, not once per layer."""
    key = (id(document_ids), dtype)
    hit = _plan_cache.get(key)
    if hit is not None and hit[0]() is document_ids:
        return hit[1]
    plan = plan_blocks(document_ids, dtype)
    if len(_plan_cache) > 8:
        _plan_cache.clear()
    _plan_cache[key] = (weakref.ref(document_ids), plan)
    return plan


def _block_bias(document_ids: torch.Tensor, lo: int, hi: int, klo: int,
                dtype: torch.dtype) -> torch.Tensor:
    """Additive mask ``[b, 1, hi - lo, 1, hi - klo]`` (broadcast over groups and heads): 0 where the
    query sees the key, -inf elsewhere."""
    seen = document_mask(document_ids, slice(lo, hi), slice(klo, hi))
    bias = torch.zeros(seen.shape, dtype=dtype, device=seen.device).masked_fill_(~seen, -math.inf)
    return bias[:, None, :, None, :]


class _DocumentCore(torch.autograd.Function):
    """q ``[b, a, s, d]``, k and v ``[b, g, s, d]``, ids ``[b, s]`` -> ``[b, a, s, d]`` (a view of
    ``[s, b, a, d]``, like :func:`~models.gpt.attention_core.attention_core`)."""

    @staticmethod
    def forward(ctx, q, k, v, document_ids, p, dtype):
        b, g = q.size(0), k.size(1)
        qh, kh, vh = _heads(q, g), _heads(k, g), _heads(v, g)     # [s, b, g, r, d], [s, b, g, 1, d]
        s, _, _, r, d = qh.shape
        scale = 1.0 / math.sqrt(d)
        qc, kc, vc = _rows(qh, dtype), _rows(kh, dtype), _rows(vh, dtype)   # [B, s r, d], [B, s, d]
        blocks = _plan_once(document_ids, dtype)
        out = torch.empty(s, b, g, r, d, dtype=q.dtype, device=q.device)
        probs, keeps = [], []
        for lo, hi, klo in blocks:
            rows = slice(lo * r, hi * r)
            scores = torch.bmm(qc[:, rows], kc[:, klo:hi].transpose(1, 2))   # [B, c r, n]
            scores.view(b, g, hi - lo, r, hi - klo).mul_(scale).add_(
                _block_bias(document_ids, lo, hi, klo, dtype))
            probs.append(torch.softmax(scores, dim=-1))
            dropped = probs[-1]
            if p > 0.0:
                dropped, keep = torch.native_dropout(dropped, p, True)
                keeps.append(keep)
            _put(out, lo, torch.bmm(dropped, vc[:, klo:hi]))
        ctx.save_for_backward(qc, kc, vc, *probs, *keeps)
        ctx.sizes, ctx.p, ctx.scale, ctx.blocks = (s, b, g, r), p, scale, blocks
        return out.flatten(2, 3).permute(1, 2, 0, 3)

    @staticmethod
    def backward(ctx, grad):
        qc, kc, vc, *saved = ctx.saved_tensors
        (s, b, g, r), p, scale, blocks = ctx.sizes, ctx.p, ctx.scale, ctx.blocks
        probs, keeps = saved[:len(blocks)], saved[len(blocks):]
        d = grad.size(3)
        do = _rows(_heads(grad, g), qc.dtype)                               # [B, s r, d]
        dkc, dvc = torch.zeros_like(kc), torch.zeros_like(vc)               # [B, s, d]
        dq = grad.new_empty(s, b, g, r, d)
        for i, (lo, hi, klo) in enumerate(blocks):
            rows = slice(lo * r, hi * r)
            dp = torch.bmm(do[:, rows], vc[:, klo:hi].transpose(1, 2))      # [B, c r, n]
            dropped = probs[i]
            if keeps:
                dropped = torch.ops.aten.native_dropout_backward(probs[i], keeps[i], 1.0 / (1.0 - p))
                dp = torch.ops.aten.native_dropout_backward(dp, keeps[i], 1.0 / (1.0 - p))
            ds = torch._softmax_backward_data(dp, probs[i], -1, qc.dtype).mul_(scale)
            _put(dq, lo, torch.bmm(ds, kc[:, klo:hi]))
            dkc[:, klo:hi] += torch.bmm(ds.transpose(1, 2), qc[:, rows])
            dvc[:, klo:hi] += torch.bmm(dropped.transpose(1, 2), do[:, rows])
        dk, dv = grad.new_empty(s, b, g, 1, d), grad.new_empty(s, b, g, 1, d)
        _put(dk, 0, dkc)
        _put(dv, 0, dvc)
        return (dq.flatten(2, 3).permute(1, 2, 0, 3), dk.flatten(2, 3).permute(1, 2, 0, 3),
                dv.flatten(2, 3).permute(1, 2, 0, 3), None, None, None)
