"""Learning-rate schedule of GPT pretraining (Megatron-LM's OptimizerParamScheduler semantics).

Linear warm-up from 0 to ``lr`` over ``warmup`` iterations, then a cosine or linear decay to
``min_lr`` at ``decay_iters``, constant ``min_lr`` afterwards. A pure function of the iteration, so
resuming from a checkpoint needs nothing but the iteration number and the schedule itself, which
the checkpoint stores (:meth:`LRSchedule.record`, in samples as Megatron's scheduler counts).

Lengths may be fractional iterations: a sample-based schedule (``--train-samples``,
``--lr-decay-samples``, ``--lr-warmup-samples``) or ``--lr-warmup-fraction`` is converted to
iterations of the run's global batch, which gives Megatron's learning rate at every iteration.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class LRSchedule:
    lr: float
    min_lr: float
    warmup_iters: float
    decay_iters: float
    style: str = "cosine"  # cosine | linear | constant
    start: float = 0.0     # the iteration of the schedule's step 0 (--no-load-optim restarts it)

    def __post_init__(self) -> None:
        if self.style not in ("cosine", "linear", "constant"):
            raise ValueError(f"unknown lr decay style {self.style!r}; use cosine, linear or constant")
        if self.decay_iters < self.warmup_iters:
            raise ValueError(f"lr decay iterations {self.decay_iters} are fewer than the warm-up "
                             f"{self.warmup_iters}; raise --lr-decay-iters or lower --lr-warmup-iters")

    def __call__(self, iteration: int) -> float:
        """Learning rate of the optimizer step that produces iteration ``iteration + 1``."""
        iteration -= self.start
        if self.warmup_iters and iteration < self.warmup_iters:
            return self.lr * min(1.0, (iteration + 1) / self.warmup_iters)
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

    def record(self, global_batch: int) -> dict:
        """What a checkpoint stores: the schedule with its lengths in samples (Megatron's unit)."""
        return {"lr": self.lr, "min_lr": self.min_lr, "style": self.style,
                "warmup_samples": self.warmup_iters * global_batch,
                "decay_samples": self.decay_iters * global_batch,
                "start_samples": self.start * global_batch}

    @classmethod
    def from_record(cls, record: dict, global_batch: int) -> "LRSchedule":
        return cls(record["lr"], record["min_lr"], record["warmup_samples"] / global_batch,
                   record["decay_samples"] / global_batch, record["style"],
                   record.get("start_samples", 0) / global_batch)


def build_lr_schedule(optimizer_section, train_iters: int, global_batch: int = 1,
                      train_samples: int | None = None) -> LRSchedule:
    """From the config's optimizer section. The decay length defaults to the training length (a run
    shorter than the warm-up stays in the warm-up); ``train_samples``: a sample-based run, whose
    ``lr_*_samples`` lengths are divided by ``global_batch``."""
    o = optimizer_section
    if train_samples is not None:
        decay = (o.lr_decay_samples or max(train_samples, o.lr_warmup_samples)) / global_batch
        warmup = o.lr_warmup_samples / global_batch
    else:
        decay = o.lr_decay_iters or max(train_iters, o.lr_warmup_iters)
        warmup = o.lr_warmup_iters
    if o.lr_warmup_fraction is not None:
        warmup = o.lr_warmup_fraction * decay
    return LRSchedule(o.lr, o.min_lr, warmup, decay, o.lr_decay_style)
