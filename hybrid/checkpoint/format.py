"""The on-disk checkpoint format, independent of the layout that wrote it (docs/design.md §8).

A checkpoint is a directory ``<save>/iter_0000100/`` holding

    rank_00003.safetensors   tensors written by rank 3: pieces of model parameters and optimizer state
                             (safetensors: a tensor format, nothing is unpickled on load)
    metadata.json            format version, iteration, consumed samples, the resolved config, the
                             layout that wrote it, loss-scaler and optimizer counters
    manifest.json            sha256 and size of every other file, written last inside the directory

and ``<save>/latest`` names the newest complete one; it is replaced only after the directory is.

Every tensor is a :class:`Piece`: a contiguous range ``[offset, offset + numel)`` of one parameter's
*TP-local* tensor flattened, plus what is needed to place it in the *canonical* full tensor
(``full_shape``, ``partition_dim``, ``tp_rank`` of ``tp_size``). ZeRO partitions a flattened TP shard
into DP ranges (ZeRO §5), so a piece is exactly what one rank owns. A loader at any other TP/DP
degree and ZeRO stage reassembles the canonical tensor and cuts its own pieces out of it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FORMAT_VERSION = 1
METADATA_FILE = "metadata.json"
MANIFEST_FILE = "manifest.json"
LATEST_FILE = "latest"
KINDS = ("model", "master", "exp_avg", "exp_avg_sq")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or read; the message names the file and the fix."""


def iteration_dir_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def rank_file_name(rank: int) -> str:
    return f"rank_{rank:05d}.safetensors"


@dataclass
class Piece:
    """A flat range of one TP-local parameter tensor (or of its optimizer state)."""

    name: str                   # canonical parameter name, independent of TP/DP/stage
    kind: str                   # one of KINDS
    full_shape: tuple[int, ...]  # shape of the whole (TP-unsharded) parameter
    partition_dim: int          # dim split across TP, -1 if replicated
    tp_rank: int
    tp_size: int
    offset: int                 # element offset inside the flattened TP-local tensor
    tensor: torch.Tensor | None = None  # 1-D, numel elements
    valid_rows: int | None = None  # rows of dim 0 that are real; the rest is padding (vocab)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"piece kind {self.kind!r} is not one of {KINDS}")
        self.full_shape = tuple(int(d) for d in self.full_shape)

    @property
    def key(self) -> str:
        return f"{self.kind}:{self.name}:tp{self.tp_rank}:{self.offset}"

    @property
    def local_shape(self) -> tuple[int, ...]:
        return local_shape(self.full_shape, self.partition_dim, self.tp_size)

    def describe(self) -> dict:
        """JSON-able description without the tensor (stored in the safetensors header)."""
        return {"name": self.name, "kind": self.kind, "full_shape": list(self.full_shape),
                "partition_dim": self.partition_dim, "tp_rank": self.tp_rank,
                "tp_size": self.tp_size, "offset": self.offset, "numel": self.tensor.numel(),
                "dtype": str(self.tensor.dtype).removeprefix("torch."),
                "valid_rows": self.valid_rows}


def local_shape(full_shape: tuple[int, ...], partition_dim: int, tp_size: int) -> tuple[int, ...]:
    if partition_dim < 0:
        return tuple(full_shape)
    shape = list(full_shape)
    if shape[partition_dim] % tp_size:
        raise CheckpointError(f"dimension {partition_dim} of size {shape[partition_dim]} does not "
                              f"split into {tp_size} tensor-parallel shards")
    shape[partition_dim] //= tp_size
    return tuple(shape)
