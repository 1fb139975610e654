"""This machine's GEMM rate at a model's own matrix shapes, measured once and cached on disk: the
denominator of the step roofline of :mod:`hybrid.perf.roofline`.

The one module of :mod:`hybrid.perf` that runs torch (lazily imported): everything else here is
arithmetic. A rate is the FLOP/s of ``[m, k] @ [k, n]`` in the run's dtype on its device with its
intra-op thread count; the fastest of a few repeats is kept. On a CPU with one intra-op thread the
clock is the thread's CPU time, so a rate measured while other processes share the cores says what
the machine can do, not what its load let it do; with several threads (whose work one thread's
clock cannot see) and on CUDA (synchronised) it is wall-clock time.

The cache is one JSON file of ``{key: FLOP/s}``; a key names everything that changes a rate: the
shape, the dtype, the thread count, the torch version and the CPU or GPU model, e.g.
``256x1024x768 bfloat16 threads=1 torch=2.13.0 cpu=AMD EPYC 7B13``. Several processes may fill it
at once: each writes the merge of what it read and what it measured through a temporary file and a
rename, so a reader never sees half a file (a lost update only costs a second measurement).
"""

from __future__ import annotations

import json
import logging
import os
import platform
import tempfile
import time
from pathlib import Path

log = logging.getLogger(__name__)

Shape = tuple[int, int, int]


def device_name(device="cpu") -> str:
    """``cpu=<model name>`` from /proc/cpuinfo (else the platform's), or ``cuda=<GPU name>``."""
    import torch
    device = torch.device(device)
    if device.type == "cuda":
        return "cuda=" + torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return "cpu=" + line.partition(":")[2].strip()
    except OSError:
        pass
    return "cpu=" + (platform.processor() or platform.machine())


def rate_key(shape: Shape, dtype, threads: int, torch_version: str, device: str) -> str:
    m, k, n = shape
    return f"{m}x{k}x{n} {str(dtype).removeprefix('torch.')} threads={threads} torch={torch_version} {device}"


def measure_gemm_rate(shape: Shape, dtype, device="cpu", repeats: int = 5) -> float:
    """FLOP/s of one ``[m, k] @ [k, n]`` product: the fastest of ``repeats`` timed runs after one
    warm-up run."""
    import torch
    m, k, n = shape
    a = torch.randn(m, k, device=device).to(dtype)
    b = torch.randn(k, n, device=device).to(dtype)
    cuda = torch.device(device).type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    clock = time.thread_time if not cuda and torch.get_num_threads() == 1 else time.perf_counter
    out = torch.empty(m, n, device=device, dtype=dtype)
    torch.mm(a, b, out=out)
    best = float("inf")
    for _ in range(max(1, repeats)):
        sync()
        start = clock()
        torch.mm(a, b, out=out)
        sync()
        best = min(best, clock() - start)
    return 2.0 * m * k * n / max(best, 1e-9)


class GemmRateCache:
    """``rates(shapes, dtype, device)``: the cached rate of each shape, measuring the missing ones
    (``measured`` lists the shapes the last call had to measure)."""

    def __init__(self, path: str | Path, repeats: int = 5):
        self.path, self.repeats = Path(path), repeats
        self.measured: list[Shape] = []

    def rates(self, shapes: list[Shape], dtype, device="cpu") -> dict[Shape, float]:
        import torch
        keys = {s: rate_key(s, dtype, torch.get_num_threads(), torch.__version__, device_name(device))
                for s in shapes}
        known = self._load()
        self.measured = [s for s in shapes if keys[s] not in known]
        if self.measured:
            log.info("measuring the GEMM rate of %d shape(s) in %s (once; cached in %s)",
                     len(self.measured), str(dtype).removeprefix("torch."), self.path)
            fresh = {keys[s]: measure_gemm_rate(s, dtype, device, self.repeats) for s in self.measured}
            known = {**self._load(), **fresh}
            self._store(known)
        return {s: float(known[keys[s]]) for s in shapes}

    def _load(self) -> dict[str, float]:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as err:
            log.warning("ignoring the unreadable GEMM-rate cache %s (%s); measuring again",
                        self.path, err)
            return {}
        if not isinstance(data, dict):
            return {}
        return {k: v for k, v in data.items() if isinstance(v, (int, float)) and v > 0}

    def _store(self, rates: dict[str, float]) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=self.path.name + ".")
            with os.fdopen(fd, "w") as f:
                json.dump(rates, f, indent=1, sort_keys=True)
            os.chmod(tmp, 0o644)   # a shared cache, like the corpus beside it
            os.replace(tmp, self.path)
        except OSError as err:   # a read-only cache costs a measurement per run, nothing else
            log.warning("cannot write the GEMM-rate cache %s (%s); rates kept for this run only",
                        self.path, err.strerror or err)
