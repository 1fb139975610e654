"""ZeRO++'s quantized collectives (Wang et al. 2023): qwZ's parameter all-gather (§3.1) and qgZ's
hierarchical gradient reduce-scatter (§3.3), on top of :mod:`hybrid.comm` (so the ledger records
the int8 bytes that really travel) and :mod:`.quantize` (block-wise int8, one fp32 scale a block).

qwZ, :func:`quantized_all_gather`: each rank packs its shard [c] into one int8 row
[c + 4 ceil(c/256)], the rows are all-gathered [n, row], and every rank dequantizes all n of them
(its own too, so every rank computes with the same weights) into the compute-dtype output [n c].

qgZ, :func:`hierarchical_reduce_scatter`: the DP group is h hosts x m ranks; DP rank r = host x m
+ i (:meth:`hybrid.topology.Topology.dp_host_groups`). The result on rank r is chunk r of the sum of
every rank's ``full`` [n c]. Two all-to-alls, each summing in fp32 what it receives:

    1. inside the host (``dp_intra_host_group``, m ranks): ``full`` seen as [h, m, c] is regrouped
       into m rows [m, h c]; row j holds the chunks of the DP ranks at position j on every host and
       goes, quantized, to this host's member j. Dequantized and summed: [h c], this host's sum of
       the h chunks this rank's position is responsible for.
    2. across hosts (``dp_inter_host_group``, h ranks: the same position on every host): that
       [h c] is quantized as h rows [h, c], row k to host k; dequantized and summed: chunk r,
       summed over all n ranks.

ZeRO++ builds its quantized reduce-scatter from all-to-alls for the same reason: int8 values with
different scales cannot be summed by the network, so each hop ends in a local fp32 sum and the
next hop re-quantizes the partial sum. Compared with one flat reduce-scatter, a rank sends
(m-1) h c elements inside its host and only (h-1) c across hosts (the host's m ranks have already
combined their contributions), each as about 1 byte instead of 2 or 4. A hop over a group of one
rank sends nothing and is not quantized; with one DP rank nothing is quantized at all.

Both return a handle whose ``wait()`` finishes the work (the continuation runs there: the
dequantization, and for qgZ the second hop, which starts at once only when a host holds one DP
rank), like every :mod:`hybrid.comm` collective; on NCCL the waits inside only order the streams.
Temporary int8 and fp32 buffers are allocated per call. With tensor parallelism every
quantization takes the block scales' maximum over the TP group (:func:`tp_agreed_scales`, recorded
in the ledger as a TP all-reduce of 4 bytes per 256 elements), so TP-replicated parameters stay
equal on every TP rank (:mod:`.quantize`).
"""

from __future__ import annotations

from typing import Callable

import torch

from hybrid import comm
from hybrid.comm import Group
from hybrid.zero.quantize import pack, packed_numel, unpack


class _Continuation:
    """Handle of a collective whose last steps run locally: ``then()`` at the first ``wait()``."""

    def __init__(self, then: Callable[[], None]):
        self._then = then

    def wait(self) -> bool:
        if self._then is not None:
            then, self._then = self._then, None
            then()
        return True

    def is_completed(self) -> bool:
        return self._then is None


def _finish(handle: _Continuation, async_op: bool):
    if async_op:
        return handle
    handle.wait()
    return None


def tp_agreed_scales(tp: Group):
    """The ``agree`` of :func:`hybrid.zero.quantize.quantize` for TP group ``tp``: each block's
    scale becomes its maximum over the TP ranks (None with one TP rank: nothing to agree)."""
    if tp.size == 1:
        return None
    return lambda scales: comm.all_reduce(scales, tp, op="max")


def quantized_all_gather(output: torch.Tensor, shard: torch.Tensor, group: Group,
                         async_op: bool = False, agree=None, fmt: str = "int8"):
    """qwZ: every rank's ``shard`` [c] into ``output`` [n c] (any float dtype), sent as int8 rows
    [c + 4 ceil(c/256)] and dequantized on arrival (module docstring); ``agree``: the block scales
    shared over TP (:func:`tp_agreed_scales`); ``fmt="fp8"``: E4M3 payload bytes instead of int8
    (:mod:`.quantize`)."""
    n, c = group.size, shard.numel()
    if output.numel() != n * c:
        raise ValueError(f"all-gather output has {output.numel()} elements, expected {c} x {n}")
    if n == 1:
        output.copy_(shard.view_as(output))
        return _Continuation(lambda: None) if async_op else None
    sent = pack(shard.reshape(1, c), agree, fmt)                          # [1, row]
    received = torch.empty(n, packed_numel(c), dtype=torch.int8, device=shard.device)
    work = comm.all_gather_into(received, sent, group, async_op=True)    # [n, row]

    def dequantize() -> None:
        work.wait()
        output.view(n, c).copy_(unpack(received, c, fmt))
    return _finish(_Continuation(dequantize), async_op)


