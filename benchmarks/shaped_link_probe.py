"""gloo's bandwidth across the shaped link of tools/netns_cluster.py (benchmarks/figure2_mini.py's
calibration of the inter-host link): 4 ranks on 2 hosts of 2, launched with torchrun on each host.
One stream: the pair (1, 2) all-reduces alone; two streams: the pairs (0, 2) and (1, 3) at once.
A 2-rank all-reduce of B bytes moves B per rank each way (ring volume 2 (n-1)/n B); the bandwidth
per stream is B over the median wall time. Rank 0 prints one JSON line."""

from __future__ import annotations

import json
import statistics
import time

import torch
import torch.distributed as dist

NUMEL, REPEATS = 400_000, 4          # 1.6 MB of fp32


def _timed(group, active: bool, tensor: torch.Tensor) -> list[float]:
    times = []
    for _ in range(REPEATS + 1):
        dist.barrier()
        start = time.perf_counter()
        if active:
            dist.all_reduce(tensor, group=group)
        times.append(time.perf_counter() - start)
    return times[1:]


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    pairs = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    single = dist.new_group([1, 2])
    x = torch.ones(NUMEL)
    one = _timed(single, rank in (1, 2), x)
    two = _timed(pairs[rank % 2], True, x)
    result = torch.tensor([statistics.median(one) if rank == 1 else 0.0, statistics.median(two)])
    dist.all_reduce(result, op=dist.ReduceOp.MAX)
    if rank == 0:
        nbytes = NUMEL * 4
        print(json.dumps({"one_stream_Bps": nbytes / result[0].item(),
                          "two_streams_Bps_each": nbytes / result[1].item()}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
