"""Data-parallel sampling driven by the global count of consumed samples (Megatron-LM's
pretraining sampler), the piece that makes resume exact.

The training run is one fixed sequence of sample indices 0, 1, 2, ... Every micro-step consumes the
next ``micro_batch_size * data_parallel_size`` of them; DP rank r takes slice r of that block. A
global batch is therefore a contiguous range of the sequence whatever the DP degree, and a run
resumed from ``consumed_samples`` (saved in the checkpoint) continues at exactly the next sample,
even with a different number of DP ranks.
"""

from __future__ import annotations

from typing import Iterator


class PretrainingSampler:
    """Yields this rank's list of ``micro_batch_size`` sample indices for each micro-step.

    Stops before a micro-step that would pass ``total_samples`` (``None``: never stops).
    """

    def __init__(self, total_samples: int | None, consumed_samples: int, micro_batch_size: int,
                 data_parallel_rank: int, data_parallel_size: int):
        if micro_batch_size < 1 or data_parallel_size < 1:
            raise ValueError(f"micro_batch_size ({micro_batch_size}) and data_parallel_size "
                             f"({data_parallel_size}) must be >= 1")
        if not 0 <= data_parallel_rank < data_parallel_size:
            raise ValueError(f"data_parallel_rank {data_parallel_rank} is outside "
                             f"[0, {data_parallel_size})")
        if consumed_samples < 0:
            raise ValueError(f"consumed_samples must be >= 0, got {consumed_samples}")
        if total_samples is not None and consumed_samples > total_samples:
            raise ValueError(f"consumed_samples {consumed_samples} exceeds the {total_samples} "
                             "samples of this run; raise --train-samples/--train-iters to continue")
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.rank = data_parallel_rank
        self.size = data_parallel_size

    @property
    def step_samples(self) -> int:
        """Samples consumed by all DP ranks together in one micro-step."""
        return self.micro_batch_size * self.size

    def __len__(self) -> int:
        if self.total_samples is None:
            raise TypeError("an unbounded sampler has no length")
        return (self.total_samples - self.consumed_samples) // self.step_samples

    def __iter__(self) -> Iterator[list[int]]:
        start = self.consumed_samples
        while self.total_samples is None or start + self.step_samples <= self.total_samples:
            first = start + self.rank * self.micro_batch_size
            yield list(range(first, first + self.micro_batch_size))
            start += self.step_samples
