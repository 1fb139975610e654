"""Naming the lost peer when a job loses ranks (docs/design.md §10).

gloo reports a dead peer as ``Connection closed by peer [10.213.7.2]:41373`` (or, when a host vanished
without closing its sockets, as a timeout): an address and a port, never a rank or a host. This module
turns such a failure into one line a user can act on:

    lost contact with ranks 2,3 on host hostB (10.213.7.2): no heartbeat for 4.6 s

How. At start-up every rank writes ``info/<rank>`` (hostname, address, pid) to the c10d store the job
already has (torchrun's agent store, or rank 0's under plain ``env://``), and a daemon thread rewrites
``beat/<rank>`` with its wall-clock time every ``interval`` seconds: store writes only, no collective,
nothing on the training thread. A rank that leaves overwrites its beat with an exit record (done,
failed with its error, or lost contact, with the beats it found stale). When a collective fails,
:meth:`Liveness.check` watches the others' beats for up to ``window`` seconds: a rank whose beat moves
is alive, one with an exit record has left (a ``failed`` one is the error to report), and the rest are
lost. No waiting where the answer is certain: a rank on this host whose process is gone is lost at
once, and so is a beat another rank already watched stand still for a whole window (a rank that notices
late, having waited on a peer that was itself diagnosing, does not wait again), and a beat 20 intervals
old (a host that vanished without closing its sockets, noticed when the collective timed out).
Clocks of different hosts are only compared for that last case and for the "no heartbeat for" figure.
If the store itself does not answer, the ranks of the host that held it are the lost ones.

The interval is 1/20 of the process-group timeout (1 to 5 s) and the window three intervals, so the
diagnosis ends well within ``--distributed-timeout-minutes``.

No orphan ranks. A rank whose launcher is gone (torchrun's agent killed: this process's parent
changes) or whose store stops answering is not supervised any more: nobody would restart it, stop
it or collect its exit code, and it would go on training and writing checkpoints. The heartbeat
thread checks the parent every :data:`LAUNCHER_CHECK` seconds and the store at every beat; on a loss
it prints one ``error:`` line saying which and ends the process at once (``os._exit``, exit code 4),
from wherever the training thread is: nothing is written after that point (a save cut short leaves
only its ``iter_N.tmp`` directory, which no load reads). Bounds: a lost launcher within
:data:`LAUNCHER_CHECK` (0.2 s); a lost store within one interval plus the store client's timeout of
one window (at most 5 + 15 s). A collective failing at the same time is diagnosed by
:meth:`Liveness.check` instead; the process reports once either way.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import threading
import time
from dataclasses import asdict, dataclass
from datetime import timedelta

import torch.distributed as dist

from hybrid.launch_env import LaunchEnv
from hybrid.processes import process_gone

log = logging.getLogger(__name__)

BEATS_PER_WINDOW = 3
LAUNCHER_CHECK = 0.2   # seconds between checks that this rank's launcher (its parent) is alive
EXIT_LOST = 4          # the entry point's exit code for lost peers, launcher or store
SILENT_BEATS = 20   # a beat this many intervals old is lost without watching it (clock skew allowed)
EXIT = "exit "      # prefix of an exit record in beat/<rank>; a beat is a bare timestamp
NEVER = "never"     # what beat/<rank> reads as for a rank that never started beating
# Words in the messages of gloo, NCCL and c10d store failures (gloo raises a plain RuntimeError).
_DISTRIBUTED_WORDS = ("gloo", "nccl", "connection", "timed out", "socket", "store", "broken pipe")


class PeersLostError(RuntimeError):
    """A collective failed because other ranks are gone; the message names them and their host."""


@dataclass(frozen=True)
class Peer:
    rank: int
    host: str
    addr: str
    pid: int

    def where(self) -> str:
        return f"host {self.host} ({self.addr})"


def heartbeat_interval(timeout: timedelta) -> float:
    """Seconds between beats for a process-group ``timeout``: 1/20 of it, at least 1, at most 5."""
    return min(5.0, max(1.0, timeout.total_seconds() / 20))


def is_distributed_error(err: BaseException) -> bool:
    """A failure of a collective or of the store (as opposed to a bug on this rank)."""
    if isinstance(err, dist.DistError):
        return True
    text = str(err).lower()
    return isinstance(err, (RuntimeError, OSError)) and any(w in text for w in _DISTRIBUTED_WORDS)


def local_address(toward: str) -> str:
    """The address peers reach this host at: the source address of the route to ``toward`` (a UDP
    connect sends no packet)."""
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(toward, 1, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as sock:
            sock.connect(sockaddr)
            return sock.getsockname()[0]
    except OSError:
        return "address unknown"


def resolve(host: str) -> str:
    try:
        return socket.gethostbyname(host) if host else ""
    except OSError:
        return host


def name_ranks(peers: list[Peer]) -> str:
    """``ranks 2,3 on host hostB (10.213.7.2) and rank 5 on host hostC (10.213.7.3)``."""
    by_host: dict[str, list[int]] = {}
    for p in sorted(peers, key=lambda p: p.rank):
        by_host.setdefault(p.where(), []).append(p.rank)
    return " and ".join(f"rank{'s' if len(r) > 1 else ''} {','.join(map(str, r))} on {where}"
                        for where, r in by_host.items())


class Liveness:
    """``with Liveness.start(env, timeout, hint) as live:`` beats until the block ends, then
    leaves an exit record; ``live.check(err, hint)`` raises :class:`PeersLostError` from a
    collective's ``err`` when peers are gone. Disabled (every method a no-op) for a single process.

    ``stop_on_loss`` (set by :meth:`start`): end the process when the launcher ``launcher_pid``
    (None: not watched) or the store is lost, with ``hint()`` (what a relaunch does) in the line."""

    def __init__(self, store, me: Peer, world_size: int, interval: float,
                 store_addr: tuple[str, int], agent_store: bool, *, stop_on_loss: bool = False,
                 launcher_pid: int | None = None, hint=None):
        self.me, self.world_size, self.interval = me, world_size, interval
        self.stop_on_loss, self.launcher_pid = stop_on_loss, launcher_pid
        self.hint = hint if hint is not None else (lambda: "restart the job")
        self._verdict = threading.Lock()   # one report per process: the thread's or check()'s
        self.window = BEATS_PER_WINDOW * interval
        self.store_addr, self.agent_store = store_addr, agent_store
        self.store_ip = resolve(store_addr[0])   # now: a dead host's name may not resolve later
        self.peers: dict[int, Peer] = {me.rank: me}
        self.store_error: BaseException | None = None
        self.found_stale: dict[int, str] = {}   # lost rank -> its last beat, for the exit record
        self._store = store
        self._lock = threading.Lock()      # a beat never overwrites the exit record
        self._closed = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._sigterm = None               # the handler check() replaced, until close()

    @classmethod
    def start(cls, env: LaunchEnv, timeout: timedelta, hint=None) -> "Liveness":
        """Publish this rank and start beating into the launcher's store (``env``'s master); under
        torchrun, watch the agent (this process's parent). ``hint()``: what a relaunch does."""
        host, port = env.master_addr, env.master_port
        me = Peer(env.rank, socket.gethostname(), local_address(host or "127.0.0.1"), os.getpid())
        interval = heartbeat_interval(timeout)
        if env.world_size == 1 or not host or not port:
            return cls(None, me, env.world_size, interval, ("", 0), False)
        client = dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                               timeout=timedelta(seconds=BEATS_PER_WINDOW * interval))
        # torchrun's store outlives one attempt: each restart beats under its own prefix
        store = dist.PrefixStore(f"hybrid-liveness/{env.restart_count}", client)
        launcher = os.getppid() if env.under_torchrun else None
        return cls(store, me, env.world_size, interval, (host, port), env.agent_store,
                   stop_on_loss=True, launcher_pid=launcher, hint=hint).begin()

    def begin(self) -> "Liveness":
        """Publish this rank's host, address and pid, beat once and start the heartbeat thread."""
        self._store.set(f"info/{self.me.rank}", json.dumps(asdict(self.me)))
        self._beat()
        self._thread = threading.Thread(target=self._run, name="liveness-heartbeat", daemon=True)
        self._thread.start()
        return self

    def __enter__(self) -> "Liveness":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(exc)

    # ---- the heartbeat thread --------------------------------------------------------------
    def _run(self) -> None:
        tick = min(LAUNCHER_CHECK, self.interval)
        next_beat = time.monotonic() + tick
        while not self._stop.wait(tick):
            lost = self._launcher_lost()
            if lost:
                self._abandon(lost)
                return
            if time.monotonic() < next_beat:
                continue
            try:
                self._beat()
                if len(self.peers) < self.world_size:   # the directory, soon after start-up
                    self._read_peers()
            except Exception as err:   # the store is gone: check() says so, or this thread
                self.store_error = err
                if self.stop_on_loss and not self._stop.is_set():
                    self._abandon(self._store_lost())
                return
            full = len(self.peers) == self.world_size
            next_beat = time.monotonic() + (self.interval if full else min(self.interval, 0.2))

    def _launcher_lost(self) -> str | None:
        """What happened, when the launcher watched is gone (this process has another parent)."""
        if self.launcher_pid is None or os.getppid() == self.launcher_pid:
            return None
        return (f"lost the launcher: torchrun's agent (pid {self.launcher_pid}) is gone, so nobody "
                f"supervises this rank; it stops without saving")

    def _abandon(self, what: str) -> None:
        """End this process now with one line, unless check() is already reporting a loss."""
        if not self._verdict.acquire(blocking=False):
            return
        try:
            hint = self.hint()
        except Exception:   # reading the latest checkpoint failed: the line matters more
            hint = "restart the job"
        os.write(2, f"error: {what}; exiting ({hint})\n".encode())   # not sys.stderr: its lock
        os._exit(EXIT_LOST)                                           # may be the training thread's

    def _beat(self) -> None:
        with self._lock:
            if not self._closed:
                self._store.set(f"beat/{self.me.rank}", f"{time.time():.3f}")

    def _read_peers(self) -> None:
        keys = [f"info/{r}" for r in range(self.world_size)]
        if self._store.check(keys):
            for raw in self._store.multi_get(keys):
                p = Peer(**json.loads(raw))
                self.peers[p.rank] = p

    def close(self, exc: BaseException | None = None) -> None:
        """Stop beating and leave an exit record: done, failed with ``exc``, or lost contact."""
        if self._store is None or self._closed:
            return
        self._stop.set()
        kind = "done" if exc is None else "lost" if isinstance(exc, PeersLostError) else "failed"
        reason = "" if exc is None else " ".join(f"{type(exc).__name__}: {exc}".split())[:400]
        record = EXIT + json.dumps({"kind": kind, "reason": reason, "stale": self.found_stale})
        with self._lock:
            self._closed = True
            if self.store_error is None:   # else there is nothing left to write to
                try:
                    self._store.set(f"beat/{self.me.rank}", record)
                except Exception:   # the store went too; the others will find out on their own
                    pass
        self._thread.join(timeout=self.window)
        self._restore_sigterm()

    # ---- diagnosis -------------------------------------------------------------------------
    def check(self, err: BaseException, hint: str) -> None:
        """Raise :class:`PeersLostError` from ``err`` (a failed collective) naming the ranks that
        are gone or the rank that failed, ending with ``exiting (<hint>)``; return if none is.

        SIGTERM is ignored from here until :meth:`close`: torchrun sends it to a host's other
        ranks as soon as the first one exits, and each must still print its line (the process is
        leaving anyway; torchrun's SIGKILL after TORCH_ELASTIC_SHUTDOWN_TIMEOUT still applies)."""
        if self._store is None or not is_distributed_error(err):
            return
        log.debug("rank %d: checking peers after %r", self.me.rank, err)
        if threading.current_thread() is threading.main_thread():   # signals: main thread only
            self._sigterm = signal.signal(signal.SIGTERM, signal.SIG_IGN)
        self._verdict.acquire()   # held from here to the exit: the heartbeat thread stays quiet
        message = self._launcher_lost() or self.diagnose()   # the peers went with the launcher
        if message:
            raise PeersLostError(f"{message}; exiting ({hint})") from err
        self._verdict.release()
        self._restore_sigterm()

    def _restore_sigterm(self) -> None:
        if self._sigterm is not None:
            signal.signal(signal.SIGTERM, self._sigterm)
            self._sigterm = None

    def diagnose(self) -> str | None:
        """One line on what happened to the other ranks, or None when every one is alive."""
        if self.store_error is not None:
            return self._store_lost()
        try:
            if len(self.peers) < self.world_size:
                self._read_peers()
            lost, left = self._watch()
        except Exception as err:
            log.debug("store error while checking peers: %r", err)
            return self._store_lost()
        if lost:
            self.found_stale = lost
            ages = [time.time() - float(beat) for beat in lost.values() if beat != NEVER]
            silence = f"no heartbeat for {max(min(ages), 0.0):.1f} s" if ages else "no heartbeat"
            return f"lost contact with {name_ranks([self._peer(r) for r in lost])}: {silence}"
        failed = sorted(r for r, record in left.items() if record["kind"] == "failed")
        if failed:
            return f"{name_ranks([self._peer(failed[0])])} failed: {left[failed[0]]['reason']}"
        return None

    def _watch(self) -> tuple[dict[int, str], dict[int, dict]]:
        """Watch the others' beats for up to ``window`` s; returns (lost rank -> last beat, left
        rank -> exit record). The wait ends once every rank is accounted for."""
        others = [r for r in range(self.world_size) if r != self.me.rank]
        first, start, alive = self._beats(others), time.monotonic(), set()
        while True:
            now = self._beats(others)
            left = {r: json.loads(v[len(EXIT):]) for r, v in now.items() if v.startswith(EXIT)}
            # beats a rank that left with "lost" watched stand still for a whole window
            stale = {int(r): beat for record in left.values() for r, beat in record["stale"].items()}
            alive |= {r for r in others if now[r] != first[r] and r not in left}
            pending = [r for r in others if r not in alive and r not in left]
            if (all(stale.get(r) == now[r] or self._long_silent(now[r]) or self._gone_here(r)
                    for r in pending) or time.monotonic() - start >= self.window):
                return {r: now[r] for r in pending}, left
            time.sleep(self.interval / 4)

    def _long_silent(self, beat: str) -> bool:
        """A beat older than SILENT_BEATS intervals by this rank's clock (a host that vanished
        before a collective timed out): the clocks of one cluster agree far better than that."""
        return beat != NEVER and time.time() - float(beat) > SILENT_BEATS * self.interval

    def _gone_here(self, rank: int) -> bool:
        """A rank on this very host whose process is gone (no need to watch its beat)."""
        p = self.peers.get(rank)
        return (p is not None and (p.host, p.addr) == (self.me.host, self.me.addr)
                and process_gone(p.pid))

    def _beats(self, ranks: list[int]) -> dict[int, str]:
        keys = [f"beat/{r}" for r in ranks]
        if self._store.check(keys):
            return {r: raw.decode() for r, raw in zip(ranks, self._store.multi_get(keys))}
        return {r: self._store.get(k).decode() if self._store.check([k]) else NEVER
                for r, k in zip(ranks, keys)}

    def _peer(self, rank: int) -> Peer:
        return self.peers.get(rank, Peer(rank, "unknown", "address unknown", -1))

    def _store_lost(self) -> str:
        """The store does not answer: its holder (rank 0 under env://, torchrun's agent on the
        rendezvous host otherwise) is gone, and with it the ranks of that host."""
        (host, port), ip = self.store_addr, self.store_ip
        if self.agent_store:
            holders = [p for p in self.peers.values() if p.addr == ip and p.addr != self.me.addr]
        else:
            holders = [self._peer(0)]
        if holders:
            return (f"lost contact with {name_ranks(holders)}, which held the rendezvous store: "
                    f"{host}:{port} does not answer")
        if ip == self.me.addr or ip.startswith("127.") or ip == "::1":
            return (f"lost contact with the rendezvous store at {host}:{port} (it does not answer; "
                    f"torchrun's agent on this host held it)")
        return f"lost contact with the rendezvous host {host}: its store at port {port} does not answer"
