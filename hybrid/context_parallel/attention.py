"""The context-parallel attention entry point (issue 31, contract 3): softmax attention over the whole
sequence when every CP rank holds only its load-balanced part of it (:mod:`.layout`).

``context_parallel_attention(q, k, v, *, group, comm_type, token_index, document_ids=None,
compute_dtype=None)``: q ``[b, a, s_loc, d]``, k and v ``[b, g, s_loc, d]`` (g divides a; query
head j reads key/value head ``j // (a/g)``), ``group`` the CP :class:`hybrid.comm.Group`,
``token_index`` int64 ``[s_loc]`` (the global index of each local token,
``layout.local_positions``), ``document_ids`` int64 ``[b, s_loc]`` or None. Query t sees key u iff
``token_index[u] <= token_index[t]`` and (with document ids) ``document_ids[u] ==
document_ids[t]``; softmax scale ``1 / sqrt(d)``, no dropout. Returns ``[b, a, s_loc, d]`` in q's
dtype, differentiable in q, k and v; products in ``compute_dtype`` (q's dtype by default), softmax
statistics in fp32.

``comm_type``: ``p2p`` (:mod:`.ring`, ring attention), ``a2a`` (:mod:`.all_to_all`, Ulysses) or
``allgather`` (:mod:`.allgather`, the all-gather-KV baseline). The traffic is recorded in the ledger
under the group's kind (``cp``); bytes per step of each are stated in those modules and in
docs/context-parallel.md.
"""

from __future__ import annotations

import torch

from hybrid.comm import Group
from hybrid.context_parallel.all_to_all import a2a_attention
from hybrid.context_parallel.allgather import allgather_attention
from hybrid.context_parallel.ring import ring_attention

COMM_TYPES = ("p2p", "a2a", "allgather")


def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group: Group,
                               comm_type: str, token_index: torch.Tensor,
                               document_ids: torch.Tensor | None = None,
                               compute_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Masked attention of this CP rank's queries over the keys of every rank of ``group``."""
    _check(q, k, v, group, comm_type, token_index, document_ids)
    dtype = compute_dtype or q.dtype
    if comm_type == "p2p":
        return ring_attention(q, k, v, group, token_index, document_ids, dtype)
    if comm_type == "a2a":
        return a2a_attention(q, k, v, group, token_index, document_ids, dtype)
    return allgather_attention(q, k, v, group, token_index, document_ids, dtype)


def _check(q, k, v, group, comm_type, token_index, document_ids) -> None:
    if comm_type not in COMM_TYPES:
        raise ValueError(f"context-parallel comm type must be one of {', '.join(COMM_TYPES)}, got "
                         f"{comm_type!r} (--cp-comm-type)")
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape:
        raise ValueError(f"context-parallel attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v "
                         f"{tuple(v.shape)}: expected q [b, a, s, d] and k, v [b, g, s, d]")
    b, a, s, d = q.shape
    g = k.size(1)
    if (k.size(0), k.size(2), k.size(3)) != (b, s, d) or a % g:
        raise ValueError(f"context-parallel attention: q {tuple(q.shape)}, k {tuple(k.shape)}: "
                         f"k and v must be [b, g, s, d] with g dividing the {a} query heads")
    if token_index.shape != (s,) or token_index.dtype != torch.int64:
        raise ValueError(f"context-parallel attention: token_index must be int64 [{s}] (the global "
                         f"index of each local token, layout.local_positions), got "
                         f"{token_index.dtype} {tuple(token_index.shape)}")
    if document_ids is not None and (document_ids.shape != (b, s)
                                     or document_ids.dtype != torch.int64):
        raise ValueError(f"context-parallel attention: document_ids must be int64 [{b}, {s}], got "
                         f"{document_ids.dtype} {tuple(document_ids.shape)}")
    if group.size > 1 and s % 2:
        raise ValueError(f"context-parallel attention: {s} local tokens cannot be the two equal "
                         f"chunks of the load-balanced layout (sequence length must be divisible "
                         f"by 2 x context-parallel size)")
    if comm_type == "a2a" and (a % group.size or g % group.size):
        raise ValueError(f"--cp-comm-type a2a scatters attention heads over the {group.size} CP "
                         f"ranks: {a} query heads and {g} key/value groups (per TP rank) must both "
                         f"be divisible by {group.size}; use --cp-comm-type p2p or another "
                         f"--context-parallel-size")