def _all_to_all_sum(rows: torch.Tensor, group: Group,
                    agree=None) -> tuple[object, Callable[[], torch.Tensor]]:
    """Row j of ``rows`` [size, k] to member j, quantized; returns (work, result) where result()
    after ``work.wait()`` is the fp32 sum [k] of the rows received. A group of one: no message."""
    size, k = rows.shape
    if size == 1:
        return None, lambda: rows[0].to(torch.float32)
    sent = pack(rows, agree)                                              # [size, row]
    received = torch.empty_like(sent)
    work = comm.all_to_all(received, sent, group, async_op=True)
    return work, lambda: unpack(received, k).sum(dim=0)


def hierarchical_reduce_scatter(output: torch.Tensor, full: torch.Tensor, intra: Group,
                                inter: Group, async_op: bool = False, agree=None):
    """qgZ: ``output`` [c] = chunk (DP rank) of the sum over DP of ``full`` [n c], n = hosts x
    per-host, in two quantized hops (module docstring). ``output`` may be a slice of ``full``
    (written last); ``full`` must stay untouched until ``wait()``, as for any reduce-scatter."""
    m, h, c = intra.size, inter.size, output.numel()
    if full.numel() != m * h * c:
        raise ValueError(f"reduce-scatter input has {full.numel()} elements, expected {c} x "
                         f"{m * h} ({h} hosts x {m} DP ranks each)")
    rows = full.reshape(h, m, c).transpose(0, 1).reshape(m, h * c)      # [m, h c], row j -> member j
    first, host_sum = _all_to_all_sum(rows, intra, agree)

    def across_hosts():
        if first is not None:
            first.wait()
        return _all_to_all_sum(host_sum().view(h, c), inter, agree)     # [h, c], row k -> host k
    started = across_hosts() if first is None else None   # one rank a host: hop 2 starts now

    def finish() -> None:
        second, total = started if started is not None else across_hosts()
        if second is not None:
            second.wait()
        output.view(-1).copy_(total())
    return _finish(_Continuation(finish), async_op)


def gradient_reduce_scatter(state, quantized: bool, expert: bool = False):
    """qgZ's gradient reduce-scatter for the engines, called as ``fn(output, full, async_op=...,
    scratch=...)``: :func:`hierarchical_reduce_scatter` over the state's host subgroups of DP (it
    keeps its own buffers, ``scratch`` is unused); None without ``quantized`` (the engines keep
    their own, :func:`hybrid.comm.reduce_scatter_replicated`). ``state``: a
    :class:`hybrid.parallel_state.ParallelState`. ``expert``: for the expert parameters' class
    (issue 32), over the host subgroups of the expert-DP group instead (expert-DP rank r = host
    x m + i as for DP: EP groups are consecutive DP ranks and the host split keeps rank order)."""
    if not quantized:
        return None
    if expert:
        intra, inter = state.require_expert_host_groups("--zero-quantized-gradients")
        if intra.size * inter.size != state.expert_dp.size:
            raise ValueError("--zero-quantized-gradients reduces the expert gradients inside each "
                             "host, then across hosts, so it needs the same number of expert-DP "
                             "ranks on every host; set --gpus-per-node to the machines' GPU count, "
                             "or drop the flag")
        return _hierarchical(intra, inter, tp_agreed_scales(state.tp))
    if state.cp_size > 1:
        raise ValueError(f"--zero-quantized-gradients reduces over the host split of DP, but under "
                         f"context parallelism (CP {state.cp_size}) gradients are reduced over DP x "
                         f"CP, whose host split is not built; drop the flag or use CP 1")
    intra, inter = state.dp_intra_host_group, state.dp_inter_host_group
    if intra is None or inter is None or intra.size * inter.size != state.dp_size:
        raise ValueError("--zero-quantized-gradients reduces inside each host, then across hosts, "
                         "so it needs the same number of DP ranks on every host; this layout's DP "
                         "group is spread unevenly (set --gpus-per-node to the machines' GPU count, "
                         "or drop the flag)")
    return _hierarchical(intra, inter, tp_agreed_scales(state.tp))


def _hierarchical(intra: Group, inter: Group, agree):
    def reduce(output: torch.Tensor, full: torch.Tensor, async_op: bool = False,
               scratch: torch.Tensor | None = None):
        return hierarchical_reduce_scatter(output, full, intra, inter, async_op, agree)
    return reduce
