"""``--async-save`` (hybrid/checkpoint/async_save.py, issue 34 part 1): the same files as a
synchronous save, written while training goes on, committed only when every rank's write is done.

* writer level: an asynchronous save of the same pieces (fp32, bf16, RNG bytes) gives a directory
  whose every file is byte-identical to the synchronous save's; while its (slowed) write runs,
  ``latest`` still names the previous checkpoint, ``poll`` does not wait, and the next save waits
  for it (the wait is measured); a write that fails leaves the previous checkpoint as ``latest``
  and raises on the next collective; host buffers are reused (bounded) across saves.
* trainer level (in-process, one rank): a run with ``--async-save`` has the same losses and leaves
  byte-identical checkpoint files as the same run with synchronous saves (run id fixed).
The kill -9 during a write, with a restart that resumes exactly, is tests/reliability/test_async_kill.py.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from hybrid.checkpoint import CheckpointError, CheckpointReader, read_latest, writer
from hybrid.checkpoint.async_save import AsyncCheckpointWriter
from hybrid.checkpoint.format import Piece
from hybrid.parallel_state import ParallelState
from hybrid.testing.corpus import build_corpus
from tests.reliability_helpers import tiny_cli, tree_hashes


def _pieces(seed: int) -> tuple[list[Piece], dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(6, 4, generator=g)
    pieces = [Piece("w", "master", (6, 4), 0, 0, 1, 0, w.reshape(-1)[:12]),
              Piece("w", "master", (6, 4), 0, 0, 1, 12, w.reshape(-1)[12:]),
              Piece("w", "model", (6, 4), 0, 0, 1, 0, w.reshape(-1).to(torch.bfloat16)),
              Piece("b", "exp_avg", (5,), -1, 0, 1, 0, torch.randn(5, generator=g))]
    return pieces, {"cpu": torch.get_rng_state(), "tp": torch.randint(0, 255, (7,), dtype=torch.uint8)}


def _relative(hashes: dict[str, str], root: Path) -> dict[str, str]:
    return {str(Path(k).relative_to(root)): v for k, v in hashes.items()}


def test_async_files_are_bit_identical_to_a_synchronous_save(tmp_path):
    world = ParallelState.single_process().world
    pieces, extra = _pieces(0)
    writer.save_checkpoint(tmp_path / "sync", 3, pieces, extra, {"note": 1}, world, run_id="run-a")
    background = AsyncCheckpointWriter(world)
    background.save(tmp_path / "async", 3, pieces, extra, {"note": 1}, run_id="run-a")
    for p in pieces:   # training goes on: the snapshot, not the live tensors, is written
        p.tensor.add_(1)
    background.finish()
    sync = _relative(tree_hashes(tmp_path / "sync"), tmp_path / "sync")
    assert sync and _relative(tree_hashes(tmp_path / "async"), tmp_path / "async") == sync
    assert read_latest(tmp_path / "async") == "iter_0000003"
    CheckpointReader(tmp_path / "async" / "iter_0000003", verify="all")


def test_one_save_in_flight_the_next_waits_and_latest_moves_only_at_commit(tmp_path, monkeypatch):
    world = ParallelState.single_process().world
    write = writer.write_rank_file
    delay = {"s": 0.0}

    def slow_write(*args, **kwargs):
        time.sleep(delay["s"])
        return write(*args, **kwargs)

    monkeypatch.setattr(writer, "write_rank_file", slow_write)
    background = AsyncCheckpointWriter(world)
    pieces, extra = _pieces(1)
    background.save(tmp_path, 2, pieces, extra, {}, run_id="r")
    background.finish()
    host_bytes = background.snapshot.bytes
    assert host_bytes == sum(p.tensor.numel() * p.tensor.element_size() for p in pieces) + \
        sum(t.numel() * t.element_size() for t in extra.values())
    delay["s"] = 0.6
    start = time.perf_counter()
    background.save(tmp_path, 4, pieces, extra, {}, run_id="r")
    assert time.perf_counter() - start < 0.3            # the loop does not wait for the write
    assert background.poll() is False                    # still writing: nothing committed
    assert read_latest(tmp_path) == "iter_0000002" and (tmp_path / "iter_0000004.tmp").is_dir()
    background.save(tmp_path, 6, pieces, extra, {}, run_id="r")   # waits for iteration 4's write
    assert background.last_wait > 0.2
    assert read_latest(tmp_path) == "iter_0000004"
    assert background.snapshot.bytes == host_bytes      # the same buffers, reused
    time.sleep(0.8)
    assert background.poll() is True                     # done: committed without waiting
    assert read_latest(tmp_path) == "iter_0000006" and background.last_wait < 0.1


def test_failed_background_write_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    world = ParallelState.single_process().world
    background = AsyncCheckpointWriter(world)
    pieces, extra = _pieces(2)
    background.save(tmp_path, 1, pieces, extra, {}, run_id="r")
    background.finish()

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(writer, "write_rank_file", full_disk)
    background.save(tmp_path, 2, pieces, extra, {}, run_id="r")
    with pytest.raises(CheckpointError, match="in the background.*No space left"):
        background.finish()
    assert read_latest(tmp_path) == "iter_0000001"
    CheckpointReader(tmp_path / "iter_0000001", verify="all")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return build_corpus(tmp_path_factory.mktemp("async_corpus"))


def _train(corpus, tmp_path: Path, name: str, extra: list[str], monkeypatch):
    from pretrain.arguments import parse_args
    from pretrain.setup import run
    monkeypatch.setattr("pretrain.resume.new_run_id", lambda: "20260101T000000Z-fixedid0")
    cfg, _ = parse_args(tiny_cli(corpus, tmp_path / "cache", iters=5,
                                 extra=["--save", str(tmp_path / name), "--save-interval", "2", "--no-roofline",
                                        *extra]))
    return run(cfg)


@pytest.mark.slow   # two in-process training runs: ~10 s alone, ~30 s on the shared CI machine
def test_training_with_async_save_matches_synchronous_saves(corpus, tmp_path, monkeypatch):
    """Same command line but --async-save (same --save path, moved away in between): the same
    losses, byte-identical rank files, and metadata that differs only in the flag itself."""
    sync = _train(corpus, tmp_path, "ckpt", [], monkeypatch)
    (tmp_path / "ckpt").rename(tmp_path / "sync")
    background = _train(corpus, tmp_path, "ckpt", ["--async-save"], monkeypatch)
    assert background.losses == sync.losses
    assert background.async_save.committed == [tmp_path / "ckpt" / f"iter_{i:07d}" for i in (2, 4, 5)]
    assert not background.async_save.in_flight
    files = _relative(tree_hashes(tmp_path / "sync"), tmp_path / "sync")
    mine = _relative(tree_hashes(tmp_path / "ckpt"), tmp_path / "ckpt")
    ranks = {k for k in files if k.endswith("safetensors")}
    assert ranks == {f"iter_{i:07d}/rank_00000.safetensors" for i in (2, 4, 5)}
    assert {k: mine[k] for k in ranks} == {k: files[k] for k in ranks}
    assert read_latest(tmp_path / "ckpt") == read_latest(tmp_path / "sync") == "iter_0000005"
    for i in (2, 4, 5):
        a, b = (json.loads((d / f"iter_{i:07d}" / "metadata.json").read_text())
                for d in (tmp_path / "sync", tmp_path / "ckpt"))
        assert (a["config"]["checkpoint"].pop("async_save"),
                b["config"]["checkpoint"].pop("async_save")) == (False, True)
        assert a == b


def test_sigterm_waits_for_the_background_write_before_a_clean_exit(corpus, tmp_path, monkeypatch):
    """SIGTERM (as --exit-duration-in-mins and Ctrl-C: the same stop of the loop) while iteration
    2's write is slow: the loop saves iteration 3 after waiting for 2, and returns only once 3's
    background write is committed - the process can then exit 0 with its checkpoint complete."""
    import os
    import signal
    from pretrain.trainer import Trainer
    write = writer.write_rank_file

    def slow_write(*args, **kwargs):
        time.sleep(0.5)
        return write(*args, **kwargs)

    monkeypatch.setattr(writer, "write_rank_file", slow_write)
    step = Trainer.train_step

    def signalled(self, loader, lr):
        if self.ts.iteration == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return step(self, loader, lr)

    monkeypatch.setattr(Trainer, "train_step", signalled)
    trainer = _train(corpus, tmp_path, "ckpt", ["--async-save"], monkeypatch)
    assert trainer.ts.iteration == 3
    assert trainer.async_save.committed == [tmp_path / "ckpt" / f"iter_{i:07d}" for i in (2, 3)]
    assert not trainer.async_save.in_flight and trainer.async_save.total_wait > 0.2
    assert read_latest(tmp_path / "ckpt") == "iter_0000003"
    CheckpointReader(tmp_path / "ckpt" / "iter_0000003", verify="all")
