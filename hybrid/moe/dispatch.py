"""Token dispatchers of a mixture-of-experts layer (issue 32): they carry each token's hidden state
to the experts it is routed to, grouped by expert, and bring the experts' outputs back weighted by
the routing probabilities.

The interface every dispatcher implements (the EP dispatchers of expert parallelism too):

    dispatch(hidden [T, h], expert_index [T, k] int64, probs [T, k] fp32)
        -> tokens [N, h] grouped by local expert in expert order, counts [E_local] int64 on the
           device (the experts' grouped GEMM offsets come from it without a host read)
    combine(expert_out [N, h]) -> [T, h]: y_t = sum_j probs[t, j] * out(t, j), over the routes kept

Routes with expert index -1 (dropped by the capacity, :mod:`hybrid.moe.router`) are excluded: no
row in ``tokens`` and nothing in the sum. Both steps are differentiable (gradients reach
``hidden``, ``probs`` and ``expert_out``). ``combine`` uses the state of the last ``dispatch``.

:class:`LocalDispatcher` is expert-parallel size 1: all E experts are on this rank, so the
permutation is a sort of the routes by expert; no communication.

With expert parallelism (EP carved out of DP, :mod:`hybrid.topology`) the E experts are split over
the EP group, EP rank e holding experts ``e*E/EP .. (e+1)*E/EP - 1``. Two dispatchers, chosen by
``--moe-token-dispatcher-type`` like Megatron-Core's:

* :class:`AllToAllDispatcher` (``alltoall``, the default): the routes are sorted by destination
  (expert order is destination-rank order), the per-(rank, expert) counts are exchanged first (a
  small all-to-all of int64), then the hidden states of exactly the routed tokens travel by one
  variable-size all-to-all (:func:`hybrid.comm.all_to_all_v`, no padding to a capacity), and are
  regrouped from (source rank, expert) order to (expert, source rank) order. ``combine`` reverses
  both and weights by the probs at the token's own rank. The backward of each all-to-all is the
  reverse all-to-all.
* :class:`AllGatherDispatcher` (``allgather``): every EP rank all-gathers the group's tokens, routes
  and probs, keeps the routes to its own experts, weights their outputs by the probs there, and a
  reduce-scatter returns each rank its tokens' sums. Simple, and it needs no counts, but it moves
  every token to every rank: worth it only for small EP or top-k close to E.

Under ``--compile`` (models/gpt/compile.py) the EP dispatchers' ``dispatch`` and ``combine`` run
eagerly between the compiled regions (``torch.compiler.disable``), like the TP collectives: they
communicate through hybrid.comm's ledger and size their outputs by counts read on the host.

Bytes per MoE layer and step: docs/moe.md, "Communication" (the ledger test checks them).
"""

from __future__ import annotations

import torch

from hybrid import comm
from hybrid.comm import Group
from hybrid.moe.router import count_routes
from hybrid.tensor_parallel.mappings import apply_communicating


