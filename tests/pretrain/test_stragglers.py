"""Straggler report (issue 34, part 4; pretrain/stragglers.py, --log-straggler).

A 4-rank run (DP 4) whose rank 2 computes 50% longer - each forward and backward followed by a sleep
of half its own time, a test hook - names rank 2 in one log line within two log intervals; the same
run with even ranks logs no line. Every interval logs min <= median <= max per category. The line
itself is checked on numbers made up for it.
"""

import logging
import time

import pytest
import torch

from hybrid.testing.multirank import run_on_ranks
from pretrain.stragglers import CATEGORIES, straggler_line
from tests.training_helpers import make_trainer, tiny_args

SLOW_RANK = 2


def _slow_down(fn, factor: float):
    """``fn`` followed by a sleep of ``factor`` x its own wall time (compute made 1 + factor longer)."""
    def slowed(*args, **kwargs):
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        time.sleep(factor * (time.perf_counter() - start))
        return out
    return slowed


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _run(rank, world_size, slow: bool):
    # intervals of 3 steps: on a shared, oversubscribed CPU a rank descheduled for a while looks
    # slow for a step; over an interval the ranks' shares even out
    trainer = make_trainer(tiny_args(iters=6, extra=[
        "--log-interval", "3", "--log-straggler", "--straggler-threshold", "1.3", "--no-roofline",
        "--hidden-size", "256", "--num-layers", "3"]))   # compute well above the scheduler jitter
    if slow and rank == SLOW_RANK:
        trainer._micro_batch_loss = _slow_down(trainer._micro_batch_loss, 0.5)
        trainer.optimizer.backward = _slow_down(trainer.optimizer.backward, 0.5)
    handler = _Lines()
    logging.getLogger("pretrain.stragglers").addHandler(handler)
    logged = []
    log = trainer.metrics.log
    trainer.metrics.log = lambda m, step: (logged.append((step, dict(m))), log(m, step))
    trainer.train()
    scalars = [(step, {k: v for k, v in m.items() if k.startswith("straggler/")})
               for step, m in logged if any(k.startswith("straggler/") for k in m)]
    return handler.lines, scalars


def _both(rank, world_size):
    return _run(rank, world_size, slow=True), _run(rank, world_size, slow=False)


@pytest.mark.slow
def test_slow_rank_is_named_and_even_ranks_are_not():
    results = run_on_ranks(_both, 4, timeout=600)
    (slow_lines, slow_scalars), (even_lines, _) = results[0]
    assert slow_lines, "no straggler line though rank 2 computes 50% longer"
    first = slow_lines[0]
    assert first.startswith("stragglers at iteration ") and int(first.split()[3].rstrip(":")) <= 6
    assert f"rank {SLOW_RANK} (" in first.split("; median")[0], first
    assert even_lines == [], even_lines
    assert [step for step, _ in slow_scalars] == [3, 6]
    for _, m in slow_scalars:
        for c in CATEGORIES:
            low, mid, high = (m[f"straggler/{c}-seconds-{s}"] for s in ("min", "median", "max"))
            assert 0 <= low <= mid <= high
    for r in results[1:]:   # every rank took part; only the writer's scalars are kept, all logged
        assert r[0][0] == slow_lines


def test_the_line_names_the_slowest_ranks_over_the_threshold():
    per_rank = torch.tensor([[0.010, 0.006, 0.001], [0.010, 0.006, 0.001],
                             [0.016, 0.000, 0.001], [0.011, 0.005, 0.001]], dtype=torch.float64)
    line = straggler_line(per_rank, [0, 1, 2, 3], 1.3, 1, iteration=20)
    assert line.startswith("stragglers at iteration 20: rank 2 (1.55x median: compute 16.0 ms, "
                           "comm wait 0.0 ms, data wait 1.0 ms)")
    assert "fastest rank 0" in line
    # a slow data loader counts as the rank's own time too
    per_rank[1, 2] = 0.030
    line = straggler_line(per_rank, [4, 5, 6, 7], 1.3, 2, iteration=3)
    assert line.split("; median")[0].count("rank ") == 2 and line.index("rank 5") < line.index("rank 6")
    even = torch.tensor([[0.010, 0.001, 0.001]] * 4, dtype=torch.float64)
    assert straggler_line(even, [0, 1, 2, 3], 1.3, 1, iteration=1) is None
