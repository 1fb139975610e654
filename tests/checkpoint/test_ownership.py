"""One job per --save directory, and every checkpoint file names its run (docs/design.md §8).

In-process: the lock refuses a second holder and takes over a dead one's; a checkpoint whose files
come from two runs is refused by name even though its manifest verifies; pruning and the clean-up of
interrupted saves touch only the saving run's directories. Out of process (real jobs): a second
torchrun job on a held --save stops at start-up, before any training, naming the holder; a lock
left by a killed job is taken over; a fresh run into another run's checkpoints is refused unless it
resumes (--load) or passes --overwrite.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from hybrid.checkpoint import CheckpointError, CheckpointReader, read_latest
from hybrid.checkpoint.format import MANIFEST_FILE, Piece, iteration_dir_name, rank_file_name
from hybrid.checkpoint.lock import LOCK_FILE, SaveDirLock, check_fresh_run
from hybrid.checkpoint.manifest import file_entry, header_entry
from hybrid.checkpoint.writer import prune_checkpoints, save_checkpoint
from hybrid.parallel_state import ParallelState
from hybrid.testing.corpus import build_corpus
from hybrid.testing.subprocesses import child_env
from tests.reliability_helpers import ENTRY, ROOT, tiny_cli, torchrun, tree_hashes


def _save(root: Path, iteration: int, run_id: str | None, keep_last: int = 5, **kw) -> Path:
    world = ParallelState.single_process().world
    piece = Piece("w", "model", (4,), -1, 0, 1, 0, torch.arange(4.0) + iteration)
    return save_checkpoint(root, iteration, [piece], {}, {"note": iteration}, world,
                           keep_last=keep_last, run_id=run_id, **kw)


# ---- the lock ----------------------------------------------------------------------------------
def test_second_holder_is_refused_naming_the_first(tmp_path):
    with SaveDirLock(tmp_path) as first:
        assert first.held
        holder = json.loads((tmp_path / LOCK_FILE).read_text())
        with pytest.raises(CheckpointError) as err:
            SaveDirLock(tmp_path)
        message = str(err.value)
        assert f"pid {os.getpid()}" in message and f"host {holder['host']}" in message
        assert f"started {holder['started']}" in message and "another --save" in message
    assert (tmp_path / LOCK_FILE).read_text() == ""          # a clean exit leaves no holder
    SaveDirLock(tmp_path).release()                         # and the next job takes it silently


def test_lock_of_a_dead_job_is_taken_over(tmp_path, caplog):
    (tmp_path / LOCK_FILE).write_text(json.dumps({"host": "node7", "pid": 4242,
                                                  "started": "2026-01-01 00:00:00 UTC"}))
    with caplog.at_level(logging.WARNING), SaveDirLock(tmp_path) as lock:
        assert lock.held
        assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    assert "the job that held it is gone (host node7, pid 4242" in caplog.text


def test_fresh_run_into_another_runs_checkpoints(tmp_path):
    check_fresh_run(tmp_path, overwrite=False)              # empty: fine
    _save(tmp_path, 1, "run-a")
    with pytest.raises(CheckpointError, match="already holds the checkpoints of another run; "
                                              "resume that run with --load"):
        check_fresh_run(tmp_path, overwrite=False)
    check_fresh_run(tmp_path, overwrite=True)


# ---- run identity ------------------------------------------------------------------------------
def test_every_file_names_the_run(tmp_path):
    final = _save(tmp_path, 1, "run-a")
    from safetensors import safe_open
    with safe_open(str(final / rank_file_name(0)), framework="pt") as f:
        assert f.metadata()["run_id"] == "run-a"
    assert json.loads((final / MANIFEST_FILE).read_text())["run_id"] == "run-a"
    assert CheckpointReader(final).run_id == "run-a"


def test_checkpoint_mixing_two_runs_is_refused_by_name(tmp_path):
    """The rank file of one job dropped into another's checkpoint, manifest re-hashed to match (what
    two jobs on one --save produced): every hash verifies, the reader still refuses."""
    a = _save(tmp_path / "a", 1, "run-a")
    b = _save(tmp_path / "b", 1, "run-b")
    name = rank_file_name(0)
    shutil.copy(b / name, a / name)
    manifest = json.loads((a / MANIFEST_FILE).read_text())
    manifest["files"][name] = {**file_entry(a / name), **header_entry(a / name)}
    (a / MANIFEST_FILE).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"mixes files of different runs .*"
                                              r"rank_00000.safetensors from run run-b"):
        CheckpointReader(a, verify="all")


# ---- clean-up touches only this run's directories --------------------------------------------
def test_prune_keeps_other_runs_checkpoints(tmp_path):
    _save(tmp_path, 1, "run-a")
    _save(tmp_path, 2, "run-a")
    for it in (3, 4, 5):
        _save(tmp_path, it, "run-b", keep_last=2)
    assert sorted(p.name for p in tmp_path.glob("iter_*")) == [iteration_dir_name(i)
                                                               for i in (1, 2, 4, 5)]
    assert prune_checkpoints(tmp_path, 1, "run-a") == [tmp_path / iteration_dir_name(1)]
    _save(tmp_path, 6, "run-c", keep_last=2, replace_other_runs=True)   # --overwrite
    assert sorted(p.name for p in tmp_path.glob("iter_*")) == [iteration_dir_name(6)]


def test_stale_temporary_directories_of_other_runs_are_left_alone(tmp_path):
    mine, theirs = tmp_path / "iter_0000003.tmp", tmp_path / "iter_0000004.tmp"
    for d, owner in ((mine, "run-a"), (theirs, "run-b")):
        d.mkdir()
        (d / "run_id.owner").write_text(owner + "\n")
        (d / "rank_00000.safetensors").write_bytes(b"partial")
    _save(tmp_path, 5, "run-a")
    assert not mine.exists() and theirs.is_dir()
    with pytest.raises(CheckpointError, match="iter_0000004.tmp exists and was written by another run"):
        _save(tmp_path, 4, "run-a")
    assert theirs.is_dir() and read_latest(tmp_path) == iteration_dir_name(5)


# ---- real jobs ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return build_corpus(tmp_path_factory.mktemp("lock_corpus"))


def _run(cmd: list[str], timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env=child_env())


def _error_lines(proc: subprocess.CompletedProcess) -> list[str]:
    return [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("error:")]


def _trained(proc: subprocess.CompletedProcess) -> bool:
    return "iteration " in proc.stdout + proc.stderr and "lm loss" in proc.stdout + proc.stderr


def _descendants(pid: int) -> list[int]:
    """``pid``'s child processes, recursively (torchrun's ranks may sit in their own sessions)."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        kids = parents.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


