"""Learning-rate schedule of GPT pretraining (Megatron-LM's OptimizerParamScheduler semantics).

Linear warm-up from 0 to ``lr`` over ``warmup`` iterations, then the decay style down to ``min_lr``
at ``decay_iters``, constant ``min_lr`` afterwards. With n the iteration and W, D the warm-up and
decay lengths (Megatron's ``get_lr``, its steps counted here in iterations):

    cosine / linear        min_lr + c * (lr - min_lr), r = (n - W) / (D - W),
                           c = (1 + cos(pi r)) / 2  or  1 - r
    constant               lr
    inverse-square-root    max(min_lr, lr * sqrt(W / n))
    WSD                    warmup-stable-decay: lr until D - S (S = ``wsd_decay_iters``), then
                           min_lr + c * (lr - min_lr) with r = (n - (D - S)) / S and the
                           ``wsd_style`` shape c: linear 1 - r, cosine (1 + cos(pi r)) / 2,
                           exponential 2 * 0.5**r - 1, minus_sqrt 1 - sqrt(r)

A pure function of the iteration, so resuming from a checkpoint needs nothing but the iteration
number and the schedule itself, which the checkpoint stores (:meth:`LRSchedule.record`, in samples
as Megatron's scheduler counts).

Lengths may be fractional iterations: a sample-based schedule (``--train-samples``,
``--lr-decay-samples``, ``--lr-warmup-samples``) or ``--lr-warmup-fraction`` is converted to
iterations of the run's global batch, which gives Megatron's learning rate at every iteration.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


STYLES = ("cosine", "linear", "constant", "inverse-square-root", "WSD")
WSD_STYLES = ("exponential", "linear", "cosine", "minus_sqrt")


def _wsd_coeff(style: str, ratio: float) -> float:
    """The WSD anneal's share of (lr - min_lr) at ``ratio`` in [0, 1] of the anneal: 1 -> 0."""
    if style == "linear":
        return 1.0 - ratio
    if style == "cosine":
        return 0.5 * (math.cos(math.pi * ratio) + 1.0)
    if style == "exponential":
        return 2.0 * 0.5 ** ratio - 1.0
    return 1.0 - math.sqrt(ratio)   # minus_sqrt


