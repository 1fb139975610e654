"""--async-save's CUDA path and --memory-snapshot-step's CUDA file (issue 34 parts 1 and 6), on a
GPU: pieces on the device are copied into pinned host buffers on a side stream; a kernel queued
after the save that changes them in place must not leak into the file (the compute stream waits for
the copies), and the files equal a synchronous save's of the same values byte for byte. The memory
snapshot is the allocator's history file (its existence and size are checked; it is not loaded)."""

from __future__ import annotations

from pathlib import Path

import torch

from hybrid.checkpoint import writer
from hybrid.checkpoint.async_save import AsyncCheckpointWriter
from hybrid.checkpoint.format import Piece
from hybrid.parallel_state import ParallelState
from pretrain.memory_snapshot import MemorySnapshot
from tests.reliability_helpers import tree_hashes


def _files(root: Path) -> dict[str, str]:
    return {str(Path(k).relative_to(root)): v for k, v in tree_hashes(root).items()}


def test_async_save_from_cuda_is_pinned_and_equals_a_synchronous_save(tmp_path):
    world = ParallelState.single_process().world
    w = torch.randn(1 << 20, device="cuda")
    pieces = [Piece("w", "master", (1 << 20,), -1, 0, 1, 0, w),
              Piece("w", "model", (1 << 20,), -1, 0, 1, 0, w.to(torch.bfloat16))]
    extra = {"cpu": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state()}
    writer.save_checkpoint(tmp_path / "sync", 1, pieces, extra, {}, world, run_id="r")
    background = AsyncCheckpointWriter(world, "cuda")
    background.save(tmp_path / "async", 1, pieces, extra, {}, run_id="r")
    w.mul_(3)   # queued after the copies on the compute stream: must not reach the file
    background.finish()
    assert background.snapshot.pinned
    assert _files(tmp_path / "async") == _files(tmp_path / "sync")


def test_cuda_memory_snapshot_is_dumped(tmp_path):
    snap = MemorySnapshot(1, tmp_path, 0, torch.device("cuda"))
    snap.start()
    x = torch.randn(1024, 1024, device="cuda")
    path = snap.write(1, optimizer=None)
    del x
    assert path.name == "memory-snapshot-iter1-rank0.pickle" and path.stat().st_size > 0
