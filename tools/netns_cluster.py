"""A shaped multi-host cluster on one machine: N "hosts" as network namespaces, M ranks each
(ZeRO §10's setting in miniature: fast links inside a node, a slow network between nodes).

Layout (``tag`` keeps concurrent clusters apart; names stay under Linux's 15-character limit)::

    hyb<tag>sw            a switch namespace holding bridge br0
    hyb<tag>h<i>          host i: lo + veth ``vh<tag>h<i>`` = 10.214.<tag>.<i+1>/24, its other end
                          ``vs<tag>h<i>`` a port of br0

Ranks of one host talk over the host's loopback (unshaped: several GB/s here); ranks of different
hosts go through the host's veth, the bridge and the peer's veth. With ``rate_mbit`` both ends of
every host's veth get a token-bucket filter (``tc qdisc ... tbf``; ``netem`` is not available here),
so each host's NIC sends and receives at most ``rate_mbit`` megabits per second, full duplex, like
one InfiniBand link of a DGX-2 (whose 8 links are shared by 16 GPUs).

Every host also gets a mount namespace with a private ``/dev/shm`` (network namespaces alone would
share it), so the shared-memory DP transport (hybrid.shm_collectives) works inside a host and falls
back to gloo across hosts, as on real machines.

:meth:`NetnsCluster.launch` starts ``launch/multinode.sh`` (torchrun c10d rendezvous on host 0) in a
host's namespaces; :meth:`NetnsCluster.run_job` starts it on every host and waits. Everything is
removed on exit, also after a failure: every process of a host is killed, then the namespaces are
deleted (which deletes the veths and the bridge). Needs root and iproute2; without them
:class:`NetnsUnavailable` says why (tests turn it into a skip).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RDZV_PORT = 29517
_RECEIVER = """
import socket, sys, threading, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(8); print("ready", flush=True)
got, first, last = [], [], []
def read(c):
    n = 0
    while True:
        b = c.recv(1 << 20)
        if not b:
            break
        if not n:
            first.append(time.monotonic())
        n += len(b)
    last.append(time.monotonic()); got.append(n)
threads = [threading.Thread(target=read, args=(s.accept()[0],)) for _ in range(int(sys.argv[3]))]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(sum(got), max(last) - min(first), flush=True)
"""
_SENDER = """
import socket, sys, threading
def send(left):
    s = socket.create_connection((sys.argv[1], int(sys.argv[2])))
    block = b"x" * (1 << 20)
    while left > 0:
        s.sendall(block[:left]); left -= len(block)
    s.close()
threads = [threading.Thread(target=send, args=(int(sys.argv[3]),)) for _ in range(int(sys.argv[4]))]
for t in threads:
    t.start()
for t in threads:
    t.join()
