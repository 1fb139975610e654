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

Expert tensors (issue 32) are split twice: dim 0 (the experts) over the EP group first (EP rank e
holds experts [e E/EP, (e+1) E/EP)), then ``partition_dim`` over TP; their pieces carry
``ep_rank`` of ``ep_size`` (1 for everything else, and then absent from the header and the key, so
checkpoints without experts are written byte for byte as before).
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
    ep_rank: int = 0            # experts: dim 0 split over EP first (ep_size 1: not split)
    ep_size: int = 1

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"piece kind {self.kind!r} is not one of {KINDS}")
        self.full_shape = tuple(int(d) for d in self.full_shape)

    @property
    def key(self) -> str:
        ep = f":ep{self.ep_rank}" if self.ep_size > 1 else ""
        return f"{self.kind}:{self.name}:tp{self.tp_rank}{ep}:{self.offset}"

    @property
    def local_shape(self) -> tuple[int, ...]:
        return local_shape(expert_shape(self.full_shape, self.ep_size), self.partition_dim,
                           self.tp_size)

    def describe(self) -> dict:
        """JSON-able description without the tensor (stored in the safetensors header)."""
        return {"name": self.name, "kind": self.kind, "full_shape": list(self.full_shape),
                "partition_dim": self.partition_dim, "tp_rank": self.tp_rank,
                "tp_size": self.tp_size, "offset": self.offset, "numel": self.tensor.numel(),
                "dtype": str(self.tensor.dtype).removeprefix("torch."),
                "valid_rows": self.valid_rows,
                **({"ep_rank": self.ep_rank, "ep_size": self.ep_size} if self.ep_size > 1 else {})}


def expert_shape(full_shape: tuple[int, ...], ep_size: int) -> tuple[int, ...]:
    """The shape one EP rank holds of an expert tensor (dim 0 split into ``ep_size`` parts)."""
    if ep_size == 1:
        return tuple(full_shape)
    if full_shape[0] % ep_size:
        raise CheckpointError(f"{full_shape[0]} experts do not split over {ep_size} "
                              f"expert-parallel ranks; pick --expert-model-parallel-size dividing "
                              f"--num-experts")
    return (full_shape[0] // ep_size, *full_shape[1:])


def local_shape(full_shape: tuple[int, ...], partition_dim: int, tp_size: int) -> tuple[int, ...]:
    if partition_dim < 0:
        return tuple(full_shape)
    shape = list(full_shape)
    if shape[partition_dim] % tp_size:
        raise CheckpointError(f"dimension {partition_dim} of size {shape[partition_dim]} does not "
                              f"split into {tp_size} tensor-parallel shards")
    shape[partition_dim] //= tp_size
    return tuple(shape)
