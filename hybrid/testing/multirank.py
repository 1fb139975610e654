"""The multi-rank test harness (public: tests and benchmarks use it): run a function on N CPU ranks
with gloo, re-raising each rank's failure.

    def check(rank, world_size, tp):             # module-level, so spawn can pickle it
        state = ParallelState.initialize(Topology(world_size, tp, gpus_per_node=world_size))
        ...
        return something_picklable

    results = run_on_ranks(check, world_size=4, args=(2,))   # one result per rank, rank order

Each rank is a fresh spawned process with one intra-op thread, joined to a gloo default process group
(``backend="nccl"``: NCCL, rank r on GPU r; tests/gpu) on a free localhost port with ``timeout`` on
its collectives. The parent enforces a wall-clock timeout too, so a deadlock fails the test with the
ranks that did not finish instead of hanging CI.
"""

from __future__ import annotations

import os
import queue as queue_module
import socket
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class RankFailure(RuntimeError):
    """A rank raised; the message carries its rank and traceback."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_entry(fn, rank, world_size, port, results, args, kwargs, timeout_s, backend):
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)   # one GPU per rank: NCCL refuses two ranks on one device
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=timeout_s))
        value = fn(rank, world_size, *args, **kwargs)
        results.put((rank, "ok", value))
    except BaseException:  # report everything, including assertion failures, to the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_on_ranks(fn, world_size: int, args: tuple = (), kwargs: dict | None = None,
                 timeout: float = 180.0, backend: str = "gloo") -> list:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` ranks; return their results.
    ``backend``: of the default process group (``gloo`` also carries CUDA tensors; ``nccl`` needs
    one GPU per rank)."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_entry, daemon=True,
                         args=(fn, r, world_size, port, results, args, kwargs or {}, timeout,
                               backend))
             for r in range(world_size)]
    for p in procs:
        p.start()
    values, deadline = {}, time.monotonic() + timeout
    try:
        while len(values) < world_size:
            try:
                rank, status, value = results.get(timeout=0.2)
            except queue_module.Empty:
                _check_silent_deaths(procs, values)
                if time.monotonic() > deadline:
                    missing = sorted(set(range(world_size)) - set(values))
                    raise TimeoutError(f"ranks {missing} did not finish within {timeout:.0f} s")
                continue
            if status == "error":
                raise RankFailure(f"rank {rank} of {world_size} failed:\n{value}")
            values[rank] = value
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    return [values[r] for r in range(world_size)]


def _check_silent_deaths(procs, values) -> None:
    """A rank that died without reporting (segfault, os._exit) fails the run at once."""
    for rank, p in enumerate(procs):
        if rank not in values and p.exitcode not in (None, 0):
            time.sleep(0.5)  # its queued report, if any, wins
            raise RankFailure(f"rank {rank} exited with code {p.exitcode} without a report")
