"""The masked attention of one block of queries against one block of keys, forward and backward, as
flash attention splits it (issue 31; Dao et al., FlashAttention, §3.1 and Algorithm 2), so context
parallelism can attend to the keys of another rank block by block and merge the partial results.

Mask: query ``t`` sees key ``u`` iff ``index[u] <= index[t]`` (causal over the global token index)
and, when document ids are given, ``doc[u] == doc[t]`` (the document mask of Megatron's
``--reset-attention-mask``). A block is attended by :func:`attend` with an explicit boolean mask or
``None`` (every key visible); the forward returns the block's output and its row log-sum-exp in fp32,
``lse = log sum_u exp(q k_u / sqrt(d))`` over the visible keys. A row that sees no key of the block
gives output 0 and ``lse = -inf`` (its probabilities are 0, not NaN), and :func:`merge` folds such a
block into a running result without changing it.

Backward recomputes the block's probabilities from the FINAL ``lse`` of each row (over every block
it attended): ``P = exp(S - lse)``, ``dV = P^T dO``, ``dP = dO V^T``, ``dS = P (dP - delta)`` with
``delta = rowsum(dO * O)`` of the final output, ``dQ = dS K / sqrt(d)``, ``dK = dS^T Q / sqrt(d)``.

Shapes: q ``[b, a, sq, d]``, k and v ``[b, g, sk, d]`` (query head j reads key/value head
``j // (a/g)``). The ``r = a/g`` query heads of a group are stacked along the rows,
``[b g, r sq, d] @ [b g, d, sk]``, so GQA needs no copies of k and v and the products over those rows
sum the heads' key and value gradients (as models/gpt/attention_core.py does). Products run in
``compute_dtype`` (bf16/fp16 products accumulate in fp32 inside the matmul); scores, softmax,
``lse`` and the merged outputs are fp32. One ``[b g, r sq, sk]`` score block exists at a time.

:func:`plan` cuts a query range and a key range into tiles by their index ranges: a tile whose keys
all come after its queries is skipped, one whose keys all come before needs no causal mask (with
document ids its mask is still built, and the tile is skipped when no pair is in one document), and
neighbouring tiles of one query range merge into one product.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def visible(q_index: torch.Tensor, k_index: torch.Tensor, q_doc: torch.Tensor | None = None,
            k_doc: torch.Tensor | None = None) -> torch.Tensor:
    """The mask ``[b or 1, sq, sk]`` (True: the key is visible) of queries ``q_index [sq]`` (and
    documents ``q_doc [b, sq]``) against keys ``k_index [sk]`` (``k_doc [b, sk]``)."""
    causal = (k_index[None, :] <= q_index[:, None])[None]                   # [1, sq, sk]
    if q_doc is None:
        return causal
    return causal & (q_doc[:, :, None] == k_doc[:, None, :])                # [b, sq, sk]


def _rows(x: torch.Tensor, groups: int, dtype: torch.dtype) -> torch.Tensor:
    """``[b, h, s, d]`` (any strides) -> contiguous ``[b groups, (h / groups) s, d]`` in ``dtype``."""
    b, h, s, d = x.shape
    return x.to(dtype).reshape(b * groups, (h // groups) * s, d)


def _scores(qc: torch.Tensor, kc: torch.Tensor, mask: torch.Tensor | None, shape: tuple,
            scale: float) -> torch.Tensor:
    """fp32 scaled scores ``[b g, r sq, sk]`` with hidden pairs at -inf (the scale rides on the
    product)."""
    b, g, r, sq, sk = shape
    scores = torch.baddbmm(qc.new_empty(b * g, r * sq, sk), qc, kc.transpose(1, 2), beta=0.0,
                           alpha=scale)
    scores = scores.float() if scores.dtype != torch.float32 else scores
    if mask is not None:
        scores.view(b, g, r, sq, sk).masked_fill_(~mask[:, None, None], -math.inf)
    return scores


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
           compute_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """One block: q ``[b, a, sq, d]``, k and v ``[b, g, sk, d]``, mask ``[b or 1, sq, sk]`` or None
    -> (out ``[b, a, sq, d]`` fp32, lse ``[b, a, sq]`` fp32). Four passes over the scores (max,
    subtract, exp, sum); the normalisation divides the ``[r sq, d]`` output, not the probabilities."""
    b, a, sq, d = q.shape
    g, sk = k.size(1), k.size(2)
    shape = (b, g, a // g, sq, sk)
    qc, kc, vc = _rows(q, g, compute_dtype), _rows(k, g, compute_dtype), _rows(v, g, compute_dtype)
    scores = _scores(qc, kc, mask, shape, 1.0 / math.sqrt(d))               # [b g, r sq, sk]
    top = scores.amax(dim=-1, keepdim=True)                                 # [b g, r sq, 1]
    if mask is not None:                                                    # rows seeing no key
        top.masked_fill_(top == -math.inf, 0.0)
    probs = scores.sub_(top).exp_()                                         # unnormalised
    total = probs.sum(dim=-1, keepdim=True)                                 # 0 for empty rows
    out = torch.bmm(probs.to(compute_dtype), vc).float()                    # [b g, r sq, d]
    out.div_(total.clamp(min=torch.finfo(torch.float32).tiny))
    lse = total.log_().add_(top).squeeze(-1)                                # -inf for empty rows
    return out.view(b, a, sq, d), lse.view(b, a, sq)


def attend_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                    lse: torch.Tensor, dout: torch.Tensor, delta: torch.Tensor,
                    compute_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of one block from the final ``lse [b, a, sq]`` and ``delta = rowsum(dO * O)``
    ``[b, a, sq]`` of its rows and the output gradient ``dout [b, a, sq, d]`` -> (dq ``[b, a, sq,
    d]``, dk, dv ``[b, g, sk, d]``), all fp32."""
    b, a, sq, d = q.shape
    g, sk = k.size(1), k.size(2)
    r, scale = a // g, 1.0 / math.sqrt(d)
    qc, kc, vc = _rows(q, g, compute_dtype), _rows(k, g, compute_dtype), _rows(v, g, compute_dtype)
    doc = _rows(dout, g, compute_dtype)                                     # [b g, r sq, d]
    scores = _scores(qc, kc, mask, (b, g, r, sq, sk), scale)
    lse = lse.reshape(b * g, r * sq, 1)
    if mask is not None:                                                    # rows seeing no key
        lse = lse.masked_fill(lse == -math.inf, 0.0)
    probs = scores.sub_(lse).exp_()                                         # P, [b g, r sq, sk]
    dv = torch.bmm(probs.to(compute_dtype).transpose(1, 2), doc)            # [b g, sk, d]
    dp = torch.bmm(doc, vc.transpose(1, 2))                                 # [b g, r sq, sk]
    dp = dp.float() if dp.dtype != torch.float32 else dp
    ds = dp.sub_(delta.reshape(b * g, r * sq, 1)).mul_(probs).to(compute_dtype)   # dS / scale
    dq = torch.baddbmm(qc.new_empty(qc.shape), ds, kc, beta=0.0, alpha=scale)  # [b g, r sq, d]
    dk = torch.baddbmm(kc.new_empty(kc.shape), ds.transpose(1, 2), qc, beta=0.0, alpha=scale)
    return (dq.float().view(b, a, sq, d), dk.float().view(b, g, sk, d),
            dv.float().view(b, g, sk, d))


def merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor,
          block_lse: torch.Tensor) -> None:
    """Fold a block's (out, lse) into the running ``out [b, a, sq, d]`` and ``lse [b, a, sq]``
    (fp32 views, updated in place): ``lse' = log(e^lse + e^block_lse)``, ``out' = out e^(lse -
    lse') + block_out e^(block_lse - lse')``. Rows that are -inf on both sides stay 0 / -inf."""
    new = torch.logaddexp(lse, block_lse)
    old_weight = torch.exp(lse - new).nan_to_num_(0.0)                      # -inf - -inf -> 0
    block_weight = torch.exp(block_lse - new).nan_to_num_(0.0)
    out.mul_(old_weight[..., None]).add_(block_out * block_weight[..., None])
    lse.copy_(new)


# Which kernel attends a tile: "auto" takes torch's CPU flash-attention kernel
# (aten._scaled_dot_product_flash_attention_for_cpu and its backward, which returns the row
# log-sum-exp and accepts the final output and log-sum-exp, so it fits block-wise attention) for CPU
# tensors and the batched products above elsewhere; "bmm" or "flash" force one (tests run both).
# Measured on one CPU thread, a [1, 8, 1024, 64] query block against 2048 keys: flash 2.2x faster
# than the products, forward and backward alike.
KERNEL = "auto"


def flash_kernel(device: torch.device) -> bool:
    return KERNEL == "flash" or (KERNEL == "auto" and device.type == "cpu")


def _heads(x: torch.Tensor, repeat: int, dtype: torch.dtype) -> torch.Tensor:
    """``[b, g, s, d]`` -> contiguous ``[b, g repeat, s, d]`` in ``dtype`` (head j = head j // repeat)."""
    x = x.to(dtype)
    return (x.repeat_interleave(repeat, dim=1) if repeat > 1 else x).contiguous()


def _bias(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Boolean mask ``[b or 1, sq, sk]`` -> additive ``[b or 1, 1, sq, sk]`` (0 / -inf)."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(
        ~mask, -math.inf)[:, None]


