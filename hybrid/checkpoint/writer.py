"""Atomic, multi-rank checkpoint writer with an integrity manifest and keep-last-k (DESIGN.md 8).

Protocol (every rank calls :func:`save_checkpoint`; the directory must be on a filesystem all ranks
share):

1. rank 0 creates an empty ``iter_N.tmp/``; barrier;
2. every rank writes ``rank_R.safetensors`` (its pieces + its RNG states), fsyncs it, hashes it and
   leaves the hash in a small side file; barrier;
3. rank 0 folds the side files into ``manifest.json``, writes ``metadata.json``, fsyncs, renames
   ``iter_N.tmp`` to ``iter_N``, fsyncs the parent, then replaces ``latest`` (temp + rename), and
   finally deletes checkpoints beyond the newest ``keep_last``; barrier.

A crash at any point leaves ``latest`` naming the previous complete checkpoint; a stale ``.tmp``
directory is removed by the next save.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from hybrid import comm
from hybrid.checkpoint.format import (FORMAT_VERSION, LATEST_FILE, METADATA_FILE, CheckpointError,
                                      Piece, iteration_dir_name, rank_file_name)
from hybrid.checkpoint.manifest import file_entry, write_json_durably, write_manifest

log = logging.getLogger(__name__)
_HASH_SUFFIX = ".hash.json"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_rank_file(directory: Path, rank: int, pieces: list[Piece],
                    extra: dict[str, torch.Tensor]) -> Path:
    """One safetensors file: ``pieces`` under their keys, ``extra`` (RNG states) under ``extra:``."""
    tensors, index = {}, []
    for piece in pieces:
        if piece.key in tensors:
            raise CheckpointError(f"two pieces with key {piece.key} on rank {rank}")
        tensors[piece.key] = piece.tensor.detach().reshape(-1).to("cpu", copy=True).contiguous()
        index.append(piece.describe())
    for name, tensor in extra.items():
        tensors[f"extra:{name}"] = tensor.detach().to("cpu", copy=True).contiguous()
    path = directory / rank_file_name(rank)
    save_file(tensors, str(path), metadata={"pieces": json.dumps(index), "rank": str(rank),
                                            "format_version": str(FORMAT_VERSION)})
    with open(path, "rb+") as f:
        os.fsync(f.fileno())
    write_json_durably(directory / (path.name + _HASH_SUFFIX), {path.name: file_entry(path)})
    return path


def commit_directory(save_dir: Path, tmp: Path, final: Path, metadata: dict, keep_last: int) -> None:
    """Rank 0, after every rank file is in ``tmp``: manifest, metadata, rename, ``latest``, prune."""
    entries = {}
    for side in sorted(tmp.glob("*" + _HASH_SUFFIX)):
        with open(side) as f:
            entries.update(json.load(f))
        side.unlink()
    write_json_durably(tmp / METADATA_FILE, {"format_version": FORMAT_VERSION, **metadata})
    entries[METADATA_FILE] = file_entry(tmp / METADATA_FILE)
    write_manifest(tmp, entries)
    _fsync_dir(tmp)
    if final.exists():  # re-saving an iteration (e.g. after a resume): replace it whole
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync_dir(save_dir)
    latest_tmp = save_dir / (LATEST_FILE + ".tmp")
    with open(latest_tmp, "w") as f:
        f.write(final.name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(latest_tmp, save_dir / LATEST_FILE)
    _fsync_dir(save_dir)
    prune_checkpoints(save_dir, keep_last)


def prune_checkpoints(save_dir: Path, keep_last: int) -> list[Path]:
    """Delete all but the newest ``keep_last`` complete checkpoints (never the one ``latest`` names)."""
    latest = read_latest(save_dir)
    done = sorted(p for p in save_dir.glob("iter_*") if p.is_dir() and not p.name.endswith(".tmp"))
    doomed = [p for p in done[:-keep_last] if p.name != latest] if keep_last > 0 else []
    for path in doomed:
        shutil.rmtree(path)
        log.info("removed old checkpoint %s (keeping the last %d)", path, keep_last)
    return doomed


def read_latest(save_dir: Path) -> str | None:
    path = Path(save_dir) / LATEST_FILE
    return path.read_text().strip() if path.is_file() else None


def save_checkpoint(save_dir: str | Path, iteration: int, pieces: list[Piece],
                    extra: dict[str, torch.Tensor], metadata: dict, world: comm.Group,
                    keep_last: int = 2) -> Path:
    """Collective: every rank of ``world`` calls it with its own pieces; returns the final directory.
    ``metadata`` (JSON-able) is taken from rank 0."""
    save_dir = Path(save_dir)
    final = save_dir / iteration_dir_name(iteration)
    tmp = save_dir / (final.name + ".tmp")
    if world.rank == 0:
        save_dir.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    comm.barrier(world)
    write_rank_file(tmp, world.ranks[world.rank], pieces, extra)
    comm.barrier(world)
    if world.rank == 0:
        commit_directory(save_dir, tmp, final, {**metadata, "iteration": iteration,
                                       "world_size": world.size}, keep_last)
        log.info("saved checkpoint %s", final)
    comm.barrier(world)
    return final
