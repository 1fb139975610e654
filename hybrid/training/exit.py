"""Clean stops: SIGTERM (SLURM preemption, ``scancel``) and ``--exit-duration-in-mins``.

A signal arrives at one rank's process at an arbitrary point; acting on it there would desynchronise
the collectives. :class:`ExitCondition` only records it; the trainer asks :meth:`should_exit` once per
iteration, which all-reduces (MAX) a flag over the world group so every rank decides the same, saves
a checkpoint and leaves the loop together (Megatron-LM's exit-signal handler semantics).
"""

from __future__ import annotations

import logging
import signal
import time

import torch

from hybrid import comm

log = logging.getLogger(__name__)


class ExitCondition:
    """``with ExitCondition(world, duration_mins) as stop:`` installs the handler; poll
    ``stop.should_exit()`` once per iteration."""

    def __init__(self, world: comm.Group, duration_mins: float | None = None,
                 signals: tuple[int, ...] = (signal.SIGTERM,), device: torch.device | str = "cpu"):
        self.world, self.signals, self.device = world, signals, device
        self.deadline = time.monotonic() + duration_mins * 60 if duration_mins else None
        self.received: int | None = None
        self.reason: str | None = None
        self._previous = {}

    def _handler(self, signum, frame) -> None:
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
        clock passed the deadline."""
        local = 0
        if self.received is not None:
            local = 2
        elif self.deadline is not None and time.monotonic() >= self.deadline:
            local = 1
        code = comm.max_over(self.world, local, self.device)
        if code and self.reason is None:
            self.reason = "signal SIGTERM" if code == 2 else "--exit-duration-in-mins reached"
            log.warning("stopping: %s; saving a checkpoint", self.reason)
        return code > 0
