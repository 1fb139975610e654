"""Learning-rate schedule of GPT pretraining (Megatron-LM's OptimizerParamScheduler semantics).

Linear warm-up from 0 to ``lr`` over ``warmup`` iterations, then a cosine or linear decay to
``min_lr`` at ``decay_iters``, constant ``min_lr`` afterwards. A pure function of the iteration, so
resuming from a checkpoint needs nothing but the iteration number.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class LRSchedule:
    lr: float
    min_lr: float
    warmup_iters: int
    decay_iters: int
    style: str = "cosine"  # cosine | linear | constant

    def __post_init__(self) -> None:
        if self.style not in ("cosine", "linear", "constant"):
            raise ValueError(f"unknown lr decay style {self.style!r}; use cosine, linear or constant")
        if self.decay_iters < self.warmup_iters:
            raise ValueError(f"lr decay iterations {self.decay_iters} are fewer than the warm-up "
                             f"{self.warmup_iters}; raise --lr-decay-iters or lower --lr-warmup-iters")

    def __call__(self, iteration: int) -> float:
        """Learning rate of the optimizer step that produces iteration ``iteration + 1``."""
        if self.warmup_iters and iteration < self.warmup_iters:
            return self.lr * (iteration + 1) / self.warmup_iters
        if self.style == "constant":
            return self.lr
        if iteration >= self.decay_iters:
            return self.min_lr
        span = self.decay_iters - self.warmup_iters
        ratio = (iteration - self.warmup_iters) / span if span else 1.0
        if self.style == "linear":
            coeff = 1.0 - ratio
        else:
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        return self.min_lr + coeff * (self.lr - self.min_lr)


def build_lr_schedule(optimizer_section, train_iters: int) -> LRSchedule:
    """From the config's optimizer section. The decay length defaults to the training length (a run
    shorter than the warm-up stays in the warm-up)."""
    o = optimizer_section
    decay = o.lr_decay_iters or max(train_iters, o.lr_warmup_iters)
    return LRSchedule(o.lr, o.min_lr, o.lr_warmup_iters, decay, o.lr_decay_style)
