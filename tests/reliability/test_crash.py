"""Crashes never lose training (docs/design.md §8, §10), with real processes:

* ``torchrun --max-restarts 1``: rank 1 is SIGKILLed mid-training; torchrun restarts the job, which
  resumes from the latest checkpoint, and the completed run's per-iteration losses equal an
  uninterrupted run's exactly (fp32, CPU, TP 1 x DP 2).
* a process dies inside a checkpoint save (after its rank file / after the rename, before
  ``latest``): the previous checkpoint stays loadable and named by ``latest``; the partial directory
  is ignored by the loader and removed by the next save; the relaunched run continues the curve.
* a rank that raises makes every rank exit well within the process-group timeout, and the job's
  output carries the failing rank's error (no hang).
The oracle is always an uninterrupted run of the same command."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hybrid.checkpoint import CheckpointReader, read_latest
from hybrid.testing.corpus import build_corpus
from tests.reliability_helpers import FAULT_ENTRY, logged_losses, run_command, tiny_cli, torchrun

ITERS = 6
SAVE = ["--save-interval", "2"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return build_corpus(tmp_path_factory.mktemp("crash_corpus"))


def _run(cmd: list[str], timeout: float = 240, **env) -> subprocess.CompletedProcess:
    return run_command(cmd, timeout, **env)


def _records(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()]


def test_kill9_under_torchrun_restarts_and_resumes_exactly(corpus, tmp_path):
    args = tiny_cli(corpus, tmp_path / "cache", iters=ITERS, extra=SAVE + ["--global-batch-size", "4"])
    ref = _run(torchrun(2, args + ["--save", str(tmp_path / "ref")], entry=FAULT_ENTRY),
               LOSS_LOG=str(tmp_path / "ref.jsonl"))
    assert ref.returncode == 0, ref.stderr[-3000:]
    ckpt = str(tmp_path / "ckpt")
    crashed = _run(torchrun(2, args + ["--save", ckpt, "--load", ckpt], max_restarts=1,
                            entry=FAULT_ENTRY),
                   LOSS_LOG=str(tmp_path / "crash.jsonl"), FAULT_KILL_RANK="1", FAULT_AT_ITER="3")
    assert crashed.returncode == 0, crashed.stderr[-3000:]
    records = _records(tmp_path / "crash.jsonl")
    first = [r["iteration"] for r in records if r["restart"] == "0"]
    second = [r["iteration"] for r in records if r["restart"] == "1"]
    assert first == [1, 2, 3]                      # killed before step 4 of the first attempt
    assert second == [3, 4, 5, 6]                  # resumed from iter_0000002
    assert "loaded checkpoint" in crashed.stderr and "iter_0000002" in crashed.stderr
    reference = logged_losses(tmp_path / "ref.jsonl")
    assert len(reference) == ITERS
    assert logged_losses(tmp_path / "crash.jsonl") == reference          # exact, step for step
    assert read_latest(Path(ckpt)) == "iter_0000006"


@pytest.mark.parametrize("where", ["rank-file", pytest.param("before-latest", marks=pytest.mark.slow)])   # CI budget
def test_crash_inside_save_keeps_previous_checkpoint(corpus, tmp_path, where):
    ckpt = tmp_path / "ckpt"
    args = tiny_cli(corpus, tmp_path / "cache", iters=4, extra=SAVE + ["--save", str(ckpt),
                                                                       "--load", str(ckpt)])
    crashed = _run([sys.executable, str(FAULT_ENTRY), *args], timeout=120,
                   FAULT_SAVE_CRASH=where, FAULT_AT_ITER="4", LOSS_LOG=str(tmp_path / "a.jsonl"))
    assert crashed.returncode == 9, crashed.stderr[-3000:]
    assert read_latest(ckpt) == "iter_0000002"
    partial = ckpt / ("iter_0000004.tmp" if where == "rank-file" else "iter_0000004")
    assert partial.is_dir()
    reader = CheckpointReader(ckpt, verify="all")          # previous checkpoint, every hash checked
    assert reader.metadata["train_state"]["iteration"] == 2
    # relaunch the same command with more iterations: resumes at 2, cleans up, continues the curve
    resumed = _run([sys.executable, str(FAULT_ENTRY), *args, "--train-iters", "6"],
                   timeout=120, LOSS_LOG=str(tmp_path / "b.jsonl"), TORCHELASTIC_RESTART_COUNT="1")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert not list(ckpt.glob("*.tmp"))
    assert read_latest(ckpt) == "iter_0000006"
    reference = _run([sys.executable, str(FAULT_ENTRY),
                      *tiny_cli(corpus, tmp_path / "cache", iters=4), "--train-iters", "6"],
                     timeout=120,
                     LOSS_LOG=str(tmp_path / "ref.jsonl"))
    assert reference.returncode == 0, reference.stderr[-3000:]
    losses = logged_losses(tmp_path / "a.jsonl") | logged_losses(tmp_path / "b.jsonl")
    assert losses == logged_losses(tmp_path / "ref.jsonl")


def test_failing_rank_stops_every_rank_with_its_error(corpus, tmp_path):
    args = tiny_cli(corpus, tmp_path / "cache", iters=50,
                    extra=["--global-batch-size", "4", "--distributed-timeout-minutes", "1"])
    start = time.monotonic()
    proc = _run(torchrun(2, args, entry=FAULT_ENTRY), timeout=150, FAULT_RAISE_RANK="1",
                FAULT_AT_ITER="2")
    elapsed = time.monotonic() - start
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert "RuntimeError: injected failure on rank 1 at iteration 2" in out
    assert elapsed < 60 + 30     # the 1-minute timeout plus start-up, not a hang
    assert "iteration      50/50" not in out
