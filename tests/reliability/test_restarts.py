"""In-job restart (``--max-restarts``, pretrain/restarts.py) and a kill -9 during an asynchronous
checkpoint write (``--async-save``), with real torchrun jobs (issue 34 parts 1 and 5).

* 4 ranks, rank 2 SIGKILLed before iteration 6 with ``--max-restarts 1`` and only ``--save`` (no
  ``--load``): torchrun restarts the ranks, the job resumes by itself from iter_0000003, finishes,
  and every iteration's loss equals an uninterrupted run's; the restart counter and the lost
  iterations (5 - 3 = 2) are logged.
* a failure before the first checkpoint: the restarted job starts again from iteration 0 under the
  same run id and ends with the uninterrupted run's losses.
* ``--async-save`` with a slowed writer: a rank is killed while iteration 4's checkpoint is being
  written in the background; ``latest`` still names iter_0000002, the restart resumes there and the
  loss curve continues exactly.
The launcher's side (launch/torchrun.py passing the trainer's --max-restarts to torchrun) is
checked without processes at the end.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
from pathlib import Path

import pytest

from hybrid.checkpoint import read_latest
from hybrid.checkpoint.writer import checkpoint_run_id
from hybrid.testing.corpus import build_corpus
from tests.reliability_helpers import (FAULT_ENTRY, ROOT, logged_losses, run_command, tiny_cli,
                                    torchrun)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return build_corpus(tmp_path_factory.mktemp("restart_corpus"))


def _run(cmd: list[str], timeout: float = 400, **env) -> subprocess.CompletedProcess:
    return run_command(cmd, timeout, **env)


def _attempts(log: Path) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for line in log.read_text().splitlines():
        rec = json.loads(line)
        out.setdefault(rec["restart"], []).append(rec["iteration"])
    return out


def _reference(corpus, tmp_path: Path, nproc: int, args: list[str]) -> dict[int, str]:
    ref = _run(torchrun(nproc, args + ["--save", str(tmp_path / "ref")], entry=FAULT_ENTRY),
               LOSS_LOG=str(tmp_path / "ref.jsonl"))
    assert ref.returncode == 0, ref.stderr[-3000:]
    return logged_losses(tmp_path / "ref.jsonl")


@pytest.mark.slow   # two 4-rank torchrun jobs: ~1-2 minutes on 2 shared cores
def test_four_ranks_rank2_killed_resumes_by_itself_and_matches(corpus, tmp_path):
    args = tiny_cli(corpus, tmp_path / "cache", iters=8,
                    extra=["--save-interval", "3", "--global-batch-size", "8"])
    reference = _reference(corpus, tmp_path, 4, args)
    ckpt = tmp_path / "ckpt"
    job = _run(torchrun(4, args + ["--save", str(ckpt), "--max-restarts", "1"], max_restarts=1,
                        entry=FAULT_ENTRY),
               LOSS_LOG=str(tmp_path / "job.jsonl"), FAULT_KILL_RANK="2", FAULT_AT_ITER="5")
    assert job.returncode == 0, job.stderr[-3000:]
    assert _attempts(tmp_path / "job.jsonl") == {"0": [1, 2, 3, 4, 5], "1": [4, 5, 6, 7, 8]}
    assert logged_losses(tmp_path / "job.jsonl") == reference                # exact, step for step
    assert "in-job restart 1 of at most 1" in job.stderr and "resumed from iteration 3" in job.stderr
    assert "in-job restarts: 1 of at most 1; iterations lost to failures (done again): 2" in job.stderr
    assert read_latest(ckpt) == "iter_0000008"
    record = json.loads((ckpt / "restarts.json").read_text())
    assert record["run_id"] == checkpoint_run_id(ckpt / "iter_0000008")
    assert (record["restarts"], record["lost_iterations"]) == (1, 2)


@pytest.mark.slow
def test_failure_before_the_first_checkpoint_starts_again(corpus, tmp_path):
    args = tiny_cli(corpus, tmp_path / "cache", iters=4,
                    extra=["--save-interval", "3", "--global-batch-size", "4"])
    reference = _reference(corpus, tmp_path, 2, args)
    ckpt = tmp_path / "ckpt"
    job = _run(torchrun(2, args + ["--save", str(ckpt), "--max-restarts", "1"], max_restarts=1,
                        entry=FAULT_ENTRY),
               LOSS_LOG=str(tmp_path / "job.jsonl"), FAULT_KILL_RANK="1", FAULT_AT_ITER="2")
    assert job.returncode == 0, job.stderr[-3000:]
    assert _attempts(tmp_path / "job.jsonl") == {"0": [1, 2], "1": [1, 2, 3, 4]}
    assert logged_losses(tmp_path / "job.jsonl") == reference
    assert "no checkpoint of this run yet: started again from iteration 0" in job.stderr
    assert "iterations lost to failures (done again): 2" in job.stderr


@pytest.mark.slow
def test_kill9_during_async_write_resumes_from_previous_checkpoint(corpus, tmp_path):
    args = tiny_cli(corpus, tmp_path / "cache", iters=6,
                    extra=["--save-interval", "2", "--global-batch-size", "4", "--async-save"])
    reference = _reference(corpus, tmp_path, 2, args)
    ckpt = tmp_path / "ckpt"
    job = _run(torchrun(2, args + ["--save", str(ckpt), "--max-restarts", "1"], max_restarts=1,
                        entry=FAULT_ENTRY),
               LOSS_LOG=str(tmp_path / "job.jsonl"), FAULT_KILL_RANK="1", FAULT_AT_ITER="5",
               FAULT_SLOW_SAVE="2")
    assert job.returncode == 0, job.stderr[-3000:]
    # killed before step 6 while iteration 4's write slept: iteration 2 was the latest
    assert _attempts(tmp_path / "job.jsonl") == {"0": [1, 2, 3, 4, 5], "1": [3, 4, 5, 6]}
    assert "resumed from iteration 2" in job.stderr
    assert logged_losses(tmp_path / "job.jsonl") == reference
    assert read_latest(ckpt) == "iter_0000006"
    assert not list(ckpt.glob("*.tmp"))


def _launcher():
    spec = importlib.util.spec_from_file_location("torchrun_launcher", ROOT / "launch" / "torchrun.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_launcher_passes_the_trainers_max_restarts_to_torchrun():
    launcher = _launcher()
    argv = ["--standalone", "--nproc-per-node", "4", "launch/pretrain_gpt.py", "--max-restarts", "2"]
    assert launcher.with_trainer_restarts(argv) == ["--max-restarts", "2", *argv]
    same = ["--max-restarts=2", "launch/pretrain_gpt.py", "--max-restarts", "2"]
    assert launcher.with_trainer_restarts(same) == same
    plain = ["--standalone", "launch/pretrain_gpt.py", "--train-iters", "3"]
    assert launcher.with_trainer_restarts(plain) == plain
    with pytest.raises(ValueError, match="disagree"):
        launcher.with_trainer_restarts(["--max-restarts", "1", "launch/pretrain_gpt.py",
                                        "--max-restarts", "3"])


def test_max_restarts_without_the_launchers_restarts_is_one_clear_error(monkeypatch):
    from hybrid.launch_env import LaunchEnv
    from pretrain.arguments import parse_args
    from pretrain.restarts import plan_restart
    cfg, _ = parse_args(["--max-restarts", "1", "--save", "/tmp/unused"])
    monkeypatch.delenv("TORCHELASTIC_MAX_RESTARTS", raising=False)
    with pytest.raises(ValueError, match="launch/torchrun.py"):
        plan_restart(cfg, LaunchEnv.from_environ(), 0)
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "1")
    cfg, _ = parse_args(["--max-restarts", "1"])
    with pytest.raises(ValueError, match="--save"):
        plan_restart(cfg, LaunchEnv.from_environ(), 0)
