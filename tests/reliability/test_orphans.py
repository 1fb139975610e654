"""No orphan ranks (pretrain/liveness.py): ``kill -9`` of the torchrun agent of a real job
must stop every rank within the stated bound, each with one line saying why, and no checkpoint may
be written after the kill (today's ranks would go on training and saving unsupervised)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from hybrid.processes import child_pids, process_gone
from hybrid.testing.corpus import build_corpus
from hybrid.testing.subprocesses import child_env
from pretrain.liveness import LAUNCHER_CHECK
from tests.reliability_helpers import ROOT, tiny_cli, torchrun

SLACK = 1.0        # seconds a loaded 2-core machine may add to the detection bound
GONE_WITHIN = 10   # seconds from the kill until every rank process must have ended


def _wait_for(predicate, seconds: float, what: str):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _written_at(save: Path) -> dict[str, float]:
    """Modification time of every file and directory of the checkpoint tree."""
    return {str(p): p.stat().st_mtime for p in [save, *save.rglob("*")] if p.exists()}


@pytest.fixture
def corpus(tmp_path):
    return build_corpus(tmp_path / "corpus")


def test_killing_the_agent_stops_every_rank_without_saving_again(corpus, tmp_path):
    save = tmp_path / "ckpt"
    args = tiny_cli(corpus, tmp_path / "cache", iters=100_000,
                    extra=["--save", str(save), "--save-interval", "5", "--log-interval", "50",
                           "--gpus-per-node", "2"])
    log = tmp_path / "job.log"
    with open(log, "w") as out:
        agent = subprocess.Popen(torchrun(2, args), stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                                 env=child_env(), start_new_session=True)
    ranks: list[int] = []
    try:
        ranks = _wait_for(lambda: len(child_pids(agent.pid)) == 2 and child_pids(agent.pid), 120,
                          "two ranks")
        _wait_for(lambda: (save / "latest").is_file(), 120, "a first checkpoint")
        time.sleep(1.0)                  # training and saving every 5 iterations
        agent.send_signal(signal.SIGKILL)
        killed_at = time.time()
        agent.wait()
        _wait_for(lambda: all(process_gone(pid) for pid in ranks), GONE_WITHIN,
                  f"every rank to end within {GONE_WITHIN} s of the kill")
        gone_after = time.time() - killed_at
    finally:
        for pid in ranks:
            if not process_gone(pid):
                os.kill(pid, signal.SIGKILL)
    text = log.read_text()
    lines = [line for line in text.splitlines() if line.startswith("error:")]
    assert len(lines) == 2, text[-3000:]
    # Each rank names the newest checkpoint it finds; a rank that stops while rank 0 finishes
    # the save in flight at the kill names the one before it, which must still be on disk.
    latest = save / (save / "latest").read_text().strip()
    head = (f"error: lost the launcher: torchrun's agent (pid {agent.pid}) is gone, so nobody "
            f"supervises this rank; it stops without saving; exiting (restart with --load {save} "
            f"to resume from ")
    assert all(line.startswith(head) and line.endswith(")") for line in lines), text[-3000:]
    named = sorted(save / line[len(head):-1] for line in lines)
    assert named[-1] == latest, text[-3000:]
    assert all(p.is_dir() and p.parent == save and not p.name.endswith(".tmp")
               for p in named), named
    assert "Traceback" not in text, text[-3000:]
    late = {p: t - killed_at for p, t in _written_at(save).items()
            if t > killed_at + LAUNCHER_CHECK + SLACK}
    assert not late, f"written after the kill (seconds): {late}"
    print(f"every rank ended {gone_after:.2f} s after the agent was killed")
