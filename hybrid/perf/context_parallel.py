"""Context parallelism in the performance models (issue 31): the bytes a CP rank moves per layer and
step for ring (p2p), all-to-all (a2a) and all-gather-KV attention, the sequence a rank holds, and the
ring's attention working set. Pure numbers (the config layer imports no torch).

Notation: ``C`` the CP degree, ``t`` the TP degree, ``b`` micro-batch, ``s`` the whole sequence,
``h`` hidden, ``a`` attention heads, ``g`` key/value heads (query groups; ``g = a`` without GQA),
``d = h / a`` the head size, ``e`` bytes per element of the attention's inputs (2 in bf16/fp16).
Each CP rank holds ``s / C`` tokens (two chunks of ``s / 2C``, hybrid/context_parallel/layout.py)
of ``a / t`` query heads and ``g / t`` key/value heads, so its local tensors are

    q, out, dq, dout   b (s / C) (a d / t) = b s h / (C t)        elements
    k, v, dk, dv       b (s / C) (g d / t)                         elements (one of them)

Bytes ONE rank sends per layer and micro-batch, each forward and backward of the attention
(``kv`` the elements of one of k, v; ``q`` those of q):

    p2p        forward   2 (C - 1) kv e + (C - 1) 8 m s/C   K and V (and the block's token
                                                    indices) travel C - 1 hops around the ring
               backward  2 (C - 1) kv e             K and V travel the ring again
                       + 2 (C - 1) kv e_grad        dK and dV travel back to their owners
                                                    (C - 1 hops: the partial sum of block j starts
                                                    at rank j + 1 and ends at j, which adds its own)
    a2a        forward   (C - 1) / C (2 q + 2 kv) e   4 all-to-alls: q, k, v in, out back
                       + (C - 1) 8 m s/C            all-gather of the token indices
               backward  (C - 1) / C (2 q + 2 kv) e_grad   dout in, dq, dk, dv back
    allgather  forward   2 (C - 1) kv e + (C - 1) 8 m s/C   all-gather of K, V and the indices
               backward  2 (C - 1) kv e_grad        reduce-scatter of dK and dV

``m`` int64 index rows per token: 1 (its global index) + ``b`` with document ids (document masking).
``e_grad``: bytes per element of the gradients on the wire; by default fp32 (4) for the ring's and
the all-gather's dK, dV (accumulated over ranks in fp32, hybrid/context_parallel/ring.py) and ``e``
for a2a's (its all-to-alls move the gradients in the activation dtype).
With selective or full recompute the attention's forward, and so its forward communication, runs
once more in backward (:func:`cp_bytes_per_step`). With GQA only the ``g`` key/value heads travel in
the ring, which is why p2p moves ``g / a`` of a2a's k, v share while a2a also moves q and out.
These are the volumes the ``cp`` group of the communication ledger records (hybrid/comm.py: a send
counts its bytes, and the matching receive records the same again; an all-to-all (C - 1) / C of its
input, an all-gather or reduce-scatter (C - 1) / C of the whole tensor).
"""

from __future__ import annotations

from dataclasses import dataclass

CP_COMM_TYPES = ("p2p", "a2a", "allgather")


@dataclass(frozen=True)
class CPBytes:
    """Bytes one CP rank sends for one layer's attention, one micro-batch."""

    forward: float
    backward: float

    @property
    def total(self) -> float:
        return self.forward + self.backward


def local_seq(seq: int, cp: int) -> int:
    """Tokens each CP rank holds: ``s / C`` (two chunks of ``s / 2C``); one clear error when the
    sequence does not cut into ``2 C`` equal chunks."""
    _positive(seq=seq, cp=cp)
    if cp > 1 and seq % (2 * cp):
        raise ValueError(f"sequence length {seq} is not divisible by 2 x context-parallel size = "
                         f"{2 * cp}; choose --seq-length a multiple of {2 * cp} or another "
                         f"--context-parallel-size")
    return seq // cp