def flash_attend(q, k, v, mask, causal: bool, compute_dtype: torch.dtype):
    """:func:`attend` with torch's CPU flash kernel; ``causal``: the tile is a diagonal block (the
    same ascending indices on both sides), attended with the kernel's own causal mask."""
    b, a, sq, d = q.shape
    r = a // k.size(1)
    bias = _bias(mask, compute_dtype) if mask is not None and not causal else None
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.to(compute_dtype).contiguous(), _heads(k, r, compute_dtype), _heads(v, r, compute_dtype),
        0.0, causal, attn_mask=bias, scale=1.0 / math.sqrt(d))
    out, lse = out.float(), lse.float()
    if bias is not None:                       # rows seeing no key: lse -inf (the kernel says 0)
        empty = ~mask.any(dim=-1)[:, None]                                  # [b or 1, 1, sq]
        lse.masked_fill_(empty, -math.inf)
        out.masked_fill_(empty[..., None], 0.0)
    return out, lse


def flash_backward(q, k, v, mask, causal: bool, lse, dout, out, compute_dtype):
    """:func:`attend_backward` with torch's CPU flash kernel, from the final ``out`` rows (the
    kernel forms ``delta`` itself)."""
    b, a, sq, d = q.shape
    g, sk = k.size(1), k.size(2)
    r = a // g
    bias = _bias(mask, compute_dtype) if mask is not None and not causal else None
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout.to(compute_dtype).contiguous(), q.to(compute_dtype).contiguous(),
        _heads(k, r, compute_dtype), _heads(v, r, compute_dtype),
        out.to(compute_dtype).contiguous(), lse.contiguous(), 0.0, causal, attn_mask=bias,
        scale=1.0 / math.sqrt(d))
    dk, dv = (x.float().view(b, g, r, sk, d).sum(2) if r > 1 else x.float() for x in (dk, dv))
    return dq.float(), dk, dv


@dataclass(frozen=True)
class Tile:
    """Query rows ``[q0, q1)`` against key rows ``[k0, k1)`` of a block; ``masked``: the pair
    needs its mask (some pair in it is hidden); ``causal``: that mask is the plain lower triangle
    (the same ascending indices on both sides, no document border)."""

    q0: int
    q1: int
    k0: int
    k1: int
    masked: bool
    causal: bool = False


# rows of the finest tile of the batched products: near the causal diagonal the tiles are this
# small, so the products skip almost all of the hidden half of a diagonal block (neighbours merge
# back into long products). The flash kernel skips the hidden half itself: its tiles stay whole.
PART = 128


def part_count(length: int, chunks: int, device: torch.device) -> int:
    """How many equal parts to cut ``length`` tokens (``chunks`` layout chunks) into: the chunks,
    halved (for the batched products) while the parts stay >= :data:`PART` tokens and divide."""
    count = chunks if length % chunks == 0 else 1
    if flash_kernel(device):
        return count
    while length % (2 * count) == 0 and length // (2 * count) >= PART:
        count *= 2
    return count


def parts(index: torch.Tensor, count: int) -> list[tuple[int, int, int, int]]:
    """``index [s]`` cut into ``count`` equal ranges ``(start, end, min index, max index)``."""
    size = index.numel() // count
    lo_hi = torch.aminmax(index.view(count, size), dim=1)
    return [(i * size, (i + 1) * size, lo, hi)
            for i, (lo, hi) in enumerate(zip(lo_hi.min.tolist(), lo_hi.max.tolist()))]


def _is_diagonal(q_index: torch.Tensor, k_index: torch.Tensor) -> bool:
    return (q_index.numel() == k_index.numel() and torch.equal(q_index, k_index)
            and bool((q_index[1:] > q_index[:-1]).all()))


