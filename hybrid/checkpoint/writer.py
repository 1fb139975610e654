"""Atomic, multi-rank checkpoint writer with an integrity manifest and keep-last-k (docs/design.md §8).

Protocol (every rank calls :func:`save_checkpoint`; the directory must be on a filesystem all ranks
share):

1. rank 0 creates an empty ``iter_N.tmp/``;
2. every rank writes ``rank_R.safetensors`` (its pieces + its RNG states), fsyncs it, hashes it and
   leaves the hash in a small side file;
3. rank 0 folds the side files into ``manifest.json``, writes ``metadata.json``, fsyncs, renames
   ``iter_N.tmp`` to ``iter_N``, fsyncs the parent, then replaces ``latest`` (temp + rename), and
   finally deletes this run's checkpoints beyond the newest ``keep_last``.

Every file carries the run's identity (``run_id``: in ``metadata.json``, ``manifest.json`` and each
rank file's safetensors metadata), so a checkpoint whose files come from two jobs is refused on load,
and clean-up touches only this run's directories (:mod:`hybrid.checkpoint.lock` keeps a second job
out of the directory in the first place).

After each step the ranks all-reduce a failure flag (it doubles as the barrier), so an error on
one rank (disk full, unshared directory) raises on every rank instead of hanging the others.

A crash at any point leaves ``latest`` naming the previous complete checkpoint; stale ``iter_*.tmp``
directories (of any iteration) that this run left are removed by its next save (resuming continues
the run, so a restarted job cleans up after its crashed attempt); another run's are left alone.
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
from hybrid.checkpoint.manifest import file_entry, header_entry, write_json_durably, write_manifest

log = logging.getLogger(__name__)
_HASH_SUFFIX = ".hash.json"
_OWNER_FILE = "run_id.owner"   # inside iter_N.tmp while it is written: whose save it is


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_rank_file(directory: Path, rank: int, pieces: list[Piece],
                    extra: dict[str, torch.Tensor], run_id: str | None = None, *,
                    copy: bool = True) -> Path:
    """One safetensors file: ``pieces`` under their keys, ``extra`` (RNG states) under ``extra:``;
    its manifest entry hashes the safetensors header separately, so a reader can trust the piece
    index before it has hashed the whole file. ``copy=False``: the tensors are already this save's
    own contiguous host copies (an asynchronous save's snapshot), written as they are."""
    tensors, index = {}, []
    for piece in pieces:
        if piece.key in tensors:
            raise CheckpointError(f"two pieces with key {piece.key} on rank {rank}")
        flat = piece.tensor.detach().reshape(-1)
        tensors[piece.key] = flat.to("cpu", copy=True).contiguous() if copy else flat
        index.append(piece.describe())
    for name, tensor in extra.items():
        tensors[f"extra:{name}"] = (tensor.detach().to("cpu", copy=True).contiguous() if copy
                                    else tensor)
    path = directory / rank_file_name(rank)
    metadata = {"pieces": json.dumps(index), "rank": str(rank), "format_version": str(FORMAT_VERSION)}
    if run_id is not None:
        metadata["run_id"] = run_id
    save_file(tensors, str(path), metadata=metadata)
    with open(path, "rb+") as f:
        _canonical_header(f)
        os.fsync(f.fileno())
    write_json_durably(directory / (path.name + _HASH_SUFFIX),
                       {path.name: {**file_entry(path), **header_entry(path)}})
    return path


def _canonical_header(f) -> None:
    """Rewrite the safetensors header of the open file ``f`` in place with its ``__metadata__``
    keys sorted: safetensors keeps them in a Rust HashMap whose order is random per call, so two
    saves of the same state differed in their header bytes (and hashes). Same length: the JSON is
    re-dumped compactly and padded with spaces, which the format allows."""
    head = f.read(8)
    length = int.from_bytes(head, "little")
    header = json.loads(f.read(length))
    if "__metadata__" in header:
        header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    if len(text) > length:   # never seen: keep safetensors' own header rather than move the data
        return
    f.seek(8)
    f.write(text + b" " * (length - len(text)))
    f.flush()


def commit_directory(save_dir: Path, tmp: Path, final: Path, metadata: dict, keep_last: int,
                     expected_ranks: int | None = None, run_id: str | None = None,
                     replace_other_runs: bool = False, prune: bool = True) -> None:
    """Rank 0, after every rank file is in ``tmp``: manifest, metadata, rename, ``latest``, prune
    (``prune=False``: the caller prunes, e.g. in the background)."""
    found = len(list(tmp.glob("rank_*" + _HASH_SUFFIX)))
    if expected_ranks is not None and found != expected_ranks:
        raise CheckpointError(f"rank 0 sees {found} of {expected_ranks} rank files in {tmp}: --save "
                              f"must be a directory every node shares (a parallel or network "
                              f"filesystem)")
    (tmp / _OWNER_FILE).unlink(missing_ok=True)
    entries = {}
    for side in sorted(tmp.glob("*" + _HASH_SUFFIX)):
        with open(side) as f:
            entries.update(json.load(f))
        side.unlink()
    identity = {} if run_id is None else {"run_id": run_id}
    write_json_durably(tmp / METADATA_FILE, {"format_version": FORMAT_VERSION, **metadata, **identity})
    entries[METADATA_FILE] = file_entry(tmp / METADATA_FILE)
    write_manifest(tmp, entries, run_id)
    for path in tmp.iterdir():   # whatever the umask: nobody but the owner may alter a checkpoint
        os.chmod(path, 0o644)
    os.chmod(tmp, 0o755)
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
    os.chmod(latest_tmp, 0o644)
    os.replace(latest_tmp, save_dir / LATEST_FILE)
    _fsync_dir(save_dir)
    if prune:
        prune_checkpoints(save_dir, keep_last, run_id, replace_other_runs=replace_other_runs)


def prune_checkpoints(save_dir: Path, keep_last: int, run_id: str | None = None, *,
                      replace_other_runs: bool = False) -> list[Path]:
    """Delete all but the newest ``keep_last`` complete checkpoints of run ``run_id`` (of every run
    when None), never the one ``latest`` names; with ``replace_other_runs`` (``--overwrite``) also
    every other run's."""
    latest = read_latest(save_dir)
    done = sorted(p for p in save_dir.glob("iter_*") if p.is_dir() and not p.name.endswith(".tmp"))
    mine = [p for p in done if run_id is None or checkpoint_run_id(p) == run_id]
    doomed = [p for p in mine[:-keep_last] if p.name != latest] if keep_last > 0 else []
    if replace_other_runs:
        doomed += [p for p in done if p not in mine and p.name != latest]
    for path in doomed:
        shutil.rmtree(path)
        log.info("removed old checkpoint %s (keeping the last %d of this run)", path, keep_last)
    return doomed


def checkpoint_run_id(directory: Path) -> str | None:
    """The run that wrote a checkpoint directory (None: unreadable, or written before run ids)."""
    try:
        with open(directory / METADATA_FILE) as f:
            return json.load(f).get("run_id")
    except (OSError, ValueError, AttributeError):
        return None


def remove_stale_saves(save_dir: Path, run_id: str | None, replace_other_runs: bool = False) -> None:
    """``iter_*.tmp`` directories left by interrupted saves of this run (every one when ``run_id``
    is None or ``replace_other_runs``); other runs' are reported, not touched."""
    for stale in save_dir.glob("iter_*.tmp"):
        try:
            owner = (stale / _OWNER_FILE).read_text().strip()
        except OSError:
            owner = None
        if run_id is None or owner == run_id or replace_other_runs:
            log.warning("removing %s, left by an interrupted save", stale)
            shutil.rmtree(stale)
        else:
            log.warning("leaving %s alone: another run (%s) wrote it", stale, owner or "unknown")


def read_latest(save_dir: Path) -> str | None:
    path = Path(save_dir) / LATEST_FILE
    return path.read_text().strip() if path.is_file() else None


def agree_on_failure(world: comm.Group, step, what: str, device) -> None:
    """Collective over ``world``: run ``step`` (or nothing when None) and make every rank raise if
    any rank's step failed, so a failed save or load never leaves the other ranks waiting in a
    collective (docs/design.md §10)."""
    error = None
    if step is not None:
        try:
            step()
        except Exception as err:  # reported to every rank below, re-raised here with its cause
            error = err
    failed = comm.max_over(world, 0 if error is None else world.ranks[world.rank] + 1, device)
    if error is not None:
        raise CheckpointError(f"{what} failed on this rank: {error}") from error
    if failed:
        raise CheckpointError(f"{what} failed on rank {failed - 1}; see its log")


def save_paths(save_dir: str | Path, iteration: int) -> tuple[Path, Path, Path]:
    """(save directory, final ``iter_N``, temporary ``iter_N.tmp``) of one save."""
    save_dir = Path(save_dir)
    final = save_dir / iteration_dir_name(iteration)
    return save_dir, final, save_dir / (final.name + ".tmp")


def prepare_save(save_dir: Path, tmp: Path, run_id: str | None, replace_other_runs: bool) -> None:
    """Rank 0, before any rank writes: the save directory, stale saves of this run removed, an
    empty ``tmp`` marked with the run that owns it."""
    save_dir.mkdir(mode=0o755, parents=True, exist_ok=True)   # never world-writable
    remove_stale_saves(save_dir, run_id, replace_other_runs)
    if tmp.exists():
        raise CheckpointError(f"{tmp} exists and was written by another run (an interrupted "
                              f"save); remove it, or start this run with --overwrite")
    tmp.mkdir(mode=0o755)
    if run_id is not None:
        (tmp / _OWNER_FILE).write_text(run_id + "\n")


def commit_save(save_dir: Path, tmp: Path, final: Path, metadata: dict, iteration: int,
                world_size: int, keep_last: int, run_id: str | None,
                replace_other_runs: bool, prune: bool = True) -> None:
    """Rank 0, once every rank's file is in ``tmp``: :func:`commit_directory` with the iteration and
    the world size added to ``metadata``."""
    commit_directory(save_dir, tmp, final, {**metadata, "iteration": iteration,
                                            "world_size": world_size}, keep_last,
                     expected_ranks=world_size, run_id=run_id, replace_other_runs=replace_other_runs,
                     prune=prune)


def save_checkpoint(save_dir: str | Path, iteration: int, pieces: list[Piece],
                    extra: dict[str, torch.Tensor], metadata: dict, world: comm.Group,
                    keep_last: int = 2, device: str | torch.device = "cpu", *,
                    run_id: str | None = None, replace_other_runs: bool = False) -> Path:
    """Collective: every rank of ``world`` calls it with its own pieces; returns the final directory.
    ``metadata`` (JSON-able) is taken from rank 0. Any rank's failure raises on every rank.
    ``run_id`` marks every file; pruning and clean-up then touch only that run's directories.
    (:mod:`hybrid.checkpoint.async_save` runs the same three steps, the write in the background.)"""
    save_dir, final, tmp = save_paths(save_dir, iteration)
    first = world.rank == 0

    def commit() -> None:
        commit_save(save_dir, tmp, final, metadata, iteration, world.size, keep_last, run_id,
                    replace_other_runs)

    agree_on_failure(world, (lambda: prepare_save(save_dir, tmp, run_id, replace_other_runs))
                     if first else None, f"creating {tmp}", device)
    agree_on_failure(world, lambda: write_rank_file(tmp, world.ranks[world.rank], pieces, extra,
                                                    run_id),
                     "writing the rank file", device)
    agree_on_failure(world, commit if first else None, f"committing {final}", device)
    if first:
        log.info("saved checkpoint %s", final)
    return final
