"""A real two-host run (docs/design.md §2, §8, §10): two network namespaces joined by a veth pair
(10.213.<n>.1 and .2, traffic only between them), two CPU ranks each, started on each "host" with
``launch/multinode.sh`` (torchrun c10d rendezvous on 10.213.<n>.1). TP 2 lives inside a host, DP 2
crosses the veth link.

1. both hosts train and checkpoint; 2. host B is killed (SIGKILL to its torchrun and ranks) while
training: each of host A's ranks exits on its own within --distributed-timeout-minutes with one
``error:`` line naming host B's ranks, hostname and address and the checkpoint to resume from
(hybrid/training/liveness.py); 3. relaunching both hosts resumes from the latest checkpoint;
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
from tests.reliability_helpers import ROOT, build_corpus, child_env, tiny_cli

pytestmark = pytest.mark.slow
TIMEOUT_MIN = 0.5        # --distributed-timeout-minutes of the kill phase


def _sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), capture_output=True, text=True, check=check, timeout=30)


class TwoHosts:
    """Namespaces ``hyb<pid>a``/``hyb<pid>b`` with a veth pair and loopback, removed on exit."""

    def __init__(self):
        tag = os.getpid() % 10000
        self.ns = (f"hyb{tag}a", f"hyb{tag}b")
        self.dev = (f"vh{tag}a", f"vh{tag}b")
        self.addr = (f"10.213.{tag % 250}.1", f"10.213.{tag % 250}.2")

    def __enter__(self) -> "TwoHosts":
        try:
            for ns in self.ns:
                _sh("ip", "netns", "add", ns)
            _sh("ip", "link", "add", self.dev[0], "type", "veth", "peer", "name", self.dev[1])
            for ns, dev, addr in zip(self.ns, self.dev, self.addr):
                _sh("ip", "link", "set", dev, "netns", ns)
                _sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
                _sh("ip", "-n", ns, "link", "set", dev, "up")
                _sh("ip", "-n", ns, "link", "set", "lo", "up")
        except (OSError, subprocess.CalledProcessError) as err:
            self.__exit__()
            detail = getattr(err, "stderr", "") or str(err)
            pytest.skip(f"cannot create network namespaces here ({detail.strip()}); needs root and "
                        f"iproute2 with netns support")
        return self

    def __exit__(self, *exc) -> None:
        for host in (0, 1):
            self.kill_host(host)
        for ns in self.ns:
            _sh("ip", "netns", "del", ns, check=False)   # also removes the veth pair

    def kill_host(self, host: int) -> None:
        """SIGKILL every process of the host (torchrun puts ranks in sessions of their own, so a
        process group is not enough)."""
        pids = _sh("ip", "netns", "pids", self.ns[host], check=False).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass

    def ranks_on(self, host: int) -> list[int]:
        """The global ranks running in namespace ``host`` (from the RANK torchrun gave each)."""
        ranks = []
        for pid in _sh("ip", "netns", "pids", self.ns[host]).stdout.split():
            try:
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            ranks += [int(v[5:]) for v in environ if v.startswith(b"RANK=")]
        return sorted(ranks)

    def launch(self, host: int, args: list[str], log: Path, job: str) -> subprocess.Popen:
        """``launch/multinode.sh`` inside namespace ``host`` (0 = A, the rendezvous host)."""
        env = child_env(NNODES="2", NPROC="2", MASTER=f"{self.addr[0]}:29517", JOB_ID=job,
                        GLOO_SOCKET_IFNAME=self.dev[host], TORCH_ELASTIC_SHUTDOWN_TIMEOUT="5",
                        RDZV_IS_HOST="1" if host == 0 else "0", LOCAL_ADDR=self.addr[host],
                        PYTHON=sys.executable)
        cmd = ["ip", "netns", "exec", self.ns[host], "bash", "launch/multinode.sh", *args]
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=open(log, "w"),
                                stderr=subprocess.STDOUT, start_new_session=True)


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