class LocalDispatcher:
    """All experts local (EP 1). ``dropless`` (no capacity: no route is ever dropped) keeps every
    shape static: all ``T k`` routes are rows, nothing is read on the host. With a capacity the
    number of routes kept is read once (the rows' count; docs/moe.md, "Host synchronisation")."""

    def __init__(self, num_experts: int, dropless: bool = False):
        self.num_experts, self.dropless = num_experts, dropless
        self._state = None

    def dispatch(self, hidden: torch.Tensor, expert_index: torch.Tensor,
                 probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t, k = expert_index.shape
        flat = expert_index.reshape(-1)                                      # [T k] route -> expert
        # dropped routes sort after every expert and are cut off
        key = torch.where(flat >= 0, flat, torch.full_like(flat, self.num_experts))
        order = torch.sort(key, stable=True).indices                         # routes by expert
        counts = count_routes(key, self.num_experts + 1)[:-1]                # [E] on the device
        if not self.dropless:
            order = order[:int(counts.sum())]                                # [N] (host read)
        token = order // k                                                   # [N] source token
        self._state = (token, order, probs, t)
        return hidden.index_select(0, token), counts                         # [N, h]

    def combine(self, expert_out: torch.Tensor) -> torch.Tensor:
        if self._state is None:
            raise RuntimeError("combine() needs a dispatch() first")
        token, order, probs, t = self._state
        self._state = None
        weight = probs.reshape(-1).index_select(0, order)                    # [N] fp32
        weighted = expert_out.float() * weight.unsqueeze(1)                  # [N, h] fp32
        out = weighted.new_zeros(t, expert_out.size(1)).index_add(0, token, weighted)
        return out.to(expert_out.dtype)                                      # [T, h]


DISPATCHER_TYPES = ("alltoall", "allgather")


def _check_experts(num_experts: int, group: Group) -> int:
    if num_experts % group.size:
        raise ValueError(f"{num_experts} experts do not split evenly over {group.size} "
                         f"expert-parallel ranks; choose an EP degree that divides {num_experts}")
    return num_experts // group.size


def _check_routes(hidden: torch.Tensor, expert_index: torch.Tensor, probs: torch.Tensor) -> None:
    if hidden.dim() != 2 or expert_index.dim() != 2 or expert_index.shape != probs.shape \
            or expert_index.shape[0] != hidden.shape[0]:
        raise ValueError(f"dispatch needs hidden [T, h], expert_index and probs [T, k]; got "
                         f"{tuple(hidden.shape)}, {tuple(expert_index.shape)}, {tuple(probs.shape)}")


class _AllToAllV(torch.autograd.Function):
    """Rows ``send[j]`` of ``x`` to member j, ``recv[i]`` rows from member i; backward: the reverse."""

    @staticmethod
    def forward(ctx, x, recv, send, group):
        ctx.recv, ctx.send, ctx.group = recv, send, group
        out = x.new_empty((sum(recv), *x.shape[1:]))
        comm.all_to_all_v(out, x.contiguous(), recv, send, group)
        return out

    @staticmethod
    def backward(ctx, grad):
        back = grad.new_empty((sum(ctx.send), *grad.shape[1:]))
        comm.all_to_all_v(back, grad.contiguous(), ctx.send, ctx.recv, ctx.group)
        return back, None, None, None


class _GatherRows(torch.autograd.Function):
    """All-gather dim 0 over the group forward, reduce-scatter dim 0 backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = x.new_empty((x.shape[0] * group.size, *x.shape[1:]))
        comm.all_gather_into(out, x.contiguous(), group)
        return out

    @staticmethod
    def backward(ctx, grad):
        group = ctx.group
        out = grad.new_empty((grad.shape[0] // group.size, *grad.shape[1:]))
        comm.reduce_scatter_into(out, grad.contiguous(), group)
        return out, None


class _ReduceScatterRows(torch.autograd.Function):
    """Reduce-scatter dim 0 over the group forward, all-gather dim 0 backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = x.new_empty((x.shape[0] // group.size, *x.shape[1:]))
        comm.reduce_scatter_into(out, x.contiguous(), group)
        return out

    @staticmethod
    def backward(ctx, grad):
        group = ctx.group
        out = grad.new_empty((grad.shape[0] * group.size, *grad.shape[1:]))
        comm.all_gather_into(out, grad.contiguous(), group)
        return out, None


def all_to_all_rows(x: torch.Tensor, recv: list[int], send: list[int], group: Group) -> torch.Tensor:
    """Differentiable :func:`hybrid.comm.all_to_all_v` of the rows of ``x``."""
    return apply_communicating(_AllToAllV, x, recv, send, group, group=group)


def _weighted_sum(rows: torch.Tensor, weights: torch.Tensor, token: torch.Tensor,
                  num_tokens: int) -> torch.Tensor:
    """``out[t] = sum of weights[i] * rows[i] over the i with token[i] == t``, summed in fp32 at
    least (the probs' precision), returned in the rows' dtype. rows [R, h], weights/token [R] -> [T, h]."""
    acc = torch.promote_types(rows.dtype, torch.float32)
    out = torch.zeros((num_tokens, rows.shape[1]), dtype=acc, device=rows.device)
    out = out.index_add(0, token, rows.to(acc) * weights.to(acc).unsqueeze(1))
    return out.to(rows.dtype)


class _EPDispatcher:
    """What the two EP dispatchers share: the experts split over ``group`` and the state one
    ``dispatch`` leaves for its ``combine``."""

    def __init__(self, num_experts: int, group: Group):
        self.num_experts, self.group = num_experts, group
        self.num_local_experts = _check_experts(num_experts, group)
        self._saved = None

    def _take_saved(self):
        if self._saved is None:
            raise RuntimeError("combine() needs a dispatch() first")
        saved, self._saved = self._saved, None
        return saved


class AllToAllDispatcher(_EPDispatcher):
    """``alltoall``: variable-size all-to-all of exactly the routed tokens over the EP group."""

    @torch.compiler.disable   # communicates and sizes by the counts: eager between compiled regions
    def dispatch(self, hidden: torch.Tensor, expert_index: torch.Tensor, probs: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        _check_routes(hidden, expert_index, probs)
        ep, local = self.group.size, self.num_local_experts
        num_tokens, k = expert_index.shape
        flat = expert_index.reshape(-1)                                          # [T*k]
        key = torch.where(flat >= 0, flat, torch.full_like(flat, self.num_experts))   # dropped last
        order = torch.sort(key, stable=True).indices                         # by expert = by rank
        per_expert = count_routes(key, self.num_experts + 1)[:-1]                # [E]
        send_counts = per_expert.view(ep, local)             # row j: to rank j, per local expert
        recv_counts = comm.exchange_counts(send_counts, self.group)   # row i: from rank i
        # the split sizes, the one host read of this dispatcher (all_to_all_v takes them as ints)
        sizes = torch.cat([send_counts.sum(1), recv_counts.sum(1)]).tolist()
        send, recv = sizes[:ep], sizes[ep:]
        route = order[:sum(send)]                                            # [S] flat route ids
        token = torch.div(route, k, rounding_mode="floor")                      # [S] source token
        # index_select, not hidden[token]: its backward is an index_add, cheaper on a CPU than
        # the accumulating index_put of advanced indexing
        received = all_to_all_rows(hidden.index_select(0, token), recv, send, self.group)  # [R, h]
        # received is (source rank, local expert)-major; regroup to (local expert, source rank)
        block = torch.repeat_interleave(torch.arange(ep * local, device=hidden.device),
                                        recv_counts.reshape(-1).to(hidden.device),
                                        output_size=sum(recv))
        source, expert = torch.div(block, local, rounding_mode="floor"), block % local
        regroup = torch.sort(expert * ep + source, stable=True).indices         # [R]
        self._saved = (regroup, send, recv, token, probs.reshape(-1)[route], num_tokens)
        return received.index_select(0, regroup), recv_counts.sum(0)

    @torch.compiler.disable
    def combine(self, expert_out: torch.Tensor) -> torch.Tensor:
        regroup, send, recv, token, weights, num_tokens = self._take_saved()
        back = torch.empty_like(regroup)
        back[regroup] = torch.arange(regroup.numel(), device=regroup.device)   # inverse permutation
        returned = all_to_all_rows(expert_out.index_select(0, back), send, recv,
                                   self.group)                                   # [S, h] route order
        return _weighted_sum(returned, weights, token, num_tokens)


class AllGatherDispatcher(_EPDispatcher):
    """``allgather``: every EP rank sees every token and keeps the routes to its own experts.
    Every rank of the group must hold the same number of tokens (equal micro-batches)."""

    @torch.compiler.disable   # communicates and sizes by the counts: eager between compiled regions
    def dispatch(self, hidden: torch.Tensor, expert_index: torch.Tensor, probs: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        _check_routes(hidden, expert_index, probs)
        group, local = self.group, self.num_local_experts
        num_tokens, k = expert_index.shape
        every_hidden = apply_communicating(_GatherRows, hidden, group, group=group)    # [EP*T, h]
        every_probs = apply_communicating(_GatherRows, probs, group, group=group)      # [EP*T, k]
        every_index = expert_index.new_empty((num_tokens * group.size, k))
        comm.all_gather_into(every_index, expert_index.contiguous(), group)
        flat = every_index.reshape(-1)
        first = group.rank * local
        mine = (flat >= first) & (flat < first + local)                   # dropped: -1, not mine
        key = torch.where(mine, flat - first, torch.full_like(flat, local))  # local id, others last
        order = torch.sort(key, stable=True).indices
        counts = count_routes(key, local + 1)[:-1]                            # [E_local]
        # the routes to this rank's experts: their number is the one host read (the rows' count)
        route = order[:int(counts.sum())]                                     # [N] flat route ids
        token = torch.div(route, k, rounding_mode="floor")                   # [N] in EP*T tokens
        self._saved = (token, every_probs.reshape(-1)[route], num_tokens * group.size)
        return every_hidden.index_select(0, token), counts

    @torch.compiler.disable
    def combine(self, expert_out: torch.Tensor) -> torch.Tensor:
        token, weights, every_tokens = self._take_saved()
        summed = _weighted_sum(expert_out, weights, token, every_tokens)     # [EP*T, h] partial
        return apply_communicating(_ReduceScatterRows, summed, self.group, group=self.group)


def make_dispatcher(dispatcher_type: str, num_experts: int, ep: Group):
    """The EP dispatcher of ``--moe-token-dispatcher-type`` over the EP group ``ep``."""
    if dispatcher_type == "alltoall":
        return AllToAllDispatcher(num_experts, ep)
    if dispatcher_type == "allgather":
        return AllGatherDispatcher(num_experts, ep)
    raise ValueError(f"--moe-token-dispatcher-type must be one of {', '.join(DISPATCHER_TYPES)}, "
                     f"got {dispatcher_type!r}")