def _kill_tree(proc: subprocess.Popen) -> None:
    for pid in [proc.pid, *_descendants(proc.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def _start_and_wait_for_a_checkpoint(cmd: list[str], save: Path) -> subprocess.Popen:
    job = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT,
                           env=child_env())
    deadline = time.monotonic() + 180
    while read_latest(save) is None:      # the job holds the lock and has saved a checkpoint
        if job.poll() is not None or time.monotonic() > deadline:
            _kill_tree(job)
            pytest.fail("the first job did not save a checkpoint")
        time.sleep(0.5)
    return job


def test_second_job_on_a_held_save_stops_at_start_up(corpus, tmp_path):
    """Job A (torchrun, 2 ranks) trains and holds --save; job B (torchrun, 2 ranks, same --save)
    must fail before training with one line naming A's host, pid and start time; A trains on."""
    save = tmp_path / "ckpt"
    args = tiny_cli(corpus, tmp_path / "cache", iters=100000,
                    extra=["--save", str(save), "--save-interval", "2", "--global-batch-size", "4"])
    a = _start_and_wait_for_a_checkpoint(torchrun(2, args), save)
    try:
        holder = json.loads((save / LOCK_FILE).read_text())
        b = _run(torchrun(2, tiny_cli(corpus, tmp_path / "cache", iters=4,
                                      extra=["--save", str(save), "--global-batch-size", "4"])))
        assert a.poll() is None                             # A trains on
    finally:
        _kill_tree(a)
    assert b.returncode != 0
    lines = [line for line in _error_lines(b) if "in use by another job" in line]
    assert lines, (b.stdout + b.stderr)[-3000:]
    assert (f"host {holder['host']}, pid {holder['pid']}, started {holder['started']}"
            in lines[0] and "another --save" in lines[0])
    assert not _trained(b)
    assert CheckpointReader(save, verify="all").run_id is not None


@pytest.mark.slow   # CI budget: the lock take-over itself is test_lock_of_a_dead_job_is_taken_over
def test_killed_jobs_lock_is_taken_over_and_fresh_runs_need_load_or_overwrite(corpus, tmp_path):
    """A job killed with SIGKILL leaves its lock and checkpoints; the same command again takes the
    lock over but refuses to start a new run over them (one error line, nothing touched);
    --overwrite starts the new run, whose first checkpoint replaces the old run's."""
    save = tmp_path / "ckpt"
    cli = tiny_cli(corpus, tmp_path / "cache", iters=100000, extra=["--save", str(save),
                                                                    "--save-interval", "1"])
    first = _start_and_wait_for_a_checkpoint([sys.executable, str(ENTRY), *cli], save)
    holder = json.loads((save / LOCK_FILE).read_text())
    _kill_tree(first)
    run_a = CheckpointReader(save).run_id
    before = tree_hashes(*[p for p in save.iterdir() if p.name != LOCK_FILE])
    short = ["--train-iters", "2", "--lr-decay-iters", "2"]
    again = _run([sys.executable, str(ENTRY), *cli, *short])        # the same command again
    assert again.returncode == 2
    assert f"the job that held it is gone (host {holder['host']}, pid {holder['pid']}" in again.stderr
    assert len(_error_lines(again)) == 1 and "--overwrite" in _error_lines(again)[0]
    assert "Traceback" not in again.stderr and not _trained(again)
    assert tree_hashes(*[p for p in save.iterdir() if p.name != LOCK_FILE]) == before
    over = _run([sys.executable, str(ENTRY), *cli, *short, "--overwrite"])
    assert over.returncode == 0, over.stderr[-3000:]
    run_b = CheckpointReader(save, verify="all").run_id
    assert run_b != run_a
    for d in save.glob("iter_*"):
        assert CheckpointReader(d).run_id == run_b, d          # the old run's are gone
