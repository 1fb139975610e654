"""--async-save against a synchronous save (issue 34 part 1): how long the step loop is blocked.

One rank saves a state of ``--mib`` MiB (fp32 master + two Adam moments + bf16 parameters, as the
engine's pieces) with the synchronous writer (:func:`hybrid.checkpoint.writer.save_checkpoint`) and
with :class:`hybrid.checkpoint.async_save.AsyncCheckpointWriter`, between "training steps" (a
matmul loop of ``--step-ms`` each). Reported side by side, per save:

- sync save time: the loop is blocked for all of it (copy, write, fsync, hash, commit);
- async stall: the time the loop spends inside ``save()`` (prepare + host copy) plus ``poll()`` at
  each step (one all-reduce; the commit once the write is done) - the goal is <= 10% of the sync time;
- the background write's own time, and the steps' slowdown while it runs (the thread shares the
  cores: with 2 cores and a busy neighbour this is visible; a GPU step would not share them).

    python benchmarks/async_save.py --mib 1024 --saves 3

Writes results/async_save.json. The checkpoint size should make the sync save take over a second.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from hybrid.checkpoint import writer  # noqa: E402
from hybrid.checkpoint.async_save import AsyncCheckpointWriter  # noqa: E402
from hybrid.checkpoint.format import Piece  # noqa: E402
from hybrid.parallel_state import ParallelState  # noqa: E402


def make_state(mib: int) -> list[Piece]:
    """fp32 master, exp_avg, exp_avg_sq and bf16 params of n parameters: 14 bytes each."""
    n = mib * 2**20 // 14
    layers = 8
    per = n // layers
    pieces = []
    for i in range(layers):
        for kind, dtype in (("master", torch.float32), ("exp_avg", torch.float32),
                            ("exp_avg_sq", torch.float32), ("model", torch.bfloat16)):
            pieces.append(Piece(f"layer{i}.weight", kind, (per,), -1, 0, 1, 0,
                                torch.randn(per).to(dtype)))
    return pieces


def step(a: torch.Tensor, ms: float) -> float:
    """A stand-in training step of about ``ms`` milliseconds; returns its seconds."""
    start = time.perf_counter()
    while time.perf_counter() - start < ms / 1000:
        a = (a @ a).tanh_()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=1024, help="checkpoint size of the rank")
    parser.add_argument("--saves", type=int, default=3)
    parser.add_argument("--step-ms", type=float, default=50.0)
    parser.add_argument("--steps-between", type=int, default=80, help="steps between two saves")
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary dir)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "async_save.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    world = ParallelState.single_process().world
    pieces = make_state(args.mib)
    extra = {"cpu": torch.get_rng_state()}
    a = torch.randn(64, 64) / 8
    base = tempfile.mkdtemp(prefix="async_save_", dir=args.dir)
    quiet_steps = [step(a, args.step_ms) for _ in range(20)]

    sync_times = []
    for i in range(args.saves):
        for _ in range(5):
            step(a, args.step_ms)
        start = time.perf_counter()
        writer.save_checkpoint(Path(base) / "sync", i + 1, pieces, extra, {}, world, keep_last=1,
                               run_id="bench")
        sync_times.append(time.perf_counter() - start)
        print(f"sync save {i + 1}: {sync_times[-1]:.3f} s", flush=True)

    background = AsyncCheckpointWriter(world)
    stalls, save_calls, polls, busy_steps, writes = [], [], [], [], []
    for i in range(args.saves):
        start = time.perf_counter()
        background.save(Path(base) / "async", i + 1, pieces, extra, {}, keep_last=1, run_id="bench")
        inside_save = time.perf_counter() - start
        poll_time, in_flight, steps = 0.0, True, 0
        while steps < args.steps_between or in_flight:   # until the save is committed
            steps += 1
            seconds = step(a, args.step_ms)
            if in_flight:
                busy_steps.append(seconds)
                t = time.perf_counter()
                committed = background.poll()
                poll_time += time.perf_counter() - t
                in_flight = not committed
        stalls.append(inside_save + poll_time)
        save_calls.append(inside_save)
        polls.append(poll_time)
        writes.append(background.committed[-1])
    sync = sorted(sync_times)[len(sync_times) // 2]
    stall = sorted(stalls)[len(stalls) // 2]
    quiet = sorted(quiet_steps)[len(quiet_steps) // 2]
    busy = sorted(busy_steps)[len(busy_steps) // 2]
    result = {"checkpoint_mib": args.mib, "host_snapshot_mib": background.snapshot.bytes / 2**20,
              "sync_save_s": sync_times, "async_stall_s": stalls, "async_save_call_s": save_calls,
              "async_poll_and_commit_s": polls, "median_sync_s": sync, "median_stall_s": stall,
              "stall_over_sync": stall / sync, "step_s_quiet": quiet, "step_s_while_writing": busy,
              "steps_while_writing": len(busy_steps)}
    print(f"checkpoint {args.mib} MiB on one rank; host snapshot {result['host_snapshot_mib']:.0f} MiB")
    print(f"{'save':>5} {'sync save (s)':>14} {'async stall (s)':>16} {'of which save()':>16} "
          f"{'poll+commit':>12}")
    for i in range(args.saves):
        print(f"{i + 1:>5} {sync_times[i]:>14.3f} {stalls[i]:>16.3f} {save_calls[i]:>16.3f} "
              f"{polls[i]:>12.3f}")
    print(f"median: sync {sync:.3f} s, async stall {stall:.3f} s = {100 * stall / sync:.1f}% of sync "
          f"(goal <= 10%)")
    print(f"step time: {1000 * quiet:.1f} ms quiet, {1000 * busy:.1f} ms while a write runs "
          f"({len(busy_steps)} steps)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    import shutil
    shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
