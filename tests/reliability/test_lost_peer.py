"""Lost peers are named, fast (docs/design.md §10; pretrain/liveness.py).

First the diagnosis in one process, against a real c10d store: alive, lost, failed and already
diagnosed peers. Then four ranks (TP 2 x DP 2) run the real entry point (``launch/pretrain_gpt.py``
through tests/fault_entry.py) joined as torchrun joins them: ``env://`` with the c10d store held by a
separate "agent" process (TORCHELASTIC_USE_AGENT_STORE). Some ranks SIGKILL themselves mid-training
(with the agent, for a lost rendezvous host). Every survivor must exit with code 4 well within
--distributed-timeout-minutes, with exactly one ``error:`` line naming exactly the killed ranks and
their host. The ranks are forked from the test process, which has imported torch already: four
interpreters importing torch at once took 15-20 s of this 2-core machine.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import runpy
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

# what the ranks run, imported before they fork so that each starts in a fraction of a second
import pretrain.setup  # noqa: F401
import models.gpt.model  # noqa: F401
import tests.fault_entry  # noqa: F401
from hybrid.testing.corpus import build_corpus
from hybrid.testing.multirank import free_port
from pretrain.liveness import Liveness, Peer, PeersLostError, is_distributed_error
from tests.reliability_helpers import FAULT_ENTRY, tiny_cli

WORLD = 4
TIMEOUT_MIN = 0.25       # --distributed-timeout-minutes: 15 s, a 1 s heartbeat
EXIT_LOST = 4            # launch/pretrain_gpt.py's exit code for lost peers


# ---- the diagnosis in one process ------------------------------------------------------------
BEAT = 0.1      # heartbeat interval of the in-process tests: a 0.3 s window


@pytest.fixture
def store_port():
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    yield port
    del server


def _client(port: int):
    return dist.PrefixStore("hybrid-liveness/0", dist.TCPStore(
        "127.0.0.1", port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=5)))


def _rank(port: int, rank: int, world: int = 3) -> Liveness:
    """Rank ``rank`` on host A (ranks 0, 1) or B (2, 3), beating every BEAT s."""
    host = "AB"[rank // 2]
    peer = Peer(rank, f"host{host}", f"10.0.0.{rank // 2 + 1}", os.getpid())   # all alive
    return Liveness(_client(port), peer, world, BEAT, ("127.0.0.1", port), True).begin()


def _die(live: Liveness) -> None:
    """SIGKILL, as the store sees it: the beats stop, no exit record."""
    live._stop.set()
    live._thread.join()


def test_heartbeat_moves_and_stops_with_an_exit_record(store_port):
    live, reader = _rank(store_port, 0, world=2), _client(store_port)
    first = reader.get("beat/0")
    time.sleep(3 * BEAT)
    assert reader.get("beat/0") != first
    live.close()
    assert not live._thread.is_alive()
    record = reader.get("beat/0").decode()
    assert record.startswith("exit ") and json.loads(record[5:])["kind"] == "done"


def test_lost_rank_is_named_and_a_late_noticer_does_not_wait_again(store_port):
    ranks = [_rank(store_port, r) for r in range(3)]
    time.sleep(2 * BEAT)     # the directory is read
    _die(ranks[2])
    start = time.monotonic()
    verdict = ranks[0].diagnose()
    assert time.monotonic() - start >= ranks[0].window   # a fresh beat: watched for a window
    assert re.fullmatch(r"lost contact with rank 2 on host hostB \(10\.0\.0\.2\): "
                        r"no heartbeat for 0\.[3-9] s", verdict), verdict
    ranks[0].close(PeersLostError(verdict))
    start = time.monotonic()
    late = ranks[1].diagnose()           # rank 0 left having watched rank 2's beat stand still
    assert time.monotonic() - start < ranks[1].window / 2
    assert late.startswith("lost contact with rank 2 on host hostB (10.0.0.2): no heartbeat")
    ranks[1].close()


def test_dead_process_on_this_host_is_lost_at_once(store_port):
    gone = subprocess.Popen(["true"])
    gone.wait()
    me = Peer(0, "hostA", "10.0.0.1", os.getpid())
    live = Liveness(_client(store_port), me, 2, BEAT, ("127.0.0.1", store_port), True).begin()
    _client(store_port).set("info/1", json.dumps({"rank": 1, "host": "hostA", "addr": "10.0.0.1",
                                                  "pid": gone.pid}))
    _client(store_port).set("beat/1", f"{time.time():.3f}")
    time.sleep(BEAT)     # the directory is read
    start = time.monotonic()
    assert live.diagnose().startswith("lost contact with rank 1 on host hostA (10.0.0.1)")
    assert time.monotonic() - start < live.window / 2
    live.close()


def test_long_silent_host_is_lost_at_once(store_port):
    """A host that vanished without closing its sockets: noticed when the collective times out,
    by then its beat is far older than 20 intervals."""
    live = _rank(store_port, 0, world=2)
    _client(store_port).set("beat/1", f"{time.time() - 25 * BEAT:.3f}")
    start = time.monotonic()
    assert live.diagnose().startswith("lost contact with rank 1 on host unknown (address unknown): "
                                      "no heartbeat for 2.")
    assert time.monotonic() - start < live.window / 2
    live.close()


def test_failed_rank_is_quoted_and_alive_ranks_are_not_blamed(store_port):
    ranks = [_rank(store_port, r) for r in range(3)]
    assert ranks[0].diagnose() is None               # everyone beats
    ranks[2].close(ValueError("bad shard iter_0000002/rank2.safetensors"))
    assert ranks[0].diagnose() == ("rank 2 on host hostB (10.0.0.2) failed: ValueError: bad shard "
                                   "iter_0000002/rank2.safetensors")
    for live in ranks[:2]:
        live.close()


def test_only_distributed_errors_are_diagnosed(store_port):
    live = _rank(store_port, 0, world=2)             # rank 1 never starts: it would be "lost"
    gloo = RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [10.0.0.2]:4137")
    assert is_distributed_error(gloo) and is_distributed_error(dist.DistNetworkError("x"))
    for bug in (ValueError("hidden size 1000 is not divisible by 16 heads"),
                RuntimeError("mat1 and mat2 shapes cannot be multiplied (2x3 and 4x5)")):
        assert not is_distributed_error(bug)
        live.check(bug, "restart")                   # returns at once: the caller re-raises
    handler = signal.getsignal(signal.SIGTERM)
    with pytest.raises(PeersLostError, match=r"^lost contact with rank 1 on host unknown .*: no "
                                             r"heartbeat; exiting \(restart\)$"):
        live.check(gloo, "restart")
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN   # the report is not cut short
    live.close()
    assert signal.getsignal(signal.SIGTERM) == handler


# ---- four ranks of the real entry point ----------------------------------------------------
@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return build_corpus(tmp_path_factory.mktemp("lost_peer_corpus"))


def _hold_store(port: int) -> None:
    """torchrun's agent, as far as the ranks can tell: it holds the job's c10d store."""
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    while store:
        time.sleep(60)


def _rank_main(rank: int, port: int, args: list[str], log: str, env: dict[str, str]) -> None:
    """One rank: torchrun's environment, output to ``log``, then the fault entry as a script."""
    out = open(log, "w", buffering=1)
    os.dup2(out.fileno(), 1)
    os.dup2(out.fileno(), 2)    # gloo's own messages too
    sys.stdout = sys.stderr = out
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD),
                      LOCAL_WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      TORCHELASTIC_USE_AGENT_STORE="True", OMP_NUM_THREADS="1", **env)
    sys.argv = [str(FAULT_ENTRY), *args]
    runpy.run_path(str(FAULT_ENTRY), run_name="__main__")   # SystemExit carries the exit code