"""


class NetnsUnavailable(RuntimeError):
    """Network namespaces (or tc) cannot be used here; the message says why."""


def _sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), capture_output=True, text=True, check=check, timeout=30)


class NetnsCluster:
    """``hosts`` namespaces of ``ranks_per_host`` ranks; inter-host links at ``rate_mbit``
    megabits per second (None: unshaped). Use as a context manager."""

    def __init__(self, hosts: int = 2, ranks_per_host: int = 2, rate_mbit: float | None = None,
                 tag: int | None = None):
        if hosts < 2 or ranks_per_host < 1:
            raise ValueError(f"a cluster needs at least 2 hosts of at least 1 rank, got {hosts} x "
                             f"{ranks_per_host}")
        if rate_mbit is not None and rate_mbit <= 0:
            raise ValueError(f"rate_mbit must be positive, got {rate_mbit}")
        self.hosts, self.ranks_per_host, self.rate_mbit = hosts, ranks_per_host, rate_mbit
        tag = os.getpid() % 250 if tag is None else tag
        self.switch = f"hyb{tag}sw"
        self.ns = [f"hyb{tag}h{i}" for i in range(hosts)]
        self.dev = [f"vh{tag}h{i}" for i in range(hosts)]
        self.port = [f"vs{tag}h{i}" for i in range(hosts)]
        self.addr = [f"10.214.{tag}.{i + 1}" for i in range(hosts)]
        self._made: list[str] = []   # namespaces this object created (and only those it deletes)

    @property
    def world_size(self) -> int:
        return self.hosts * self.ranks_per_host

    # ---- set-up and tear-down --------------------------------------------------------------
    def __enter__(self) -> "NetnsCluster":
        try:
            self._create()
        except (OSError, subprocess.SubprocessError) as err:
            self.__exit__()
            detail = (getattr(err, "stderr", "") or str(err)).strip()
            raise NetnsUnavailable(f"cannot create network namespaces with tc shaping here "
                                   f"({detail}); needs root and iproute2 with netns and tbf "
                                   f"support") from None
        return self

    def _create(self) -> None:
        self._add_namespace(self.switch)
        _sh("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        _sh("ip", "-n", self.switch, "link", "set", "br0", "up")
        for ns, dev, port, addr in zip(self.ns, self.dev, self.port, self.addr):
            self._add_namespace(ns)
            _sh("ip", "link", "add", dev, "type", "veth", "peer", "name", port)
            _sh("ip", "link", "set", dev, "netns", ns)
            _sh("ip", "link", "set", port, "netns", self.switch)
            _sh("ip", "-n", self.switch, "link", "set", port, "master", "br0")
            _sh("ip", "-n", self.switch, "link", "set", port, "up")
            _sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            _sh("ip", "-n", ns, "link", "set", dev, "up")
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
            _sh("ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv4.tcp_slow_start_after_idle=0")
            if self.rate_mbit is not None:   # the host's NIC: sending (dev) and receiving (port)
                self._shape(ns, dev)
                self._shape(self.switch, port)

    def _add_namespace(self, ns: str) -> None:
        _sh("ip", "netns", "add", ns)
        self._made.append(ns)

    @property
    def burst_bytes(self) -> int:
        """The token bucket's burst: 10 ms of traffic at the shaped rate, at least 32 KB."""
        return max(32 * 1024, int(self.rate_mbit * 1e6 / 8 / 100))

    def _shape(self, ns: str, dev: str) -> None:
        burst = self.burst_bytes
        _sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
            "rate", f"{self.rate_mbit}mbit", "burst", str(burst), "latency", "100ms")

    def __exit__(self, *exc) -> None:
        for host, ns in enumerate(self.ns):
            if ns in self._made:
                self.kill_host(host)
        for ns in self._made:
            _sh("ip", "netns", "del", ns, check=False)    # also removes the veths and the bridge
        self._made = []

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

    # ---- running things on a host ----------------------------------------------------------
    def command(self, host: int, argv: list[str]) -> list[str]:
        """``argv`` inside host ``host``: its network namespace and a private ``/dev/shm``."""
        inner = 'mount -t tmpfs -o size=50% tmpfs /dev/shm && exec "$@"'
        return ["ip", "netns", "exec", self.ns[host], "unshare", "--mount", "--propagation",
                "private", "sh", "-c", inner, "sh", *argv]

    def launch(self, host: int, args: list[str], log: Path, job: str,
               env: dict[str, str] | None = None) -> subprocess.Popen:
        """``launch/multinode.sh args`` on host ``host`` (0 holds the rendezvous), output to ``log``."""
        env = dict(os.environ if env is None else env)
        env.update(NNODES=str(self.hosts), NPROC=str(self.ranks_per_host),
                   MASTER=f"{self.addr[0]}:{RDZV_PORT}", JOB_ID=job,
                   GLOO_SOCKET_IFNAME=self.dev[host], LOCAL_ADDR=self.addr[host],
                   RDZV_IS_HOST="1" if host == 0 else "0", PYTHON=env.get("PYTHON", sys.executable))
        env.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "5")
        cmd = self.command(host, ["bash", "launch/multinode.sh", *args])
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=open(log, "w"),
                                stderr=subprocess.STDOUT, start_new_session=True)

    def run_job(self, args: list[str], log_dir: Path, job: str, timeout: float,
                env: dict[str, str] | None = None) -> list[int]:
        """Start the job on every host and wait for all; returns the exit codes (host order).
        Logs are ``log_dir/<job>_host<i>.log``. Hosts still running at ``timeout`` are killed
        (exit code -9)."""
        log_dir.mkdir(parents=True, exist_ok=True)
        procs = [self.launch(h, args, log_dir / f"{job}_host{h}.log", job, env)
                 for h in range(self.hosts)]
        deadline = time.monotonic() + timeout
        codes = []
        for host, proc in enumerate(procs):
            try:
                codes.append(proc.wait(timeout=max(1.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                self.kill_host(host)
                os.killpg(proc.pid, signal.SIGKILL)
                codes.append(proc.wait(timeout=30))
        return codes

    def torchrun(self, script: str, log_dir: Path, job: str, timeout: float = 300,
                 env: dict[str, str] | None = None) -> list[str]:
        """``torchrun script`` across the hosts (rendezvous on host 0, ``ranks_per_host`` each);
        returns each host's output (host order); raises if a host fails."""
        procs = []
        for host in range(self.hosts):
            host_env = dict(os.environ if env is None else env)
            host_env["GLOO_SOCKET_IFNAME"] = self.dev[host]
            argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(self.hosts),
                    "--nproc-per-node", str(self.ranks_per_host), "--rdzv-backend", "c10d",
                    "--rdzv-endpoint", f"{self.addr[0]}:{RDZV_PORT + 1}", "--rdzv-id", job,
                    "--local-addr", self.addr[host],
                    *(["--rdzv-conf", "is_host=true"] if host == 0 else []), script]
            log = open(log_dir / f"{job}_host{host}.log", "w+")
            procs.append((subprocess.Popen(self.command(host, argv), cwd=ROOT, env=host_env,
                                           stdout=log, stderr=subprocess.STDOUT,
                                           start_new_session=True), log))
        outputs = []
        for host, (proc, log) in enumerate(procs):
            try:
                code = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill_host(host)
                code = proc.wait(timeout=30)
            log.seek(0)
            outputs.append(log.read())
            log.close()
            if code != 0:
                raise RuntimeError(f"{script} failed on host {host} (exit {code}):\n"
                                   f"{outputs[-1][-3000:]}")
        return outputs

    def measure_mbit(self, src: int, dst: int, nbytes: int = 8 << 20, port: int = 5599,
                     flows: int = 1) -> float:
        """Megabits per second that ``flows`` concurrent TCP streams of ``nbytes`` each get together
        from host ``src`` to host ``dst`` (``src == dst``: over the host's loopback), first byte
        received to last."""
        addr = "127.0.0.1" if src == dst else self.addr[dst]
        receiver = subprocess.Popen(self.command(dst, [sys.executable, "-c", _RECEIVER, addr,
                                                      str(port), str(flows)]),
                                    stdout=subprocess.PIPE, text=True)
        try:
            assert receiver.stdout.readline().strip() == "ready"
            subprocess.run(self.command(src, [sys.executable, "-c", _SENDER, addr, str(port),
                                              str(nbytes), str(flows)]), check=True, timeout=300)
            received, seconds = receiver.communicate(timeout=60)[0].split()
        finally:
            if receiver.poll() is None:
                receiver.kill()
                receiver.wait()
        return int(received) * 8 / float(seconds) / 1e6