def plan(q_parts: list, k_parts: list, q_index: torch.Tensor, k_index: torch.Tensor,
         q_doc: torch.Tensor | None = None, k_doc: torch.Tensor | None = None, *,
         max_area: int | None = None, flash: bool = False) -> list[Tile]:
    """The tiles that hold visible pairs, from the parts (:func:`parts`) of the queries and the keys.
    Keys after every query of a part are skipped; keys before every query are visible unless a
    document border hides some (then the tile's mask decides, and a tile hiding everything goes).
    Neighbouring tiles merge into one product (fewer, larger matrix products) while the merged
    score block stays within ``max_area`` (query rows x keys; None: no limit): first the key parts
    of one query part, then query parts over the same keys. For the ``flash`` kernel only unmasked
    tiles merge (a diagonal tile keeps the kernel's own causal mask)."""
    def fits(rows: int, cols: int) -> bool:
        return max_area is None or rows * cols <= max_area

    def joins(first: list, second: list) -> bool:
        return not (flash and (first[4] or second[4]))

    tiles: list[list] = []                                # [q0, q1, k0, k1, masked, causal]
    for q0, q1, q_lo, q_hi in q_parts:
        row: list[list] = []
        for k0, k1, k_lo, k_hi in k_parts:
            if k_lo > q_hi:
                continue                                  # every key after every query
            masked, mask = k_hi > q_lo, None
            if q_doc is not None:
                mask = visible(q_index[q0:q1], k_index[k0:k1], q_doc[:, q0:q1], k_doc[:, k0:k1])
                if not bool(mask.any()):
                    continue
                masked = not bool(mask.all())
            causal = masked and _is_diagonal(q_index[q0:q1], k_index[k0:k1])
            if causal and mask is not None:           # one document throughout: causal alone
                causal = torch.equal(mask, visible(q_index[q0:q1], k_index[k0:k1]).expand_as(mask))
            tile = [q0, q1, k0, k1, masked, causal]
            last = row[-1] if row else None
            if (last is not None and last[3] == k0 and fits(q1 - q0, k1 - last[2])
                    and joins(last, tile)):
                last[3], last[4], last[5] = k1, last[4] or masked, False
            else:
                row.append(tile)
        for tile in row:
            last = tiles[-1] if tiles else None
            if (last is not None and last[1] == tile[0] and last[2:4] == tile[2:4]
                    and fits(tile[1] - last[0], tile[3] - tile[2]) and joins(last, tile)):
                last[1], last[4], last[5] = tile[1], last[4] or tile[4], False
            else:
                tiles.append(tile)
    return [Tile(*tile) for tile in tiles]


def tile_mask(tile: Tile, q_index, k_index, q_doc, k_doc) -> torch.Tensor | None:
    if not tile.masked:
        return None
    return visible(q_index[tile.q0:tile.q1], k_index[tile.k0:tile.k1],
                   None if q_doc is None else q_doc[:, tile.q0:tile.q1],
                   None if k_doc is None else k_doc[:, tile.k0:tile.k1])


def forward_tiles(tiles: list[Tile], q, k, v, q_index, k_index, q_doc, k_doc, out, lse,
                  compute_dtype) -> None:
    """Attend every tile of a key block and merge it into the running fp32 ``out`` / ``lse``."""
    flash = flash_kernel(q.device)
    for t in tiles:
        mask = None if flash and t.causal else tile_mask(t, q_index, k_index, q_doc, k_doc)
        args = (q[:, :, t.q0:t.q1], k[:, :, t.k0:t.k1], v[:, :, t.k0:t.k1], mask)
        block_out, block_lse = (flash_attend(*args, t.causal, compute_dtype) if flash
                                else attend(*args, compute_dtype))
        merge(out[:, :, t.q0:t.q1], lse[:, :, t.q0:t.q1], block_out, block_lse)


def backward_tiles(tiles: list[Tile], q, k, v, q_index, k_index, q_doc, k_doc, lse, dout, delta,
                   out, dq, dk, dv, compute_dtype) -> None:
    """Add every tile's gradients into the fp32 ``dq [b, a, sq, d]``, ``dk``, ``dv [b, g, sk, d]``
    (``delta = rowsum(dout * out)`` and ``out`` the final output; each kernel uses one)."""
    flash = flash_kernel(q.device)
    for t in tiles:
        mask = None if flash and t.causal else tile_mask(t, q_index, k_index, q_doc, k_doc)
        rows, cols = slice(t.q0, t.q1), slice(t.k0, t.k1)
        args = (q[:, :, rows], k[:, :, cols], v[:, :, cols], mask)
        if flash:
            dq_t, dk_t, dv_t = flash_backward(*args, t.causal, lse[:, :, rows], dout[:, :, rows],
                                              out[:, :, rows], compute_dtype)
        else:
            dq_t, dk_t, dv_t = attend_backward(*args, lse[:, :, rows], dout[:, :, rows],
                                               delta[:, :, rows], compute_dtype)
        dq[:, :, rows] += dq_t
        dk[:, :, cols] += dk_t
        dv[:, :, cols] += dv_t


def block_attention_forward(q, k, v, q_index, k_index, q_doc=None, k_doc=None, *,
                            compute_dtype: torch.dtype | None = None):
    """The masked block ``(q, k, v, q_index, k_index, q_doc, k_doc) -> (out fp32, lse fp32)``."""
    return attend(q, k, v, visible(q_index, k_index, q_doc, k_doc), compute_dtype or q.dtype)


def block_attention_backward(q, k, v, q_index, k_index, q_doc, k_doc, lse, dout, delta, *,
                             compute_dtype: torch.dtype | None = None):
    """Its backward: ``-> (dq, dk, dv)`` fp32 from the final ``lse`` and ``delta``."""
    return attend_backward(q, k, v, visible(q_index, k_index, q_doc, k_doc), lse, dout, delta,
                           compute_dtype or q.dtype)