@dataclass(frozen=True)
class LRSchedule:
    lr: float
    min_lr: float
    warmup_iters: float
    decay_iters: float
    style: str = "cosine"  # one of STYLES
    start: float = 0.0     # the iteration of the schedule's step 0 (--no-load-optim restarts it)
    wsd_decay_iters: float | None = None   # WSD: the anneal's length, the last ones of decay_iters
    wsd_style: str | None = None           # WSD: the anneal's shape, one of WSD_STYLES

    def __post_init__(self) -> None:
        if self.style not in STYLES:
            raise ValueError(f"unknown lr decay style {self.style!r}; use {', '.join(STYLES)}")
        if self.decay_iters < self.warmup_iters:
            raise ValueError(f"lr decay iterations {self.decay_iters} are fewer than the warm-up "
                             f"{self.warmup_iters}; raise --lr-decay-iters or lower --lr-warmup-iters")
        if self.style == "inverse-square-root" and not self.warmup_iters > 0:
            raise ValueError("--lr-decay-style inverse-square-root decays as lr * sqrt(warm-up / "
                             "iteration): give it a warm-up (--lr-warmup-iters, "
                             "--lr-warmup-samples or --lr-warmup-fraction)")
        if (self.style == "WSD") != (self.wsd_decay_iters is not None):
            raise ValueError("--lr-decay-style WSD needs --lr-wsd-decay-iters (or "
                             "--lr-wsd-decay-samples), and those apply only to WSD")
        if self.style == "WSD":
            if self.wsd_style not in WSD_STYLES:
                raise ValueError(f"unknown --lr-wsd-decay-style {self.wsd_style!r}; use "
                                 f"{', '.join(WSD_STYLES)}")
            stable_and_decay = self.decay_iters - self.warmup_iters
            if not 0 < self.wsd_decay_iters <= stable_and_decay:
                raise ValueError(
                    f"the WSD decay of {self.wsd_decay_iters:g} iterations must be positive and "
                    f"fit in the {stable_and_decay:g} iterations between the warm-up's end "
                    f"({self.warmup_iters:g}) and the decay's end ({self.decay_iters:g}); lower "
                    f"--lr-wsd-decay-iters / --lr-wsd-decay-samples or raise --lr-decay-iters / "
                    f"--lr-decay-samples")

    def __call__(self, iteration: int) -> float:
        """Learning rate of the optimizer step that produces iteration ``iteration + 1``."""
        iteration -= self.start
        if self.warmup_iters and iteration < self.warmup_iters:
            return self.lr * min(1.0, (iteration + 1) / self.warmup_iters)
        if self.style == "constant":
            return self.lr
        if iteration > self.decay_iters:
            return self.min_lr
        if self.style == "inverse-square-root":   # iteration >= warmup_iters > 0 here
            return max(self.min_lr, self.lr * math.sqrt(self.warmup_iters / iteration))
        if self.style == "WSD":
            anneal_start = self.decay_iters - self.wsd_decay_iters
            if iteration <= anneal_start:
                return self.lr
            coeff = _wsd_coeff(self.wsd_style, (iteration - anneal_start) / self.wsd_decay_iters)
            return self.min_lr + coeff * (self.lr - self.min_lr)
        span = self.decay_iters - self.warmup_iters
        ratio = (iteration - self.warmup_iters) / span if span else 1.0
        if self.style == "linear":
            coeff = 1.0 - ratio
        else:
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        return self.min_lr + coeff * (self.lr - self.min_lr)

    def record(self, global_batch: int) -> dict:
        """What a checkpoint stores: the schedule with its lengths in samples (Megatron's unit)."""
        wsd = None if self.wsd_decay_iters is None else self.wsd_decay_iters * global_batch
        return {"lr": self.lr, "min_lr": self.min_lr, "style": self.style,
                "warmup_samples": self.warmup_iters * global_batch,
                "decay_samples": self.decay_iters * global_batch,
                "start_samples": self.start * global_batch,
                "wsd_decay_samples": wsd, "wsd_style": self.wsd_style}

    @classmethod
    def from_record(cls, record: dict, global_batch: int) -> "LRSchedule":
        """Checkpoints written before WSD existed have no ``wsd_*`` keys: no WSD anneal."""
        wsd = record.get("wsd_decay_samples")
        return cls(record["lr"], record["min_lr"], record["warmup_samples"] / global_batch,
                   record["decay_samples"] / global_batch, record["style"],
                   record.get("start_samples", 0) / global_batch,
                   None if wsd is None else wsd / global_batch, record.get("wsd_style"))


def build_lr_schedule(optimizer_section, train_iters: int, global_batch: int = 1,
                      train_samples: int | None = None) -> LRSchedule:
    """From the config's optimizer section. The decay length defaults to the training length (a run
    shorter than the warm-up stays in the warm-up); ``train_samples``: a sample-based run, whose
    ``lr_*_samples`` lengths are divided by ``global_batch``. The WSD fields are set only for
    ``--lr-decay-style WSD`` (Megatron ignores them otherwise; the config refuses them)."""
    o = optimizer_section
    if train_samples is not None:
        decay = (o.lr_decay_samples or max(train_samples, o.lr_warmup_samples)) / global_batch
        warmup = o.lr_warmup_samples / global_batch
        wsd = None if o.lr_wsd_decay_samples is None else o.lr_wsd_decay_samples / global_batch
    else:
        decay = o.lr_decay_iters or max(train_iters, o.lr_warmup_iters)
        warmup = o.lr_warmup_iters
        wsd = o.lr_wsd_decay_iters
    if o.lr_warmup_fraction is not None:
        warmup = o.lr_warmup_fraction * decay
    if o.lr_decay_style != "WSD":
        return LRSchedule(o.lr, o.min_lr, warmup, decay, o.lr_decay_style)
    return LRSchedule(o.lr, o.min_lr, warmup, decay, o.lr_decay_style,
                      wsd_decay_iters=wsd, wsd_style=o.lr_wsd_decay_style)
