"""Bytes the expert-parallel token dispatchers move (issue 32, items 2 and 6; docs/moe.md,
"Communication"). Pure arithmetic: the ledger test checks the exact form against
``hybrid.comm``'s records, the dry run and ``tools/rank_layouts.py`` print the estimate.

Per MoE layer and micro-batch, one rank of an EP group of ``ep`` ranks holding ``tokens`` tokens
(``T = micro batch x sequence``; every TP rank of the group sends the same), top-k routing, hidden
size h, b bytes per element:

``alltoall`` (exact): the rank sends S rows (its routes to experts on other EP ranks) and gets R
rows (other ranks' routes to its experts). Forward: dispatch sends S, combine sends R back;
backward: the combine's gradient sends S, the dispatch's gradient sends R. So

    bytes = 2 (S + R) h b        (hidden states; the rank's own routes never move)

plus, forward only, the counts exchange: an all-to-all of E int64 counts, (ep-1)/ep of 8 E bytes.
Summed over the EP group that is 4 X h b with X the routes that cross ranks: the routed tokens'
hidden states twice forward (dispatch, combine) and twice backward. With routes spread evenly,
S = R = T k (ep-1)/ep, so ``4 T k h b (ep-1)/ep`` per rank.

``allgather``: the group's tokens are all-gathered ([ep T, h], and the routes and probs), each
rank's weighted partial sums reduce-scattered back; backward the reverse. Per rank
``4 T (ep-1) h b`` for the hidden states, ep/k times the all-to-all's, plus
``(ep-1) T k (8 + 4)`` forward (indices, probs) and ``(ep-1) T k 4`` backward (probs' gradient).
"""

from __future__ import annotations

from dataclasses import dataclass

COUNT_BYTES = 8   # the counts exchanged before an all-to-all are int64
PROB_BYTES = 4    # routing probabilities are fp32


@dataclass(frozen=True)
class DispatchBytes:
    """Bytes one rank sends per MoE layer and micro-batch: hidden states forward and backward,
    and the routing metadata (counts, or indices and probs)."""

    forward: float
    backward: float
    metadata: float

    @property
    def total(self) -> float:
        return self.forward + self.backward + self.metadata


def alltoall_exact(sent_rows: int, received_rows: int, hidden: int, bytes_per_element: int,
                   num_experts: int, ep: int) -> DispatchBytes:
    """The all-to-all dispatcher's bytes for one layer call, from its real routing: ``sent_rows``
    routes of this rank to experts on other ranks, ``received_rows`` routes of other ranks to
    this rank's experts."""
    if ep == 1:
        return DispatchBytes(0.0, 0.0, 0.0)
    rows = (sent_rows + received_rows) * hidden * bytes_per_element
    return DispatchBytes(float(rows), float(rows), COUNT_BYTES * num_experts * (ep - 1) / ep)


def dispatch_bytes(dispatcher: str, tokens: int, topk: int, hidden: int, ep: int,
                   num_experts: int, bytes_per_element: int) -> DispatchBytes:
    """The expected bytes per rank, MoE layer and micro-batch with routes spread evenly over the
    experts (module docstring); zero at EP 1."""
    if ep == 1:
        return DispatchBytes(0.0, 0.0, 0.0)
    if dispatcher == "alltoall":
        crossing = tokens * topk * (ep - 1) / ep        # S = R
        return alltoall_exact(crossing, crossing, hidden, bytes_per_element, num_experts, ep)
    if dispatcher == "allgather":
        rows = 2 * tokens * (ep - 1) * hidden * bytes_per_element   # gather + reduce-scatter
        meta = (ep - 1) * tokens * topk * (COUNT_BYTES + 2 * PROB_BYTES)
        return DispatchBytes(float(rows), float(rows), float(meta))
    raise ValueError(f"dispatcher must be alltoall or allgather, got {dispatcher!r}")


def cp_statistics_bytes(tokens: int, topk: int, num_experts: int, cp: int, *,
                        sequences: int = 1, load_balancing: str = "none",
                        capacity: bool = False) -> float:
    """Bytes one rank moves on its CP group (ring volume, as the ledger counts it) for one MoE
    layer's router per micro-batch under context parallelism (docs/moe.md, "Expert parallelism
    with context parallelism"), ``tokens`` being this rank's T / C: the aux loss's route counts
    all-reduced (E fp32; ``seq_aux_loss``: ``sequences`` x E), and with a capacity factor the
    routes all-gathered (T k (index, probability) pairs as float64, 16 bytes). Once per
    micro-batch and model, not per layer, add :func:`cp_scale_bytes` when aux or z losses
    are on: the gradient scale's fp32 all-reduce in backward."""
    if cp == 1:
        return 0.0
    counts = {"aux_loss": num_experts, "seq_aux_loss": sequences * num_experts}.get(load_balancing, 0)
    total = 2 * (cp - 1) / cp * 4 * counts
    if capacity:
        total += (cp - 1) * tokens * topk * 16
    return total


def cp_scale_bytes(cp: int) -> float:
    """The aux-loss gradient scale's all-reduce (one fp32) per micro-batch backward, on CP."""
    return 2 * (cp - 1) / cp * 4 if cp > 1 else 0.0
