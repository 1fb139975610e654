"""The top-k token router of a mixture-of-experts layer (issue 32): Switch Transformer (Fedus et al.
2021, §2.1-2.2), GShard (Lepikhin et al. 2020, §2.2), Mixtral (Jiang et al. 2024, §2.1), ST-MoE's
router z-loss (Zoph et al. 2022, §3.1), DeepSeekMoE's sequence-wise balance loss (Dai et al. 2024,
§4.1) and DeepSeek-V3's auxiliary-loss-free balancing (DeepSeek-AI 2024, §2.1.2).

Everything is fp32 whatever the model's dtype: the input and the weight are cast before the
product, so routing decisions do not depend on bf16 rounding. For ``T`` tokens and ``E`` experts:

    logits = x W^T                                              [T, E]
    softmax, Mixtral order (pre_softmax False): top-k of the logits, softmax over those k
    softmax, pre_softmax True: softmax over all E, then top-k of the probabilities
    sigmoid (DeepSeek-V3): s = sigmoid(logits); top-k of s + b (b: the expert bias, selection
                only); the chosen s normalised to sum 1 over the k (when k > 1)
    then probs *= topk_scaling_factor (when set)

Balancing losses (coefficients from the config; each 0 / unset is off), over this micro-batch:

    aux_loss      E * sum_e f_e P_e,   f_e = tokens routed to e / (T k),  P_e = mean_t p_te
                  (p: the softmax over all E, or the sigmoid scores normalised per token)
    seq_aux_loss  the same per sequence (f and P over one sequence's tokens), averaged over them
    z_loss        mean_t logsumexp(logits_t)^2

The expert bias is a buffer, not a parameter: after each optimizer step
``b_e += rate * sign(mean load - load_e)`` from the loads of the whole global batch (summed over
the data-parallel ranks by the caller: :meth:`Router.update_expert_bias`).

Context parallelism (``cp``: the CP group, issue 31): this rank holds 2 of the 2C load-balanced
chunks of every sequence (hybrid/context_parallel/layout.py), so T here is T_g / C. Routing is per
token and needs nothing; every statistic above is over the WHOLE micro-batch, as at CP 1: the route
counts f (per expert, or per sequence and expert) are summed over the CP group (one all-reduce,
no gradient), T and the sequence length are the global ones, and each rank's loss is its tokens'
share of the mean over the whole sequences (P_e's and the z-loss's sums over its tokens / T_g);
the C shares add up to the CP-1 loss, and so do their gradients (the caller scales every share by
the whole micro-batch's loss gradient: models/gpt/moe.py). The capacity is that of the whole
micro-batch too: the routes are all-gathered over CP, put back in sequence order, and every CP
rank drops exactly what CP 1 drops.

Capacity (token dropping, GShard §2.2): with ``capacity_factor`` each expert takes at most
``C = ceil(capacity_factor * T * k / E)`` of the routes of this rank's micro-batch (under CP the
whole sequences'). An expert
offered more keeps the C routes with the largest routing probability and drops the rest. Ties
(top-1 Mixtral routing gives every route probability 1) go to the earlier position in the
sequence, then the lower sequence index in the micro-batch (the ``[s, b]`` token order), then the
earlier of the token's k choices; a dropped route gets expert index -1 and
probability 0, and the token's other routes are unchanged (no renormalisation). The balancing
losses and the load metrics count the routes before dropping.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn

from hybrid import comm
from hybrid.comm import Group
from hybrid.context_parallel.layout import merge_sequence, split_sequence

DROPPED = -1   # expert index of a route dropped by the capacity


@dataclass
class Routing:
    """One micro-batch's routing: ``expert_index`` [T, k] int64 (-1: dropped), ``probs`` [T, k]
    fp32 (0 where dropped), the balancing losses (fp32 scalars with their graphs, already times
    their coefficients; None when off) and ``load`` [E] (routes per expert before dropping) and
    ``dropped`` (routes dropped) for metrics."""

    expert_index: torch.Tensor
    probs: torch.Tensor
    aux_loss: torch.Tensor | None
    z_loss: torch.Tensor | None
    load: torch.Tensor
    dropped: torch.Tensor


class Router(nn.Module):
    """``weight`` [E, h] (replicated over TP, in the model's dtype; used in fp32) and, with expert
    bias, the fp32 buffer ``expert_bias`` [E]."""

    def __init__(self, hidden: int, num_experts: int, topk: int, *, score_function: str = "softmax",
                 pre_softmax: bool = False, topk_scaling_factor: float | None = None,
                 load_balancing_type: str = "aux_loss", aux_loss_coeff: float = 0.0,
                 z_loss_coeff: float | None = None, enable_expert_bias: bool = False,
                 bias_update_rate: float = 1e-3, capacity_factor: float | None = None,
                 device=None, dtype=None):
        super().__init__()
        self.num_experts, self.topk = num_experts, topk
        self.score_function, self.pre_softmax = score_function, pre_softmax
        self.topk_scaling_factor = topk_scaling_factor
        self.load_balancing_type, self.aux_loss_coeff = load_balancing_type, aux_loss_coeff
        self.z_loss_coeff, self.capacity_factor = z_loss_coeff, capacity_factor
        self.bias_update_rate = bias_update_rate
        self.weight = nn.Parameter(torch.empty(num_experts, hidden, device=device, dtype=dtype))
        if enable_expert_bias:
            self.register_buffer("expert_bias", torch.zeros(num_experts, device=device,
                                                            dtype=torch.float32))
            # routes per expert since the last bias update (this rank's micro-batches)
            self.register_buffer("pending_load", torch.zeros(num_experts, device=device,
                                                             dtype=torch.float32),
                                 persistent=False)
        else:
            self.expert_bias = None
            self.pending_load = None

    def forward(self, x: torch.Tensor, num_sequences: int = 1, cp: Group | None = None) -> Routing:
        """``x`` [T, h] with tokens in Megatron's ``[s, b]`` order flattened (token t belongs to
        sequence ``t % num_sequences``; seq_aux_loss and the capacity read it). ``cp``: the CP
        group holding the rest of every sequence in the load-balanced layout (module docstring);
        None or one rank: these T tokens are the whole micro-batch."""
        cp = cp if cp is not None and cp.size > 1 else None
        if self.expert_bias is not None and self.expert_bias.is_meta:
            self.reset_buffers(x.device)   # built on meta and never materialised (ZeRO stage 3)
        logits = x.float() @ self.weight.float().t()                     # [T, E] fp32
        scores, selection = self._scores(logits)
        _, expert_index = torch.topk(selection, self.topk, dim=-1)       # [T, k]
        probs = self._probs(logits, scores, expert_index)
        if self.topk_scaling_factor is not None:
            probs = probs * self.topk_scaling_factor
        load = count_routes(expert_index, self.num_experts)
        if self.pending_load is not None and torch.is_grad_enabled():
            # training forward (recompute's first forward runs without grad: counted once)
            self.pending_load += load.float()
        aux = self._aux_loss(logits, scores, expert_index, num_sequences, cp)
        z = None
        if self.z_loss_coeff is not None:   # mean over the whole micro-batch's T_g tokens
            total = logits.size(0) * (cp.size if cp is not None else 1)
            z = self.z_loss_coeff * torch.logsumexp(logits, dim=-1).square().sum() / total
        dropped = load.new_zeros(())
        if self.capacity_factor is not None:
            expert_index, probs, dropped = drop_over_capacity(expert_index, probs, self.num_experts,
                                                              self.capacity_factor, cp,
                                                              num_sequences)
        return Routing(expert_index, probs, aux, z, load, dropped)

    def _scores(self, logits: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(scores over all E or None for Mixtral's order, what top-k selects on)."""
        if self.score_function == "sigmoid":
            scores = torch.sigmoid(logits)
            if self.expert_bias is not None:
                return scores, scores.detach() + self.expert_bias          # selection only
            return scores, scores
        if self.pre_softmax:
            scores = torch.softmax(logits, dim=-1)
            return scores, scores
        return None, logits

    def _probs(self, logits, scores, expert_index) -> torch.Tensor:
        if self.score_function == "sigmoid":
            chosen = scores.gather(1, expert_index)                      # [T, k]
            if self.topk > 1:
                chosen = chosen / (chosen.sum(dim=-1, keepdim=True) + 1e-20)
            return chosen
        if self.pre_softmax:
            return scores.gather(1, expert_index)
        return torch.softmax(logits.gather(1, expert_index), dim=-1)     # Mixtral

    def _aux_loss(self, logits, scores, expert_index, num_sequences,
                  cp: Group | None) -> torch.Tensor | None:
        kind = self.load_balancing_type
        if kind == "none" or not self.aux_loss_coeff:
            return None
        if self.score_function == "sigmoid":
            p = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
        else:
            p = scores if scores is not None else torch.softmax(logits, dim=-1)   # [T, E]
        # [T, E] 0/1 (the k choices are distinct); a scatter: one_hot checks its range on the host
        onehot = logits.new_zeros(logits.shape, dtype=torch.float32).scatter_(1, expert_index, 1.0)
        c = cp.size if cp is not None else 1
        if kind == "aux_loss":   # over the whole micro-batch: T_g = T C tokens
            tokens = onehot.size(0) * c
            f = _sum_over_cp(onehot.sum(dim=0), cp) / (tokens * self.topk)      # [E], no grad
            return self.aux_loss_coeff * self.num_experts * (f * p.sum(dim=0) / tokens).sum()
        # seq_aux_loss: tokens [s * b] in [s, b] order -> per sequence [b, s, E]
        b, e = num_sequences, self.num_experts
        length = onehot.size(0) // b * c                                         # whole sequence
        f = _sum_over_cp(onehot.view(-1, b, e).sum(dim=0), cp) / (length * self.topk)   # [b, E]
        per_seq = (f * p.view(-1, b, e).sum(dim=0) / length).sum(dim=-1)         # [b]
        return self.aux_loss_coeff * e * per_seq.mean()

    @torch.no_grad()
    def reset_buffers(self, device) -> None:
        """The initial state on ``device``: zero expert bias and no pending load."""
        if self.expert_bias is not None:
            self.expert_bias = torch.zeros(self.num_experts, device=device)
            self.pending_load = torch.zeros(self.num_experts, device=device)

    @torch.no_grad()
    def update_expert_bias(self, dp_group: Group | None) -> None:
        """DeepSeek-V3's bias step, once per optimizer step: the loads counted since the last call
        are summed over ``dp_group`` (the data-parallel ranks, whose micro-batches make up the
        global batch), then ``b += rate * sign(mean - load)``; the count restarts."""
        if self.expert_bias is None:
            return
        load = self.pending_load
        if dp_group is not None and dp_group.size > 1:
            comm.all_reduce(load, dp_group)
        self.expert_bias += self.bias_update_rate * torch.sign(load.mean() - load)
        self.pending_load.zero_()


