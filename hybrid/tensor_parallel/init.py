"""Weight initialisation independent of the tensor-parallel degree (Megatron-LM §3; docs/design.md §4).

Every rank generates the *full* master weight of a parameter from a generator seeded by the run seed
and a stable hash of the parameter's name, keeps its contiguous slice along the partition dimension
and frees the rest. The values therefore do not depend on the TP degree, on the rank, or on the order
in which parameters are built: TP=1 and TP=4 start from the same model.

Only one full parameter exists at a time, so peak extra memory is the largest single weight (the word
embedding), generated in fp32 on the CPU.
"""

from __future__ import annotations

import hashlib

import torch


def name_seed(name: str, seed: int) -> int:
    """A 63-bit generator seed from the run ``seed`` and the parameter ``name``, stable across
    processes and Python versions (``hash()`` is salted per process, sha256 is not)."""
    digest = hashlib.sha256(f"{int(seed)}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def full_init(name: str, shape: tuple[int, ...], std: float, seed: int) -> torch.Tensor:
    """The full (unsharded) fp32 CPU weight ``normal(0, std)`` of parameter ``name``."""
    if std < 0:
        raise ValueError(f"init std of {name!r} must be non-negative, got {std}")
    generator = torch.Generator(device="cpu").manual_seed(name_seed(name, seed))
    full = torch.empty(tuple(shape), dtype=torch.float32)
    if std == 0:
        return full.zero_()
    return full.normal_(0.0, std, generator=generator)


def shard(full: torch.Tensor, partition_dim: int, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This rank's contiguous slice of ``full`` along ``partition_dim`` (a copy, so the full tensor
    can be freed). ``partition_dim == -1`` means replicated: the whole tensor is returned."""
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tensor-parallel rank {tp_rank} is outside [0, {tp_size})")
    if partition_dim == -1:
        return full.clone()
    size = full.size(partition_dim)
    if size % tp_size:
        raise ValueError(f"dimension {partition_dim} of a {tuple(full.shape)} weight has size {size}, "
                         f"not divisible by the tensor-parallel size {tp_size}; choose sizes that "
                         f"are multiples of {tp_size} (pad the vocabulary)")
    part = size // tp_size
    return full.narrow(partition_dim, tp_rank * part, part).clone()
