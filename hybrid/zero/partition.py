"""Flat-buffer layout of ZeRO stages 0-2: constant-size buckets split into DP-equal chunks (§5.1-5.2).

The model's parameters (this TP rank's shards) are laid out back to back in ONE flat buffer, in
reverse registration order (backward produces gradients roughly last-layer-first, so buckets fill in
order). The buffer is cut into buckets of at most ``bucket_size`` elements (a parameter never spans
two buckets; one larger than ``bucket_size`` gets a bucket of its own). Each bucket is padded to a
multiple of ``partitions x alignment`` and split into ``partitions`` equal chunks: rank i owns chunk
i of every bucket, so each bucket's reduce-scatter / all-gather is balanced, and a rank's optimizer
partition is the concatenation of its chunks. Pure arithmetic on numels: no tensors, no groups.

    flat   |<------ bucket 0 ------>|<------ bucket 1 ------>| ...
    bucket | chunk 0 | chunk 1 | .. | chunk 0 | chunk 1 | .. |      (chunk i -> DP rank i)
    params | p_last ... | p_last-1 |pad| ...
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Slot:
    """Where parameter ``index`` lives: ``bucket`` and element offset ``start`` in the flat buffer."""

    index: int
    numel: int
    bucket: int
    start: int


@dataclass(frozen=True)
class Piece:
    """The part of parameter ``index`` that falls in one rank's chunk of a bucket.

    ``param_offset``: element offset inside the flattened parameter; ``chunk_offset``: offset inside
    the chunk; ``numel``: length."""

    index: int
    param_offset: int
    chunk_offset: int
    numel: int


@dataclass(frozen=True)
class Bucket:
    index: int
    start: int           # offset of the bucket in the flat buffer
    numel: int           # padded size, a multiple of partitions x alignment
    params: tuple[int, ...]
    partitions: int

    @property
    def chunk(self) -> int:
        return self.numel // self.partitions

    def chunk_range(self, rank: int) -> tuple[int, int]:
        """[begin, end) of ``rank``'s chunk, relative to the bucket start."""
        return rank * self.chunk, (rank + 1) * self.chunk

    def chunk_of(self, flat, rank: int):
        """``rank``'s chunk of this bucket in ``flat``, a tensor laid out as the whole flat buffer."""
        lo, hi = self.chunk_range(rank)
        return flat[self.start + lo:self.start + hi]


class FlatLayout:
    """Bucket and chunk layout of parameters with the given ``numels`` (registration order)."""

    def __init__(self, numels: list[int], bucket_size: int, partitions: int, alignment: int = 1):
        if bucket_size < 1 or partitions < 1 or alignment < 1:
            raise ValueError(f"bucket_size ({bucket_size}), partitions ({partitions}) and alignment "
                             f"({alignment}) must be >= 1")
        self.numels = list(numels)
        self.partitions = partitions
        self.slots: list[Slot | None] = [None] * len(numels)
        self.buckets: list[Bucket] = []
        quantum = partitions * alignment
        order = [i for i in reversed(range(len(numels))) if numels[i] > 0]
        start, current, used = 0, [], 0
        for i in order + [None]:
            if current and (i is None or used + numels[i] > bucket_size):
                padded = -(-used // quantum) * quantum
                self.buckets.append(Bucket(len(self.buckets), start, padded, tuple(current),
                                           partitions))
                start, current, used = start + padded, [], 0
            if i is not None:
                self.slots[i] = Slot(i, numels[i], len(self.buckets), start + used)
                current.append(i)
                used += numels[i]
        self.numel = start

    @property
    def num_params(self) -> int:
        return sum(self.numels)

    def chunk_sizes(self) -> list[int]:
        return [b.chunk for b in self.buckets]

    def pieces(self, bucket: Bucket, rank: int) -> list[Piece]:
        """Parameter pieces inside ``rank``'s chunk of ``bucket`` (padding excluded)."""
        lo, hi = bucket.chunk_range(rank)
        out = []
        for i in bucket.params:
            slot = self.slots[i]
            begin = slot.start - bucket.start
            a, b = max(lo, begin), min(hi, begin + slot.numel)
            if a < b:
                out.append(Piece(i, a - begin, a - lo, b - a))
        return out

    def owned_pieces(self, rank: int) -> list[tuple[int, Piece]]:
        """(bucket index, piece) of everything ``rank`` owns, in partition order."""
        return [(b.index, p) for b in self.buckets for p in self.pieces(b, rank)]