def _sum_over_cp(counts: torch.Tensor, cp: Group | None) -> torch.Tensor:
    """Route counts of this rank's tokens -> of the whole sequences (summed over CP; no graph)."""
    if cp is None:
        return counts
    counts = counts.detach().clone()
    comm.all_reduce(counts, cp)
    return counts


def count_routes(index: torch.Tensor, n: int) -> torch.Tensor:
    """Routes per value of ``index`` (any shape, values in 0..n-1): [n] int64 on its device.
    A scatter-add, not ``torch.bincount``, which reads the maximum on the host on CUDA."""
    flat = index.reshape(-1)
    return torch.zeros(n, dtype=torch.int64, device=flat.device).index_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int64))


def capacity(num_tokens: int, topk: int, num_experts: int, factor: float) -> int:
    """Routes one expert may take: ceil(factor * T * k / E)."""
    return math.ceil(factor * num_tokens * topk / num_experts)


def drop_over_capacity(expert_index: torch.Tensor, probs: torch.Tensor, num_experts: int,
                       factor: float, cp: Group | None = None, num_sequences: int = 1,
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Apply the capacity rule of the module docstring: (expert_index with -1 where dropped, probs
    with 0 there, number of this rank's dropped routes). Under CP (``cp`` of more than one rank,
    tokens ``[s/C, b]`` in the load-balanced layout) the rule runs on the whole sequences' routes,
    all-gathered (one all-gather of T k (index, probability) pairs), on every CP rank alike."""
    if cp is None or cp.size == 1:
        keep = _keep_within_capacity(expert_index, probs.detach(), num_experts, factor)
    else:
        t, k = expert_index.shape
        pairs = torch.stack([expert_index.double(), probs.detach().double()], dim=-1)  # [T, k, 2]
        every = pairs.new_empty((cp.size * t, k, 2))
        comm.all_gather_into(every, pairs.contiguous(), cp)
        parts = every.view(cp.size, t // num_sequences, num_sequences, k, 2).unbind(0)
        whole = merge_sequence(list(parts), dim=0).reshape(-1, k, 2)        # [s b, k, 2] in order
        keep = _keep_within_capacity(whole[..., 0].long(), whole[..., 1], num_experts, factor)
        keep = split_sequence(keep.view(-1, num_sequences, k), 0, cp.rank, cp.size).reshape(t, k)
    new_index = torch.where(keep, expert_index, torch.full_like(expert_index, DROPPED))
    return new_index, probs * keep, (~keep).sum()


def _keep_within_capacity(expert_index: torch.Tensor, probs: torch.Tensor, num_experts: int,
                          factor: float) -> torch.Tensor:
    """[T, k] bool, the routes the capacity keeps. Vectorised: routes sorted by probability
    (stable, so ties keep token order), then by expert (stable); a route's rank inside its
    expert's run is its position minus the run's start."""
    t, k = expert_index.shape
    cap = capacity(t, k, num_experts, factor)
    flat_e, flat_p = expert_index.reshape(-1), probs.reshape(-1)
    by_prob = torch.sort(flat_p, descending=True, stable=True).indices
    by_expert = by_prob[torch.sort(flat_e[by_prob], stable=True).indices]    # grouped, prob-desc
    counts = count_routes(flat_e, num_experts)
    starts = torch.cumsum(counts, 0) - counts                                # [E]
    rank_in_expert = torch.arange(flat_e.numel(), device=flat_e.device) - starts[flat_e[by_expert]]
    keep = torch.empty_like(flat_e, dtype=torch.bool)
    keep[by_expert] = rank_in_expert < cap
    return keep.view(t, k)
