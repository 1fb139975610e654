"""A real two-host run (docs/design.md §2, §8, §10): two network namespaces joined through a bridge
(tools/netns_cluster.py: 10.214.<n>.1 and .2), two CPU ranks each, started on each "host" with
``launch/multinode.sh`` (torchrun c10d rendezvous on host A). TP 2 lives inside a host, DP 2
crosses the veth link.

1. both hosts train and checkpoint; 2. host B is killed (SIGKILL to its torchrun and ranks) while
training: each of host A's ranks exits on its own within --distributed-timeout-minutes with one
``error:`` line naming host B's ranks, hostname and address and the checkpoint to resume from
(pretrain/liveness.py); 3. relaunching both hosts resumes from the latest checkpoint;
4. host A, which holds the rendezvous store, is killed: host B's ranks name host A's ranks and
address as the lost rendezvous host.
Skips (saying why) where namespaces cannot be created; namespaces are always removed."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hybrid.checkpoint import read_latest
from hybrid.testing.corpus import build_corpus
from hybrid.testing.subprocesses import child_env
from tests.reliability_helpers import tiny_cli
from tools.netns_cluster import NetnsCluster, NetnsUnavailable

pytestmark = pytest.mark.slow
TIMEOUT_MIN = 0.5        # --distributed-timeout-minutes of the kill phase


class TwoHosts(NetnsCluster):
    """Two hosts of two ranks, unshaped (tools/netns_cluster.py); skips where namespaces cannot
    be made."""

    def __init__(self):
        super().__init__(hosts=2, ranks_per_host=2)

    def __enter__(self) -> "TwoHosts":
        try:
            return super().__enter__()
        except NetnsUnavailable as err:
            pytest.skip(str(err))

    def launch(self, host: int, args: list[str], log: Path, job: str) -> subprocess.Popen:
        return super().launch(host, args, log, job, env=child_env(PYTHON=sys.executable))


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)


def _wait_all(procs: list[subprocess.Popen], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    try:
        return [p.wait(timeout=max(1.0, deadline - time.monotonic())) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                _kill(p)


def _wait_for_checkpoint(save: Path, procs, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        latest = read_latest(save)
        if latest:
            return latest
        if any(p.poll() is not None for p in procs):
            break
        time.sleep(0.2)
    raise AssertionError("no checkpoint appeared")


def test_two_hosts_train_checkpoint_survive_a_lost_host_and_resume(tmp_path):
    corpus = build_corpus(tmp_path / "corpus")
    save = tmp_path / "ckpt"
    base = tiny_cli(corpus, tmp_path / "cache", iters=3000,
                    extra=["--tensor-model-parallel-size", "2", "--global-batch-size", "4",
                           "--save", str(save), "--load", str(save), "--save-interval", "5",
                           "--distributed-timeout-minutes", str(TIMEOUT_MIN)])
    with TwoHosts() as hosts:
        # 1. both hosts train 6 steps and checkpoint
        procs = [hosts.launch(h, base + ["--train-iters", "6"], tmp_path / f"p1_{h}.log", "j1")
                 for h in (0, 1)]
        assert _wait_all(procs, 240) == [0, 0], (tmp_path / "p1_0.log").read_text()[-3000:]
        log_a = (tmp_path / "p1_0.log").read_text()
        assert "2 ranks per node" in log_a or "2 node(s) x 2" in log_a
        assert read_latest(save) == "iter_0000006"
        # 2. long run; host B dies after the next checkpoint: host A must exit by itself, fast
        procs = [hosts.launch(h, base, tmp_path / f"p2_{h}.log", "j2") for h in (0, 1)]
        _wait_for_checkpoint_after(save, "iter_0000006", procs, 240)
        waited, lines, ranks_b, code = _kill_and_watch(hosts, procs, dead=1, log=tmp_path / "p2_0.log")
        resume_from = int(read_latest(save).split("_")[1])
        expected = (f"error: lost contact with ranks {ranks_b} on host {socket.gethostname()} "
                    f"({hosts.addr[1]}): no heartbeat for ([0-9.]+) s; exiting (restart the job to "
                    f"resume from {save / read_latest(save)})")
        _assert_lines(lines, expected)
        # the launcher passes the ranks' lost-peer code on (launch/torchrun.py), with no traceback
        assert code == 4 and "Traceback" not in (tmp_path / "p2_0.log").read_text()
        # 3. relaunch both: resume from the latest checkpoint and finish 4 more steps
        target = str(resume_from + 4)
        procs = [hosts.launch(h, base + ["--train-iters", target], tmp_path / f"p3_{h}.log", "j3")
                 for h in (0, 1)]
        assert _wait_all(procs, 240) == [0, 0], (tmp_path / "p3_0.log").read_text()[-3000:]
        log_a = (tmp_path / "p3_0.log").read_text()
        assert f"(iteration {resume_from}," in log_a
        assert read_latest(save) == f"iter_{int(target):07d}"
        # 4. long run again; host A, which holds the rendezvous store, dies: host B names it
        procs = [hosts.launch(h, base, tmp_path / f"p4_{h}.log", "j4") for h in (0, 1)]
        _wait_for_checkpoint_after(save, read_latest(save), procs, 240)
        waited_b, lines, ranks_a, _ = _kill_and_watch(hosts, procs, dead=0, log=tmp_path / "p4_1.log")
        # host B's launcher lost the store too and says so in a line of its own (launch/torchrun.py)
        agent = [line for line in lines if line.startswith("error: torchrun's agent stopped")]
        assert len(agent) <= 1, agent
        lines = [line for line in lines if line not in agent]
        expected = (f"error: lost contact with ranks {ranks_a} on host {socket.gethostname()} "
                    f"({hosts.addr[0]}), which held the rendezvous store: {hosts.addr[0]}:"
                    f"([0-9]+) does not answer; exiting (restart the job to resume from "
                    f"{save / read_latest(save)})")
        _assert_lines(lines, expected)
    print(f"host B lost: host A exited after {waited:.1f} s; resumed at iteration {resume_from}; "
          f"host A lost: host B exited after {waited_b:.1f} s")


def _kill_and_watch(hosts: TwoHosts, procs, dead: int,
                    log: Path) -> tuple[float, list[str], str, int]:
    """SIGKILL host ``dead``; the other host's launcher must exit non-zero by itself within the
    timeout. Returns the seconds it took, its ``error:`` lines, the lost ranks ("2,3") and its
    exit code."""
    lost = hosts.ranks_on(dead)
    assert len(lost) == 2, lost
    hosts.kill_host(dead)
    procs[dead].wait(timeout=30)
    killed_at = time.monotonic()
    code = _wait_all(procs[1 - dead:2 - dead], TIMEOUT_MIN * 60 + 60)[0]
    waited = time.monotonic() - killed_at
    text = log.read_text()
    assert code != 0, text[-3000:]
    assert waited < TIMEOUT_MIN * 60, f"the surviving host took {waited:.0f} s to exit"
    return waited, [line for line in text.splitlines() if line.startswith("error:")], \
        ",".join(map(str, lost)), code


def _assert_lines(lines: list[str], expected: str) -> None:
    """One line per surviving rank (two), each the expected message (a regex after escaping,
    with ``([0-9.]+)`` groups kept)."""
    pattern = re.escape(expected).replace(re.escape("([0-9.]+)"), "([0-9.]+)").replace(
        re.escape("([0-9]+)"), "([0-9]+)")
    assert len(lines) == 2 and all(re.fullmatch(pattern, line) for line in lines), \
        f"expected twice: {expected}\ngot: {lines}"


def _wait_for_checkpoint_after(save: Path, previous: str, procs, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        latest = read_latest(save)
        if latest and latest > previous:
            return
        assert all(p.poll() is None for p in procs), "a host exited before its first checkpoint"
        time.sleep(0.1)
    raise AssertionError(f"no checkpoint after {previous} within {timeout} s")