def cp_bytes_per_layer(*, comm_type: str, cp: int, micro_batch: int, seq: int, hidden: int,
                       heads: int, query_groups: int | None = None, tp: int = 1,
                       bytes_per_element: int = 2,
                       grad_bytes_per_element: int | None = None,
                       document_ids: bool = False) -> CPBytes:
    """Bytes one CP rank sends for one layer and micro-batch (forward, backward), as the module
    docstring states. ``seq`` is the whole sequence, ``query_groups`` the key/value heads (None: one
    per head), ``bytes_per_element`` the wire dtype of q, k, v, out; ``grad_bytes_per_element`` that
    of the gradients (None: fp32 for p2p and allgather, ``bytes_per_element`` for a2a);
    ``document_ids``: the blocks carry document ids beside their token indices. CP 1 moves
    nothing."""
    if comm_type not in CP_COMM_TYPES:
        raise ValueError(f"cp comm type must be one of {CP_COMM_TYPES}, got {comm_type!r}")
    _positive(cp=cp, micro_batch=micro_batch, seq=seq, hidden=hidden, heads=heads, tp=tp,
              bytes_per_element=bytes_per_element)
    g = heads if query_groups is None else query_groups
    if hidden % heads or heads % g:
        raise ValueError(f"hidden {hidden}, heads {heads}, query groups {g}: heads must divide "
                         f"hidden and query groups divide heads")
    if cp == 1:
        return CPBytes(0.0, 0.0)
    e = bytes_per_element
    e_grad = grad_bytes_per_element or (e if comm_type == "a2a" else 4)
    s_loc = local_seq(seq, cp)
    tokens = micro_batch * s_loc
    q = tokens * hidden / tp                     # elements of q (and of out, dq, dout)
    kv = tokens * g * (hidden // heads) / tp     # elements of k (and of v, dk, dv)
    indices = (cp - 1) * 8 * (1 + (micro_batch if document_ids else 0)) * s_loc   # int64 rows
    if comm_type == "p2p":
        return CPBytes(2 * (cp - 1) * kv * e + indices, 2 * (cp - 1) * kv * (e + e_grad))
    if comm_type == "a2a":
        share = (cp - 1) / cp
        return CPBytes(share * (2 * q + 2 * kv) * e + indices, share * (2 * q + 2 * kv) * e_grad)
    return CPBytes(2 * (cp - 1) * kv * e + indices, 2 * (cp - 1) * kv * e_grad)


def cp_bytes_per_step(*, layers: int, micro_batches: int, recompute: str = "none",
                      **per_layer) -> float:
    """Bytes one CP rank sends per step: :func:`cp_bytes_per_layer` for each of its ``layers``
    (the pipeline stage's) and ``micro_batches``; selective and full recompute rerun the
    attention's forward, and its forward communication, in backward."""
    _positive(layers=layers, micro_batches=micro_batches)
    one = cp_bytes_per_layer(**per_layer)
    forwards = 2 if recompute.startswith(("full", "selective")) else 1
    return layers * micro_batches * (forwards * one.forward + one.backward)


def ring_working_bytes(*, cp: int, micro_batch: int, seq: int, hidden: int, heads: int,
                       query_groups: int | None = None, tp: int = 1, bytes_per_element: int = 2,
                       score_bytes: int = 4, explicit_scores: bool = True) -> float:
    """Transient bytes of one step of the ring on one rank, beside what the layer keeps: the K and V
    block being used and the one arriving (``4 kv e``), and, for an explicit core
    (``explicit_scores``), the fp32 scores and probabilities of the local queries against ONE
    travelling key block, ``2 b (a/t) (s/C)^2`` values, instead of all ``s`` keys; a flash kernel
    keeps its scores in on-chip tiles (0)."""
    _positive(cp=cp, micro_batch=micro_batch, seq=seq, hidden=hidden, heads=heads, tp=tp)
    g = heads if query_groups is None else query_groups
    s_loc = local_seq(seq, cp)
    kv = micro_batch * s_loc * g * (hidden // heads) / tp
    scores = 2 * micro_batch * heads / tp * s_loc * s_loc * score_bytes if explicit_scores else 0.0
    return (4 * kv * bytes_per_element if cp > 1 else 0.0) + scores


def check_a2a_heads(heads: int, query_groups: int | None, tp: int, cp: int) -> None:
    """a2a scatters the heads of a TP rank over the CP ranks: ``a / t`` and ``g / t`` must divide by
    ``C`` (one clear error naming the fix)."""
    g = heads if query_groups is None else query_groups
    for name, n in (("attention heads", heads), ("query groups (key/value heads)", g)):
        if n % tp or (n // tp) % cp:
            raise ValueError(f"--cp-comm-type a2a: {n} {name} / TP {tp} do not split over CP {cp}; "
                             f"use --cp-comm-type p2p or a CP degree dividing {n // max(tp, 1)}")


def _positive(**values: int) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
