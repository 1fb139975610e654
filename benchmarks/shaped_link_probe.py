"""What the shaped test bed of tools/netns_cluster.py really delivers to each collective of
benchmarks/figure2_mini.py (its calibration: per-call latency and bandwidth of the inter-host link
per algorithm).

4 ranks on 2 hosts of 2, launched with torchrun on each host; each measurement runs the layout's
own collective with the layout's own concurrency, at the run's message size S and at 4 S:

- ``ring``: gloo's all-reduce over all 4 ranks (Megatron's TP 4 ring over hosts 0,0,1,1, whose hops
  1->2 and 3->0 cross), S = ``PROBE_TP_NUMEL`` fp32 elements; per-rank volume 2 (n-1)/n x bytes;
- ``direct``: hybrid.comm's all-gather and reduce-scatter over the DP pairs (0, 2) and (1, 3) at
  once (ZeRO-1's DP collectives, both pairs crossing; every rank sends and receives at once),
  S = ``PROBE_DP_NUMEL`` (the full tensor); per-rank volume (n-1)/n x bytes, the mean of the two ops.

Each is the median wall time over ``REPEATS`` calls (after a warm-up), the slowest rank's. The two
sizes give a line t = latency + volume / bandwidth: its slope is the link's bandwidth per rank for
that algorithm, its intercept what a call costs beyond its bytes (TCP round trips through the
token bucket's queue; on this link, for the direct ops, the returning ACKs waiting behind queued
data). The model evaluates the line at the run's sizes, so between and at the probed sizes it
reproduces the probe. Rank 0 prints one JSON line.
"""

from __future__ import annotations

import json
import os
import statistics
import time

import torch
import torch.distributed as dist

from hybrid import comm

REPEATS = 4
SCALE = 4                             # the second size, x S


def _slowest_median(call, active: bool) -> float:
    """Median wall seconds of ``call`` on this rank, the maximum over the ranks."""
    times = []
    for _ in range(REPEATS + 1):
        dist.barrier()
        start = time.perf_counter()
        if active:
            call()
        times.append(time.perf_counter() - start)
    t = torch.tensor([statistics.median(times[1:])])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _line(volumes: list[float], seconds: list[float]) -> dict:
    """latency + volume / bandwidth through the two points (latency clamped at 0)."""
    slope = (seconds[1] - seconds[0]) / (volumes[1] - volumes[0])
    latency = seconds[0] - volumes[0] * slope
    if slope <= 0 or latency < 0:      # no fixed cost measurable: the run's size S's average rate
        latency, slope = 0.0, seconds[0] / volumes[0]
    return {"volume_bytes": volumes, "seconds": seconds, "latency_s": latency,
            "Bps": 1.0 / slope}


def _ring(world, numel: int) -> dict:
    n = dist.get_world_size()
    volumes, seconds = [], []
    for size in (numel, SCALE * numel):
        x = torch.ones(size)
        seconds.append(_slowest_median(lambda: dist.all_reduce(x, group=world), True))
        volumes.append(2 * (n - 1) / n * size * 4)
    return _line(volumes, seconds)


def _direct(group: comm.Group, numel: int) -> dict:
    n = group.size
    volumes, seconds = [], []
    for size in (numel - numel % n, SCALE * (numel - numel % n)):
        full, shard, scratch = torch.ones(size), torch.ones(size // n), torch.empty(size)
        gather = _slowest_median(lambda: comm.all_gather_into(full, shard, group), True)
        scatter = _slowest_median(
            lambda: comm.reduce_scatter_into(shard, full, group, scratch=scratch), True)
        seconds.append((gather + scatter) / 2)
        volumes.append((n - 1) / n * size * 4)
    return _line(volumes, seconds)


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    pairs = {r: pair for pair in ((0, 2), (1, 3)) for r in pair}
    groups = {pair: dist.new_group(list(pair)) for pair in ((0, 2), (1, 3))}
    mine = pairs[rank]
    dp = comm.Group("dp", list(mine), mine.index(rank), comm.CommLedger(), groups[mine])
    result = {"ring": _ring(dist.group.WORLD, int(os.environ["PROBE_TP_NUMEL"])),
              "direct": _direct(dp, int(os.environ["PROBE_DP_NUMEL"]))}
    if rank == 0:
        print(json.dumps(result), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
