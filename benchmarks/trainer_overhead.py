"""Trainer overhead (issue 6): the share of a training step the loop itself costs.

A step of :class:`pretrain.trainer.Trainer` is split into the model's work - forward (with its
TP collectives), backward (with ZeRO's gradient reduce-scatter) and the optimizer (zero_grad, clip,
AdamW, parameter all-gather) - and everything else: waiting for the next micro-batch, the step
agreement (one world all-reduce per iteration carrying the logged loss and the non-finite flag), the
LR schedule, the console line + TensorBoard scalars every ``--log-interval``, the once-per-iteration
exit check (one world all-reduce) and bookkeeping. The target is under 3%.

Instrumentation lives here, not in the trainer: the built trainer's callables (``model.forward``,
``optimizer.backward/step/zero_grad``, ``_micro_batch_loss``, ``_step_agreement``,
``_log_interval``, ``schedule``, ``_advance``, the loader's ``next``; ``ExitCondition.should_exit``
for the run only) are wrapped with ``time.perf_counter`` / ``time.process_time`` timers, so a
normal run pays nothing. An iteration is the time between two ``train_step`` calls; "other" is
what no wrapper covered (the per-micro-batch ``loss.item()``, the loop). Wall and CPU (process,
all threads) time are both given.

    python benchmarks/trainer_overhead.py --iters 30 --warmup 5     # 1 rank and 4 ranks (TP2 x DP2)

Runs the tiny-cpu preset (pretrain/presets/tiny-cpu.yaml) on the embedded corpus, without checkpoints
or evaluation (not part of a step), TensorBoard on; writes results/trainer_overhead.json.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from pretrain.exit import ExitCondition  # noqa: E402

MODEL_PHASES = ("forward", "backward", "optimizer")
TRAINER_PHASES = ("data wait", "loss masking", "step agreement", "exit check",
                  "lr schedule", "logging", "bookkeeping", "other")


def _now() -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process, gloo's threads included)."""
    return time.perf_counter(), time.process_time()


class PhaseClock:
    """Wall and CPU seconds per named phase per iteration, exclusive: a timed call inside another
    (forward inside the loss) is taken out of the outer one. CPU time leaves out waiting: on an
    oversubscribed CPU a collective's wall time is mostly waiting for a descheduled peer."""

    def __init__(self):
        self.starts: list[tuple[float, float]] = []      # (wall, cpu) at each train_step call
        self.phases: list[dict[str, float]] = []         # per iteration: phase -> wall seconds
        self.phases_cpu: list[dict[str, float]] = []     # per iteration: phase -> CPU seconds
        self._children: list[list[float]] = []   # per open timed call: [wall, cpu] of its children

    def wrap(self, phase: str, fn):
        @functools.wraps(fn)   # keeps the signature (the trainer inspects optimizer.step's)
        def timed(*args, **kwargs):
            self._children.append([0.0, 0.0])
            wall0, cpu0 = _now()
            try:
                return fn(*args, **kwargs)
            finally:
                wall, cpu = _now()
                inner_wall, inner_cpu = self._children.pop()
                if self._children:                  # report our whole time to the caller
                    self._children[-1][0] += wall - wall0
                    self._children[-1][1] += cpu - cpu0
                if self.phases:
                    self.phases[-1][phase] += wall - wall0 - inner_wall
                    self.phases_cpu[-1][phase] += cpu - cpu0 - inner_cpu
        return timed

    def mark(self, fn):
        @functools.wraps(fn)
        def step(*args, **kwargs):
            self.starts.append(_now())
            self.phases.append(defaultdict(float))
            self.phases_cpu.append(defaultdict(float))
            return fn(*args, **kwargs)
        return step


class TimedLoader:
    """The trainer's micro-batch iterator with ``next`` timed as 'data wait'."""

    def __init__(self, loader, clock: PhaseClock):
        self.loader = loader
        self._next = clock.wrap("data wait", lambda: next(loader))

    def __iter__(self):
        return self

    def __next__(self):
        return self._next()

    def close(self) -> None:
        close = getattr(self.loader, "close", None)
        if close is not None:
            close()


def instrument(trainer, clock: PhaseClock) -> None:
    opt = trainer.optimizer
    trainer.model.forward = clock.wrap("forward", trainer.model.forward)
    opt.backward = clock.wrap("backward", opt.backward)
    opt.step = clock.wrap("optimizer", opt.step)
    opt.zero_grad = clock.wrap("optimizer", opt.zero_grad)
    trainer.train_step = clock.mark(trainer.train_step)
    trainer._step_agreement = clock.wrap("step agreement", trainer._step_agreement)
    trainer._log_interval = clock.wrap("logging", trainer._log_interval)
    trainer.schedule = clock.wrap("lr schedule", trainer.schedule)
    trainer._micro_batch_loss = clock.wrap("loss masking", trainer._micro_batch_loss)
    trainer._advance = clock.wrap("bookkeeping", trainer._advance)
    # the exit check's ExitCondition is created inside train(): time its class method for this run
    ExitCondition.should_exit = clock.wrap("exit check", ExitCondition.should_exit)
    make = trainer.make_loader
    trainer.make_loader = lambda split, consumed: TimedLoader(make(split, consumed), clock)


