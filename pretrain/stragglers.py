"""Straggler report (issue 34, part 4; Megatron-LM's ``--log-straggler``): every log interval, each
rank's training-step time split into compute, communication wait and data wait, its median step's
split gathered to every rank by one all-gather of three numbers, and the slowest ranks named in one log line when they are
over ``--straggler-threshold`` times the median.

    data wait   seconds inside the loader's ``next`` (the micro-batches of the step)
    comm wait   seconds inside the collectives and their handles' ``wait()`` (hybrid.comm's ledger
                measures them while this report is on: ``CommLedger.wait_seconds``)
    compute     the rest of the step (forward, backward, the optimizer's arithmetic)

In a synchronous step every rank's step time is the same: a slow rank makes the others wait inside
the next collective. So the straggler is the rank whose own time - compute plus data wait, what it
does not spend waiting for its peers - is long; that is what the threshold compares with the median
rank's. Each rank sends its median step of the interval (per category), so one step lost to the
scheduler or the file system does not make a straggler; a rank slow at every step does. The
per-category minimum, median and maximum over the ranks are TensorBoard scalars
(``straggler/compute-seconds-max``, ...; seconds per iteration). Nothing is measured, gathered or
logged without ``--log-straggler``: the trainer then holds no report and the ledger does not time.
"""

from __future__ import annotations

import logging
import time

import torch

from hybrid import comm
from hybrid.parallel_state import ParallelState

log = logging.getLogger(__name__)

CATEGORIES = ("compute", "comm-wait", "data-wait")


class StragglerReport:
    """Per-interval timers of this rank and the gathered report (one per trainer)."""

    def __init__(self, state: ParallelState, threshold: float, minmax_count: int = 1):
        self.state, self.threshold, self.count = state, threshold, minmax_count
        self.ledger = state.ledger
        self.ledger.wait_seconds = 0.0   # the collectives start timing themselves
        self._reset()

    def _reset(self) -> None:
        self.data_seconds = 0.0          # inside the loader's next, running total
        self.steps: list[tuple[float, float, float]] = []   # (compute, comm wait, data wait)

    def timed_loader(self, loader):
        """``loader`` with the time inside ``next`` counted as data wait."""
        for_next = iter(loader)

        class _Timed:
            def __iter__(inner):
                return inner

            def __next__(inner):
                start = time.perf_counter()
                try:
                    return next(for_next)
                finally:
                    self.data_seconds += time.perf_counter() - start

            def close(inner):
                close = getattr(loader, "close", None)
                if close is not None:
                    close()
        return _Timed()

    def timed_step(self, step, *args):
        """Run one training step ``step(*args)``, counting its wall time."""
        start, waited, fed = time.perf_counter(), self.ledger.wait_seconds, self.data_seconds
        try:
            return step(*args)
        finally:
            total = time.perf_counter() - start
            comm_wait = self.ledger.wait_seconds - waited    # outside steps: not counted
            data = self.data_seconds - fed
            self.steps.append((max(total - comm_wait - data, 0.0), comm_wait, data))

    def interval(self, iteration: int) -> dict[str, float]:
        """Collective over the world: gather every rank's split of the interval's steps (the
        median step's seconds per category: a rank descheduled for one step is not a straggler, a
        rank slow at every step is), log the stragglers, return the min/median/max scalars."""
        steps = torch.tensor(self.steps or [(0.0, 0.0, 0.0)], dtype=torch.float64)   # [n, 3]
        mine = steps.median(dim=0).values                                              # [3]
        world, device = self.state.world, self.state.device
        gathered = torch.empty(world.size * 3, dtype=torch.float64, device=device)   # [world x 3]
        with comm.unrecorded(world):    # bookkeeping, not in the bytes (nor in a step's waits)
            comm.all_gather_into(gathered, mine.to(device), world)
        per_rank = gathered.cpu().view(world.size, 3)                                     # [world, 3]
        out = {}
        for j, name in enumerate(CATEGORIES):
            column = per_rank[:, j]
            out[f"straggler/{name}-seconds-min"] = float(column.min())
            out[f"straggler/{name}-seconds-median"] = float(column.median())
            out[f"straggler/{name}-seconds-max"] = float(column.max())
        line = straggler_line(per_rank, world.ranks, self.threshold, self.count, iteration)
        if line is not None:
            log.warning("%s", line)
        self._reset()
        return out


def straggler_line(per_rank: torch.Tensor, ranks: list[int], threshold: float, count: int,
                   iteration: int) -> str | None:
    """One line naming up to ``count`` ranks whose own time (compute + data wait, seconds per
    iteration, columns of :data:`CATEGORIES`) exceeds ``threshold`` x the median rank's, slowest
    first, with their split and the fastest rank's for comparison; None when no rank does."""
    own = per_rank[:, 0] + per_rank[:, 2]                                              # [world]
    median = float(own.median())
    if median <= 0:
        return None
    slow = [i for i in torch.argsort(own, descending=True).tolist() if own[i] > threshold * median]
    if not slow:
        return None
    fastest = int(torch.argmin(own))

    def describe(i: int) -> str:
        c, w, d = (1e3 * float(x) for x in per_rank[i])
        return (f"rank {ranks[i]} ({float(own[i]) / median:.2f}x median: compute {c:.1f} ms, "
                f"comm wait {w:.1f} ms, data wait {d:.1f} ms)")
    named = ", ".join(describe(i) for i in slow[:count])
    return (f"stragglers at iteration {iteration}: {named}; median rank {1e3 * median:.1f} ms of "
            f"compute + data wait per iteration, fastest {describe(fastest)} "
            f"(--straggler-threshold {threshold})")
