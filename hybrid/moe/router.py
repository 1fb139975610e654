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

Capacity (token dropping, GShard §2.2): with ``capacity_factor`` each expert takes at most
``C = ceil(capacity_factor * T * k / E)`` of the routes of this rank's micro-batch. An expert
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

    def forward(self, x: torch.Tensor, num_sequences: int = 1) -> Routing:
        """``x`` [T, h] with tokens in Megatron's ``[s, b]`` order flattened (token t belongs to
        sequence ``t % num_sequences``; only seq_aux_loss reads it)."""
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
        aux = self._aux_loss(logits, scores, expert_index, num_sequences)
        z = None
        if self.z_loss_coeff is not None:
            z = self.z_loss_coeff * torch.logsumexp(logits, dim=-1).square().mean()
        dropped = load.new_zeros(())
        if self.capacity_factor is not None:
            expert_index, probs, dropped = drop_over_capacity(expert_index, probs, self.num_experts,
                                                              self.capacity_factor)
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

    def _aux_loss(self, logits, scores, expert_index, num_sequences) -> torch.Tensor | None:
        kind = self.load_balancing_type
        if kind == "none" or not self.aux_loss_coeff:
            return None
        if self.score_function == "sigmoid":
            p = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
        else:
            p = scores if scores is not None else torch.softmax(logits, dim=-1)   # [T, E]
        # [T, E] 0/1 (the k choices are distinct); a scatter: one_hot checks its range on the host
        onehot = logits.new_zeros(logits.shape).scatter_(1, expert_index, 1.0)
        if kind == "aux_loss":
            f = onehot.mean(dim=0) / self.topk                                   # [E]
            return self.aux_loss_coeff * self.num_experts * (f * p.mean(dim=0)).sum()
        # seq_aux_loss: tokens [s * b] in [s, b] order -> per sequence [b, s, E]
        b, e = num_sequences, self.num_experts
        f = onehot.view(-1, b, e).mean(dim=0) / self.topk                        # [b, E]
        per_seq = (f * p.view(-1, b, e).mean(dim=0)).sum(dim=-1)                 # [b]
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
                       factor: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Apply the capacity rule of the module docstring: (expert_index with -1 where dropped, probs
    with 0 there, number of dropped routes). Vectorised: routes sorted by probability (stable, so
    ties keep token order), then by expert (stable); a route's rank inside its expert's run is its
    position minus the run's start."""
    t, k = expert_index.shape
    cap = capacity(t, k, num_experts, factor)
    flat_e, flat_p = expert_index.reshape(-1), probs.detach().reshape(-1)
    by_prob = torch.sort(flat_p, descending=True, stable=True).indices
    by_expert = by_prob[torch.sort(flat_e[by_prob], stable=True).indices]    # grouped, prob-desc
    counts = count_routes(flat_e, num_experts)
    starts = torch.cumsum(counts, 0) - counts                                # [E]
    rank_in_expert = torch.arange(flat_e.numel(), device=flat_e.device) - starts[flat_e[by_expert]]
    keep = torch.empty_like(flat_e, dtype=torch.bool)
    keep[by_expert] = rank_in_expert < cap
    keep = keep.view(t, k)
    new_index = torch.where(keep, expert_index, torch.full_like(expert_index, DROPPED))
    return new_index, probs * keep, (~keep).sum()
