"""The learning-rate schedule on resume, as Megatron-LM's OptimizerParamScheduler decides it.

A checkpoint stores the schedule it trained with (lr, min lr, warm-up and decay lengths in samples,
decay style, WSD's decay length and shape). Resuming with flags that give another schedule - a
longer ``--train-iters`` that moves the default decay end, another ``--lr``, ``--min-lr``, warm-up,
``--lr-decay-iters``, ``--lr-decay-style`` or WSD's ``--lr-wsd-decay-iters`` /
``--lr-wsd-decay-style`` - is an error naming both values, unless
``--override-opt_param-scheduler`` (take this command line's schedule) or
``--use-checkpoint-opt_param-scheduler`` (take the checkpoint's) says which one to keep. A longer
``--train-iters`` with an explicit ``--lr-decay-iters`` leaves the schedule unchanged, so it simply
trains on at ``--min-lr``.
``--no-load-optim`` loads no schedule either: a fresh one starts at the loaded iteration (a new
warm-up), as Megatron's scheduler does when its state is not loaded.
"""

from __future__ import annotations

import dataclasses
import logging
import math

from pretrain.lr_schedule import LRSchedule, build_lr_schedule
from pretrain.sections import TrainConfigError, found_by_every_rank

log = logging.getLogger(__name__)

# field of LRSchedule -> (what it is, the flags that set it)
_FIELDS = (("lr", "peak learning rate", "--lr"),
           ("min_lr", "minimum learning rate", "--min-lr"),
           ("warmup_iters", "warm-up iterations",
            "--lr-warmup-iters / --lr-warmup-samples / --lr-warmup-fraction"),
           ("decay_iters", "decay iterations",
            "--lr-decay-iters / --lr-decay-samples, default --train-iters / --train-samples"),
           ("style", "decay style", "--lr-decay-style"),
           ("wsd_decay_iters", "WSD decay iterations",
            "--lr-wsd-decay-iters / --lr-wsd-decay-samples"),
           ("wsd_style", "WSD decay style", "--lr-wsd-decay-style"))


def _same(a, b) -> bool:
    if a is None or b is None or isinstance(a, str) or isinstance(b, str):
        return a == b
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)


def schedule_differences(saved: LRSchedule, mine: LRSchedule) -> list[str]:
    """'<what> (<flags>): checkpoint X, this run Y' for every part of the schedule that differs."""
    return [f"{what} ({flags}): checkpoint {getattr(saved, name)!r}, this run {getattr(mine, name)!r}"
            for name, what, flags in _FIELDS if not _same(getattr(saved, name), getattr(mine, name))]


def resume_schedule(mine: LRSchedule, saved_record: dict | None, global_batch: int,
                    optimizer_section) -> LRSchedule:
    """The schedule a resumed run trains with (see the module docstring); ``saved_record``: the
    checkpoint's :meth:`LRSchedule.record`, None for checkpoints written before it was stored."""
    if saved_record is None:
        return mine
    saved = LRSchedule.from_record(saved_record, global_batch)
    mine = dataclasses.replace(mine, start=saved.start)   # where the run's schedule began
    diffs = schedule_differences(saved, mine)
    if not diffs:
        return mine
    o = optimizer_section
    if o.override_opt_param_scheduler:
        log.info("--override-opt_param-scheduler: training with this command line's schedule (%s)",
                 "; ".join(diffs))
        return mine
    if o.use_checkpoint_opt_param_scheduler:
        log.info("--use-checkpoint-opt_param-scheduler: training with the checkpoint's schedule (%s)",
                 "; ".join(diffs))
        return saved
    raise found_by_every_rank(TrainConfigError(
        "the learning-rate schedule differs from the checkpoint's: " + "; ".join(diffs) + "; pass "
        "--override-opt_param-scheduler to train with this command line's schedule, or "
        "--use-checkpoint-opt_param-scheduler to keep the checkpoint's"))


def run_schedule(cfg, layout, resumed=None) -> LRSchedule:
    """The schedule a run on ``layout`` (its :class:`~hybrid.layout.RunLayout`) trains with: its
    flags' (:func:`build_lr_schedule`); ``resumed``: the
    loaded :class:`~pretrain.resume.TrainState` (None: a new run). --finetune starts the flags'
    schedule at iteration 0; --no-load-optim starts it at the loaded iteration; a full resume
    reconciles it with the checkpoint's (:func:`resume_schedule`)."""
    global_batch = layout.global_batch
    schedule = build_lr_schedule(cfg.optimizer, cfg.train_iterations(layout), global_batch,
                                 cfg.training.train_samples)
    c = cfg.checkpoint
    if resumed is None or c.finetune:
        return schedule
    if not c.load_optim:   # Megatron loads no scheduler state either: a fresh one starts here
        return dataclasses.replace(schedule, start=resumed.iteration)
    return resume_schedule(schedule, resumed.lr_schedule, global_batch, cfg.optimizer)