def _run_job(args: list[str], tmp: Path, env: dict[str, str], *, kill_store_with: list[int] = (),
             deadline_s: float = 60):
    """Start the store and the ranks; SIGKILL the store once the ranks ``kill_store_with`` are
    dead. Returns ({rank: (exit code, monotonic time of exit)}, {rank: log text})."""
    ctx = multiprocessing.get_context("fork")
    port = free_port()
    agent = ctx.Process(target=_hold_store, args=(port,))
    agent.start()
    procs = [ctx.Process(target=_rank_main, args=(r, port, args, str(tmp / f"rank{r}.log"), env))
             for r in range(WORLD)]
    for p in procs:
        p.start()
    ended, deadline = {}, time.monotonic() + deadline_s
    try:
        while len(ended) < WORLD and time.monotonic() < deadline:
            for r, p in enumerate(procs):
                if r not in ended and p.exitcode is not None:
                    ended[r] = (p.exitcode, time.monotonic())
            if kill_store_with and agent.exitcode is None and set(kill_store_with) <= set(ended):
                os.kill(agent.pid, signal.SIGKILL)
            time.sleep(0.02)
    finally:
        for p in [*procs, agent]:
            if p.exitcode is None:
                os.kill(p.pid, signal.SIGKILL)
            p.join(timeout=10)
    return ended, {r: (tmp / f"rank{r}.log").read_text() for r in range(WORLD)}


