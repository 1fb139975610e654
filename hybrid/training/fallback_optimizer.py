"""Minimal fallback optimizer: plain data parallelism (ZeRO stage "none") with torch.optim.AdamW.

FALLBACK ONLY - used by the trainer when ``hybrid.zero.build_zero_optimizer`` is not available, and
by checkpoint tests that must not depend on the ZeRO engine. fp32 only: gradients are averaged over
the DP group with one all-reduce per parameter (baseline DP, 2Ψ per step, ZeRO §5), clipped by the
global norm across DP and TP (TP-replicated parameters counted once), then stepped by AdamW with
no weight decay on biases and norms. It exposes the same surface the trainer and the checkpoint code
use from the ZeRO optimizer (``backward``, ``step(lr)``, ``zero_grad``, ``owned_fragments``,
``load_fragments``, ``step_count``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn

from hybrid import comm
from hybrid.parallel_state import ParallelState


@dataclass
class FallbackStepResult:
    skipped: bool
    grad_norm: float
    loss_scale: float


@dataclass
class FallbackFragment:
    param_name: str
    kind: str        # master | exp_avg | exp_avg_sq
    offset: int
    tensor: torch.Tensor


class ReplicatedAdamW:
    """Every DP rank keeps full (TP-local) fp32 params and AdamW state; only DP rank 0's are saved."""

    fragments_replicated_over_dp = True

    def __init__(self, model: nn.Module, state: ParallelState, *, lr: float, betas=(0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, clip_grad: float = 0.0):
        self.model, self.state, self.clip_grad = model, state, clip_grad
        self.named = dict(model.named_parameters())
        decay = [p for p in self.named.values() if p.ndim >= 2]
        no_decay = [p for p in self.named.values() if p.ndim < 2]
        self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                                      {"params": no_decay, "weight_decay": 0.0}],
                                     lr=lr, betas=betas, eps=eps)
        self.step_count = 0

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def zero_grad(self) -> None:
        self.opt.zero_grad(set_to_none=True)

    def step(self, lr: float | None = None) -> FallbackStepResult:
        if lr is not None:
            for group in self.opt.param_groups:
                group["lr"] = lr
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.named.values()]
        for p, g in zip(self.named.values(), grads):
            comm.all_reduce(g, self.state.dp)
            g.div_(self.state.dp_size)
            p.grad = g
        norm = self._global_norm(grads)
        if self.clip_grad > 0 and norm > self.clip_grad:
            for g in grads:
                g.mul_(self.clip_grad / (norm + 1e-6))
        self.opt.step()
        self.step_count += 1
        return FallbackStepResult(False, norm, 1.0)

    def _global_norm(self, grads: list[torch.Tensor]) -> float:
        sharded = torch.zeros(1, dtype=torch.float64)
        replicated = torch.zeros(1, dtype=torch.float64)
        for p, g in zip(self.named.values(), grads):
            target = sharded if getattr(p, "tensor_model_parallel", False) else replicated
            target += g.double().pow(2).sum()
        comm.all_reduce(sharded, self.state.tp)
        return math.sqrt(float(sharded + replicated))

    # ---- checkpoint surface ------------------------------------------------------------------
    def owned_fragments(self) -> list[FallbackFragment]:
        """Whole TP-local tensors: the fp32 param is the master; moments created lazily."""
        out = []
        for name, p in self.named.items():
            out.append(FallbackFragment(name, "master", 0, p.data.view(-1)))
            st = self.opt.state[p]
            if not st:  # before the first step: materialise zero moments so they can be loaded
                st["step"] = torch.tensor(0.0)
                st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            out.append(FallbackFragment(name, "exp_avg", 0, st["exp_avg"].view(-1)))
            out.append(FallbackFragment(name, "exp_avg_sq", 0, st["exp_avg_sq"].view(-1)))
        return out

    def load_fragments(self, fragments: list[FallbackFragment]) -> None:
        """Copy given fragments into the owned ones (a no-op for the owned views themselves) and
        set AdamW's step counters to ``step_count``."""
        owned = {(f.param_name, f.kind): f for f in self.owned_fragments()}
        with torch.no_grad():
            for f in fragments:
                mine = owned[(f.param_name, f.kind)].tensor
                if mine.data_ptr() != f.tensor.data_ptr():
                    mine[f.offset:f.offset + f.tensor.numel()].copy_(f.tensor)
        for p in self.named.values():
            self.opt.state[p]["step"] = torch.tensor(float(self.step_count))
