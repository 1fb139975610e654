"""Clean stops: SIGTERM (SLURM preemption, ``scancel``), SIGINT (Ctrl-C) and ``--exit-duration-in-mins``.

A signal arrives at one rank's process at an arbitrary point; acting on it there would desynchronise
the collectives. :class:`ExitCondition` only records it; the trainer asks :meth:`should_exit` once per
iteration, which all-reduces (MAX) a flag over the world group so every rank decides the same, saves
a checkpoint and leaves the loop together (Megatron-LM's exit-signal handler semantics). A second
SIGINT (Ctrl-C twice) does not wait: it raises :class:`Interrupted` at once, saving nothing more.

Outside the loop :class:`SetupSignals` holds the two signals: before training there is nothing to
save, so a signal raises :class:`Interrupted` (the rank stops at once, with one line); once training
has started it is only recorded, so the final save and the exit go on.
"""

from __future__ import annotations

import logging
import signal
import time

import torch

from hybrid import comm

log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Interrupted(BaseException):
    """A stop signal where nothing is (or can be any more) saved; ``code`` is the exit code.
    Not an Exception, like KeyboardInterrupt: no ``except Exception`` on the way may take it for
    a failure of what it interrupted (a save, a collective)."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


def _interrupted_again() -> Interrupted:
    return Interrupted("interrupted again: stopped at once without saving; the last complete "
                       "checkpoint is unchanged", 128 + signal.SIGINT)


class SetupSignals:
    """``with SetupSignals() as signals:`` around a rank's whole program; call
    :meth:`training_started` once the trainer exists (the loop's ExitCondition then takes over)."""

    def __init__(self):
        self.training = False
        self._previous = {}

    def __enter__(self) -> "SetupSignals":
        for s in STOP_SIGNALS:
            self._previous[s] = signal.signal(s, self._handler)
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)

    def training_started(self) -> None:
        self.training = True

    def _handler(self, signum, frame) -> None:
        if not self.training:
            raise Interrupted(f"stopped by {signal.Signals(signum).name} before training started: "
                              f"nothing to save", 0)


class ExitCondition:
    """``with ExitCondition(world, duration_mins) as stop:`` installs the handler; poll
    ``stop.should_exit()`` once per iteration."""

    def __init__(self, world: comm.Group, duration_mins: float | None = None,
                 signals: tuple[int, ...] = STOP_SIGNALS, device: torch.device | str = "cpu"):
        self.world, self.signals, self.device = world, signals, device
        self.deadline = time.monotonic() + duration_mins * 60 if duration_mins else None
        self.received: int | None = None
        self.reason: str | None = None
        self._previous = {}
        self._in_flight: torch.Tensor | None = None   # accelerator: the last agreement, unread

    def _handler(self, signum, frame) -> None:
        if self.received is not None and signum == signal.SIGINT:
            raise _interrupted_again()
        self.received = signum

    def __enter__(self) -> "ExitCondition":
        for s in self.signals:
            self._previous[s] = signal.signal(s, self._handler)
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)

    def should_exit(self) -> bool:
        """Collective over the world group: True on every rank if any rank got a signal or its
        clock passed the deadline.

        On an accelerator the agreement is read one iteration late (issue 36): this call enqueues
        the all-reduce of this iteration's flag and reads the previous iteration's, whose result
        the device produced while the host queued the step since - so the host never waits for the
        step it just queued, and the run stops (and saves) one iteration after the signal. On the
        CPU the read is immediate."""
        local = 0
        if self.received is not None:
            local = int(self.received)   # SIGINT 2, SIGTERM 15: above the deadline's 1
        elif self.deadline is not None and time.monotonic() >= self.deadline:
            local = 1
        if torch.device(self.device).type == "cpu":
            code = comm.max_over(self.world, local, self.device)
        else:
            flag = torch.full((1,), local, dtype=torch.int64, device=self.device)   # a fill, no copy
            with comm.unrecorded(self.world):
                comm.all_reduce(flag, self.world, op="max")
            previous, self._in_flight = self._in_flight, flag
            code = int(previous.item()) if previous is not None else 0
        if code and self.reason is None:
            self.reason = (f"signal {signal.Signals(code).name}" if code > 1
                           else "--exit-duration-in-mins reached")
            log.warning("stopping: %s; saving a checkpoint", self.reason)
        return code > 0