def _error_lines(log: str) -> list[str]:
    return [line for line in log.splitlines() if line.startswith("error:")]


LOST = r"lost contact with ranks 2,3 on host {host} \(127\.0\.0\.1\): no heartbeat for [\d.]+ s"
STORE_LOST = (r"lost contact with the rendezvous store at 127\.0\.0\.1:\d+ \(it does not answer; "
              r"torchrun's agent on this host held it\)")


@pytest.mark.parametrize("killed, with_store, expected", [("2,3", False, LOST),
                                                          ("0,1", True, STORE_LOST)],
                         ids=["ranks", "rendezvous-host"])
def test_killed_ranks_are_named_by_every_survivor(corpus, tmp_path, killed, with_store, expected):
    save = tmp_path / "ckpt"
    args = tiny_cli(corpus, tmp_path / "cache", iters=200,
                    extra=["--tensor-model-parallel-size", "2", "--global-batch-size", "4",
                           "--save", str(save), "--load", str(save), "--save-interval", "2",
                           "--gpus-per-node", "4",
                           "--distributed-timeout-minutes", str(TIMEOUT_MIN)])
    dead = [int(r) for r in killed.split(",")]
    ended, logs = _run_job(args, tmp_path, {"FAULT_KILL_RANK": killed, "FAULT_AT_ITER": "3"},
                           kill_store_with=dead if with_store else ())
    survivors = [r for r in range(WORLD) if r not in dead]
    assert sorted(ended) == list(range(WORLD)), f"ranks {set(range(WORLD)) - set(ended)} hung"
    assert all(ended[r][0] == -signal.SIGKILL for r in dead), ended
    killed_at = max(ended[r][1] for r in dead)
    line = re.compile("error: " + expected.format(host=re.escape(socket.gethostname()))
                      + r"; exiting \(restart the job to resume from "
                      + re.escape(str(save / "iter_0000002")) + r"\)")
    for r in survivors:
        code, when = ended[r]
        errors = _error_lines(logs[r])
        assert code == EXIT_LOST, f"rank {r} exited with {code}:\n{logs[r][-3000:]}"
        assert len(errors) == 1 and line.fullmatch(errors[0]), f"rank {r}: {errors}\n{logs[r][-3000:]}"
        assert when - killed_at < TIMEOUT_MIN * 60, f"rank {r} took {when - killed_at:.1f} s"
        print(f"rank {r} exited {when - killed_at:.1f} s after the kill: {errors[0]}")


def test_failing_rank_is_named_with_its_error(corpus, tmp_path):
    """A rank that raises (a bug, bad data) leaves its error in the store; the others quote it."""
    args = tiny_cli(corpus, tmp_path / "cache", iters=200,
                    extra=["--tensor-model-parallel-size", "2", "--global-batch-size", "4",
                           "--gpus-per-node", "4", "--distributed-timeout-minutes", str(TIMEOUT_MIN)])
    ended, logs = _run_job(args, tmp_path, {"FAULT_RAISE_RANK": "1", "FAULT_AT_ITER": "2"},
                           deadline_s=60)
    assert sorted(ended) == list(range(WORLD))
    assert ended[1][0] == 1 and "RuntimeError: injected failure on rank 1 at iteration 2" in logs[1]
    expected = (f"error: rank 1 on host {socket.gethostname()} (127.0.0.1) failed: RuntimeError: "
                f"injected failure on rank 1 at iteration 2; exiting (restart the job; no "
                f"checkpoint was written yet, so it starts again from iteration 0)")
    for r in (0, 2, 3):
        assert ended[r][0] == EXIT_LOST, f"rank {r}:\n{logs[r][-3000:]}"
        assert _error_lines(logs[r]) == [expected], logs[r][-3000:]