def _split(starts: list[float], phases: list[dict[str, float]], idx: range) -> dict:
    total = sum(starts[i + 1] - starts[i] for i in idx)
    ms = {p: 1e3 * sum(phases[i].get(p, 0.0) for i in idx) / len(idx)
          for p in MODEL_PHASES + TRAINER_PHASES[:-1]}
    iter_ms = 1e3 * total / len(idx)
    ms["other"] = iter_ms - sum(ms.values())
    overhead = sum(ms[p] for p in TRAINER_PHASES)
    return {"iteration_ms": iter_ms, "phase_ms": ms, "overhead_ms": overhead,
            "overhead_pct": 100 * overhead / iter_ms}


def summarise(clock: PhaseClock, warmup: int) -> dict:
    """Mean ms per phase over iterations ``warmup .. n-2`` (the last has no next start), in wall
    time and in CPU time (``cpu``)."""
    n = len(clock.starts) - 1
    idx = range(min(warmup, n - 1), n)
    wall = _split([s[0] for s in clock.starts], clock.phases, idx)
    cpu = _split([s[1] for s in clock.starts], clock.phases_cpu, idx)
    return {"iterations": len(idx), **wall, "cpu": cpu}


def run_trainer(argv: list[str], warmup: int) -> dict:
    from pretrain.arguments import parse_args
    from pretrain.metrics import install_rank_logging
    from hybrid.launch_env import LaunchEnv
    from pretrain.build import build_parallel_state
    from pretrain.setup import build_trainer
    torch.set_num_threads(1)
    cfg, _ = parse_args(argv)
    cfg.checkpoint.save = None                      # checkpoints are not part of a step
    cfg.data.data_cache_dir = str(ROOT / cfg.data.data_cache_dir)
    layout = cfg.validate_for_world(LaunchEnv.from_environ().world_size)
    state = build_parallel_state(cfg, layout)
    install_rank_logging(state.rank, logging.INFO)   # the console line is part of the cost
    with tempfile.TemporaryDirectory() as tb:
        cfg.logging.tensorboard_dir = tb
        trainer = build_trainer(cfg, layout, state)
        clock = PhaseClock()
        original = ExitCondition.should_exit
        instrument(trainer, clock)
        try:
            trainer.train()
        finally:
            ExitCondition.should_exit = original
        trainer.metrics.close()
    return summarise(clock, warmup)


def _rank(rank, world_size, argv, warmup):
    return run_trainer(argv, warmup)


def preset_args(iters: int, ranks: int) -> list[str]:
    args = ["--config", "tiny-cpu", "--train-iters", str(iters), "--eval-iters", "0"]
    if ranks == 1:
        args += ["--world-size", "1", "--tensor-model-parallel-size", "1"]
    return args


def print_table(rows: list[dict], clock: str) -> None:
    """One markdown table of ``clock`` 'wall' or 'cpu' milliseconds per phase."""
    cols = MODEL_PHASES + TRAINER_PHASES
    print(f"\n{clock} time, ms per iteration")
    print("| layout | rank | ms/iter | " + " | ".join(cols) + " | trainer overhead |")
    print("| --- | ---: | ---: | " + " | ".join("---:" for _ in cols) + " | ---: |")
    for row in rows:
        r = row if clock == "wall" else row["cpu"]
        phases = " | ".join(f"{r['phase_ms'][c]:.2f}" for c in cols)
        print(f"| {row['layout']} | {row['rank']} | {r['iteration_ms']:.1f} | {phases} | "
              f"{r['overhead_ms']:.2f} ms = {r['overhead_pct']:.2f}% |")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--iters", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 4], choices=(1, 4))
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "trainer_overhead.json"))
    args = p.parse_args(argv)
    rows = []
    # the preset logs every 10 iterations; --log-interval 1 is the worst case of the logging cost
    variants = [(r, extra) for r in args.ranks for extra in ([], ["--log-interval", "1"])]
    for ranks, extra in variants:
        cli = preset_args(args.iters, ranks) + extra
        if ranks == 1:
            results = [run_trainer(cli, args.warmup)]
        else:
            from hybrid.testing.multirank import run_on_ranks
            results = run_on_ranks(_rank, ranks, args=(cli, args.warmup), timeout=1800)
        layout = ("1 rank (TP1 DP1)" if ranks == 1 else "4 ranks (TP2 x DP2)") + (
            ", log every iteration" if extra else "")
        rows += [{"layout": layout, "rank": i, **r} for i, r in enumerate(results)]
    print_table(rows, "wall")
    print_table(rows, "cpu")
    worst = max(r["overhead_pct"] for r in rows)
    worst_cpu = max(r["cpu"]["overhead_pct"] for r in rows)
    print(f"\nworst trainer overhead: {worst:.2f}% of a step in wall time, {worst_cpu:.2f}% in CPU "
          f"time (target < 3%)")
    Path(args.out).write_text(json.dumps({
        "preset": "tiny-cpu", "iters": args.iters, "warmup": args.warmup,
        "model_phases": MODEL_PHASES, "trainer_phases": TRAINER_PHASES, "rows": rows,
        "worst_overhead_pct": worst, "worst_overhead_cpu_pct": worst_cpu}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
