"""Global-batch schedules: the batch grows with the samples consumed (GPT-3, Brown et al. 2020,
§2.3 and Table 2.1: "we linearly increase the batch size from a small value ... over the first 4-12
billion tokens"), with Megatron-LM's two spellings:

    --step-batch-size-schedule "0:16 2.4B:320 ... 12B:1536"
        THRESHOLD:BATCH pairs; the batch of a step is the one of the last threshold the samples
        consumed before it have reached. Thresholds count tokens (Megatron passes the sequence
        length, so a threshold is divided by it, rounding down, to give samples) and may carry a
        K/M/B/T suffix (1e3 ... 1e12); the first must be 0.
    --rampup-batch-size START INCREMENT SAMPLES
        the older linear ramp: START, growing by INCREMENT in (final - START) / INCREMENT equal
        slices of SAMPLES samples, then the final --global-batch-size. Megatron-LM now ignores it
        with a deprecation note; here it is the step schedule it always described.

A step's batch is a whole number of micro-batches on every data-parallel rank, so each batch of the
schedule must be a multiple of micro batch x DP (checked for every entry at start-up, where Megatron
checks the current one only). The learning rate follows the samples consumed, as Megatron's
scheduler steps by the samples of each step: see :meth:`BatchSchedule.position`.

Pure numbers (layer 0): the config check, the dry run and the trainer read one object.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

_SUFFIXES = {"K": 10 ** 3, "M": 10 ** 6, "B": 10 ** 9, "T": 10 ** 12}


class BatchScheduleError(ValueError):
    """An invalid batch schedule; the message says what to change."""


def _number(text: str, what: str) -> int:
    """``2.4B`` -> 2_400_000_000 (Megatron's suffixes), ``16`` -> 16."""
    body, scale = text.strip().upper(), 1
    if body and body[-1] in _SUFFIXES:
        body, scale = body[:-1], _SUFFIXES[body[-1]]
    try:
        value = float(body) * scale
    except ValueError:
        raise BatchScheduleError(f"--step-batch-size-schedule: {what} {text!r} is not a number "
                                 f"(a number with an optional K, M, B or T suffix)") from None
    if not math.isfinite(value) or value < 0:
        raise BatchScheduleError(f"--step-batch-size-schedule: {what} {text!r} must be >= 0")
    return int(value)


@dataclass(frozen=True)
class BatchSchedule:
    """``entries``: (first sample, global batch) pairs, thresholds strictly increasing from 0."""

    entries: tuple[tuple[int, int], ...]
    nominal: int    # the global batch the learning-rate schedule counts in (the final batch)

    def __post_init__(self) -> None:
        if not self.entries or self.entries[0][0] != 0:
            raise BatchScheduleError("--step-batch-size-schedule must start at threshold 0, e.g. "
                                     "'0:16 1M:32'")
        for (before, _), (after, _) in zip(self.entries, self.entries[1:]):
            if after <= before:
                raise BatchScheduleError(f"--step-batch-size-schedule thresholds must increase, got "
                                         f"{before} samples before {after}")
        for _, batch in self.entries:
            if batch < 1:
                raise BatchScheduleError(f"--step-batch-size-schedule batch sizes must be positive, "
                                         f"got {batch}")

    # ---- construction ------------------------------------------------------------------------
    @classmethod
    def parse(cls, text: str, seq_length: int, global_batch: int | None = None) -> "BatchSchedule":
        """Megatron's "THRESHOLD:BATCH ..." (commas or spaces between pairs) with thresholds in
        tokens. ``global_batch`` (--global-batch-size), when given, must equal the last batch."""
        pairs = []
        for entry in text.replace(",", " ").split():
            threshold, sep, batch = entry.partition(":")
            if not sep:
                raise BatchScheduleError(f"--step-batch-size-schedule entry {entry!r} is not "
                                         f"THRESHOLD:BATCH_SIZE, e.g. '0:16 2.4B:320'")
            pairs.append((_number(threshold, "threshold") // seq_length, _number(batch, "batch")))
        if not pairs:
            raise BatchScheduleError("--step-batch-size-schedule is empty; give THRESHOLD:BATCH "
                                     "pairs, e.g. '0:16 2.4B:320'")
        pairs.sort()
        final = pairs[-1][1]
        if global_batch is not None and global_batch != final:
            raise BatchScheduleError(
                f"--global-batch-size {global_batch} differs from the last batch of "
                f"--step-batch-size-schedule ({final}); drop --global-batch-size or make them equal")
        return cls(tuple(pairs), final)

    @classmethod
    def rampup(cls, start: int, increment: int, samples: int, final: int) -> "BatchSchedule":
        """The linear ramp of ``--rampup-batch-size START INCREMENT SAMPLES`` to ``final``: batch
        START + k INCREMENT from sample ceil(k x SAMPLES / n), n = (final - START) / INCREMENT."""
        flag = f"--rampup-batch-size {start} {increment} {samples}"
        if start < 1 or increment < 1 or samples < 0:
            raise BatchScheduleError(f"{flag}: the start batch and increment must be positive and "
                                     f"the ramp's samples >= 0")
        if final < start or (final - start) % increment:
            raise BatchScheduleError(f"{flag}: the final --global-batch-size {final} must be the "
                                     f"start plus a whole number of increments")
        steps = (final - start) // increment
        by_threshold: dict[int, int] = {}
        for k in range(steps + 1):   # a later batch wins where slices are under one sample
            first = math.ceil(k * samples / steps) if steps else 0
            by_threshold[first] = start + k * increment
        return cls(tuple(sorted(by_threshold.items())), final)

    # ---- queries -----------------------------------------------------------------------------
    def batch_at(self, consumed_samples: int) -> int:
        """The global batch of the step that starts after ``consumed_samples``."""
        batch = self.entries[0][1]
        for threshold, b in self.entries:
            if consumed_samples < threshold:
                break
            batch = b
        return batch

    def position(self, consumed_samples: int) -> float:
        """Where the learning-rate schedule stands, in steps of the nominal batch (Megatron steps
        its scheduler by the samples of each step): ``consumed / nominal``."""
        return consumed_samples / self.nominal

    def samples_after(self, iterations: int, consumed: int = 0) -> int:
        """Samples consumed after ``iterations`` more steps from ``consumed``."""
        for _ in range(iterations):
            consumed += self.batch_at(consumed)
        return consumed

    def iterations_for(self, train_samples: int) -> int:
        """Steps until ``train_samples`` are consumed, the last one may pass it (Megatron's
        ``update_train_iters``)."""
        steps = consumed = 0
        while consumed < train_samples:
            consumed += self.batch_at(consumed)
            steps += 1
        return steps

    def check_divisible(self, micro_batch: int, data_parallel: int, multiple_of: int = 1) -> None:
        """Every batch a whole number of micro-batches on each DP rank (and, for the interleaved
        pipeline schedule, of ``multiple_of`` micro-batches)."""
        unit = micro_batch * data_parallel
        for threshold, batch in self.entries:
            if batch % unit or (batch // unit) % multiple_of:
                need = unit * multiple_of
                raise BatchScheduleError(
                    f"the batch schedule's global batch {batch} (from sample {threshold}) is not a "
                    f"multiple of micro batch {micro_batch} x data-parallel size {data_parallel}"
                    + (f" x {multiple_of} (the interleaved pipeline's micro-batches per step)"
                       if multiple_of > 1 else "")
                    + f" = {need}; use batch sizes that are multiples of {need}")
