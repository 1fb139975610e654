"""Preemption is success (launch/torchrun.py, launch/local.sh): SIGTERM or Ctrl-C to the launch
script of a real 2-rank job saves a checkpoint and the command exits 0 with no traceback; a second
Ctrl-C stops every rank at once, saving nothing more (exit 130); a job with bad input exits 2, the
ranks' code, without torchrun's ChildFailedError traceback."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hybrid.processes import child_pids, process_gone
from hybrid.testing.corpus import build_corpus
from hybrid.testing.subprocesses import child_env
from tests.reliability_helpers import FAULT_ENTRY, ROOT, tiny_cli

LOCAL_SH = ROOT / "launch" / "local.sh"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return build_corpus(tmp_path_factory.mktemp("signals_corpus"))


def _launch(args: list[str], log: Path) -> subprocess.Popen:
    """``bash launch/local.sh`` with 2 ranks, in a session of its own (as a terminal would run it)."""
    env = child_env(NPROC="2", PYTHON=sys.executable)
    with open(log, "w") as out:
        return subprocess.Popen(["bash", str(LOCAL_SH), *args], stdout=out, stderr=subprocess.STDOUT,
                                cwd=ROOT, env=env, start_new_session=True)


def _wait_until(predicate, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def _training(log: Path) -> bool:
    return "iteration " in log.read_text()


def _finish(job: subprocess.Popen, seconds: float = 120) -> int:
    try:
        return job.wait(timeout=seconds)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)


def _long_run(corpus, tmp_path) -> tuple[list[str], Path]:
    save = tmp_path / "ckpt"
    return tiny_cli(corpus, tmp_path / "cache", iters=100_000,
                    extra=["--save", str(save), "--log-interval", "1", "--gpus-per-node", "2"]), save


@pytest.mark.parametrize("how", [pytest.param("SIGTERM to the script", marks=pytest.mark.slow),   # CI budget
                                 "Ctrl-C to its process group"])
def test_stop_signal_saves_and_exits_0(corpus, tmp_path, how):
    args, save = _long_run(corpus, tmp_path)
    log = tmp_path / "job.log"
    job = _launch(args, log)
    _wait_until(lambda: _training(log), 180, "training to start")
    if how.startswith("SIGTERM"):
        os.kill(job.pid, signal.SIGTERM)
    else:
        os.killpg(job.pid, signal.SIGINT)
    code = _finish(job)
    text = log.read_text()
    assert code == 0, text[-3000:]
    assert "Traceback" not in text and "error:" not in text, text[-3000:]
    name = "SIGTERM" if how.startswith("SIGTERM") else "SIGINT"
    assert f"stopping: signal {name}; saving a checkpoint" in text, text[-3000:]
    latest = (save / "latest").read_text().strip()
    assert (save / latest / "metadata.json").is_file()


def test_second_ctrl_c_stops_every_rank_at_once(corpus, tmp_path):
    """launch/torchrun.py (what local.sh execs) on the fault entry, whose saves take 30 s: the
    second Ctrl-C lands inside the first save and ends it and the ranks at once."""
    args, save = _long_run(corpus, tmp_path)
    log = tmp_path / "job.log"
    command = [sys.executable, str(ROOT / "launch" / "torchrun.py"), "--standalone",
               "--nproc-per-node", "2", str(FAULT_ENTRY), *args]
    with open(log, "w") as out:
        job = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                               env=child_env(FAULT_SLOW_SAVE="30"), start_new_session=True)
    _wait_until(lambda: _training(log), 180, "training to start")
    ranks = child_pids(job.pid)
    assert len(ranks) == 2
    os.killpg(job.pid, signal.SIGINT)
    _wait_until(lambda: list(save.glob("iter_*.tmp/rank_*")), 60, "the save to be under way")
    os.killpg(job.pid, signal.SIGINT)
    code = _finish(job, 30)
    text = log.read_text()
    assert code == 130, text[-3000:]
    assert all(process_gone(pid) for pid in ranks)
    errors = [line for line in text.splitlines() if line.startswith("error:")]
    assert errors == ["error: interrupted again: every rank stopped at once without saving; the last "
                      "complete checkpoint is unchanged"], text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    assert not (save / "latest").exists(), "the save cut short must not become the latest"
    assert not [p for p in save.glob("iter_*") if not p.name.endswith(".tmp")]


def test_bad_input_exits_2_without_a_traceback(corpus, tmp_path):
    args = tiny_cli(corpus, tmp_path / "cache", extra=["--gpus-per-node", "2",
                                                       "--num-attention-heads", "3"])
    log = tmp_path / "job.log"
    code = _finish(_launch(args, log))
    text = log.read_text()
    assert code == 2, text[-3000:]
    assert "Traceback" not in text and "ChildFailedError" not in text, text[-3000:]
    assert "error: hidden size 16 is not divisible by 3 attention heads" in text, text[-3000:]


def _wrapper():
    spec = importlib.util.spec_from_file_location("launch_torchrun", ROOT / "launch" / "torchrun.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_ranks_code_is_the_commands():
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
    wrapper = _wrapper()

    def failed(*codes):
        return ChildFailedError("pretrain_gpt.py", {rank: ProcessFailure(rank, 100 + rank, code, "")
                                                    for rank, code in enumerate(codes)})
    assert wrapper.ranks_exit_code(failed(-15, 4)) == (4, None)     # the code a rank chose wins
    assert wrapper.ranks_exit_code(failed(2, 2)) == (2, None)
    code, line = wrapper.ranks_exit_code(failed(-9))
    assert code == 128 + signal.SIGKILL
    assert line == "error: rank 0 (pid 100) was killed by signal SIGKILL; the job stopped"
