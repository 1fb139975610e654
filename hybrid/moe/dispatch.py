"""Token dispatchers of a mixture-of-experts layer (issue 32): they carry each token's hidden state
to the experts it is routed to, grouped by expert, and bring the experts' outputs back weighted by
the routing probabilities.

The interface every dispatcher implements (the EP dispatchers of expert parallelism too):

    dispatch(hidden [T, h], expert_index [T, k] int64, probs [T, k] fp32)
        -> tokens [N, h] grouped by local expert in expert order, counts: list[int] (E_local)
    combine(expert_out [N, h]) -> [T, h]: y_t = sum_j probs[t, j] * out(t, j), over the routes kept

Routes with expert index -1 (dropped by the capacity, :mod:`hybrid.moe.router`) are excluded: no
row in ``tokens`` and nothing in the sum. Both steps are differentiable (gradients reach
``hidden``, ``probs`` and ``expert_out``). ``combine`` uses the state of the last ``dispatch``.

:class:`LocalDispatcher` is expert-parallel size 1: all E experts are on this rank, so the
permutation is a sort of the routes by expert; no communication.
"""

from __future__ import annotations

import torch


class LocalDispatcher:
    """All experts local (EP 1)."""

    def __init__(self, num_experts: int):
        self.num_experts = num_experts
        self._state = None

    def dispatch(self, hidden: torch.Tensor, expert_index: torch.Tensor,
                 probs: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        t, k = expert_index.shape
        flat = expert_index.reshape(-1)                                      # [T k] route -> expert
        kept = flat >= 0
        # dropped routes sort after every expert and are cut off
        key = torch.where(kept, flat, torch.full_like(flat, self.num_experts))
        order = torch.sort(key, stable=True).indices                         # routes by expert
        counts_t = torch.bincount(flat[kept], minlength=self.num_experts)
        counts = counts_t.tolist()
        order = order[:sum(counts)]                                          # [N]
        token = order // k                                                   # [N] source token
        self._state = (token, order, probs, t, counts_t)
        return hidden.index_select(0, token), counts                         # [N, h]

    def combine(self, expert_out: torch.Tensor) -> torch.Tensor:
        if self._state is None:
            raise RuntimeError("combine() needs a dispatch() first")
        token, order, probs, t, _ = self._state
        self._state = None
        weight = probs.reshape(-1).index_select(0, order)                    # [N] fp32
        weighted = expert_out.float() * weight.unsqueeze(1)                  # [N, h] fp32
        out = weighted.new_zeros(t, expert_out.size(1)).index_add(0, token, weighted)
        return out.to(expert_out.dtype)                                      # [T, h]

    def offsets(self) -> torch.Tensor:
        """Cumulative counts [E] int32 on the device (grouped GEMM offsets, no host read)."""
        return torch.cumsum(self._state[4], 0).to(torch.int32)
