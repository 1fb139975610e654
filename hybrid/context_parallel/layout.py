"""The load-balanced sequence layout of context parallelism.

With CP degree ``C`` a sequence of ``S`` tokens is cut into ``2C`` chunks of ``S / 2C`` tokens, and
CP rank ``r`` holds chunks ``r`` and ``2C - 1 - r``, in that order. Under a causal mask the work of
a query chunk grows with its index, so pairing an early chunk with a late one gives every rank the
same number of (query, key) pairs: rank ``r`` sees ``(r + 1) + (2C - r)`` = ``2C + 1`` chunk-sized
blocks of keys in all, whatever ``r`` is.

Everything here is index arithmetic on the host or one gather on the device; no communication.
"""

from __future__ import annotations

import torch


def check_divisible(seq_len: int, cp_size: int) -> None:
    """One clear error when ``seq_len`` cannot be cut into ``2 * cp_size`` equal chunks."""
    if cp_size < 1:
        raise ValueError(f"context-parallel size must be >= 1, got {cp_size}")
    if cp_size > 1 and seq_len % (2 * cp_size):
        raise ValueError(
            f"sequence length {seq_len} is not divisible by 2 x context-parallel size = "
            f"{2 * cp_size} (each CP rank holds two equal chunks); choose --seq-length a multiple "
            f"of {2 * cp_size} or another --context-parallel-size")


def chunk_ids(cp_rank: int, cp_size: int) -> tuple[int, int]:
    """The two chunks (of ``2 * cp_size``) that CP rank ``cp_rank`` holds, in local order."""
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"CP rank {cp_rank} outside 0 .. {cp_size - 1}")
    return cp_rank, 2 * cp_size - 1 - cp_rank


def local_positions(seq_len: int, cp_rank: int, cp_size: int,
                    device: torch.device | str | None = None) -> torch.Tensor:
    """Global indices ``[S / C]`` (int64) of the tokens CP rank ``cp_rank`` holds, in local order:
    the causal order of the whole sequence, used for masks and for positions without resets."""
    if cp_size == 1:
        return torch.arange(seq_len, device=device)
    check_divisible(seq_len, cp_size)
    chunk = seq_len // (2 * cp_size)
    first, second = chunk_ids(cp_rank, cp_size)
    return torch.cat([torch.arange(first * chunk, (first + 1) * chunk, device=device),
                      torch.arange(second * chunk, (second + 1) * chunk, device=device)])


def split_sequence(x: torch.Tensor, dim: int, cp_rank: int, cp_size: int) -> torch.Tensor:
    """This rank's part of ``x`` along its sequence dimension ``dim`` (length ``S`` -> ``S / C``)."""
    if cp_size == 1:
        return x
    seq_len = x.size(dim)
    check_divisible(seq_len, cp_size)
    chunks = x.chunk(2 * cp_size, dim=dim)
    first, second = chunk_ids(cp_rank, cp_size)
    return torch.cat([chunks[first], chunks[second]], dim=dim)


def merge_sequence(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    """Inverse of :func:`split_sequence`: the parts of CP ranks ``0 .. C-1`` -> the whole sequence."""
    cp_size = len(parts)
    if cp_size == 1:
        return parts[0]
    chunks: list[torch.Tensor | None] = [None] * (2 * cp_size)
    for rank, part in enumerate(parts):
        first, second = chunk_ids(rank, cp_size)
        chunks[first], chunks[second] = part.chunk(2, dim=dim)
    return torch.cat(chunks, dim=dim)
