"""``--memory-snapshot-step K`` (issue 34 part 6): what holds this rank's memory after iteration K.

On CUDA the caching allocator records every allocation and free with its stack from the start of
training (``torch.cuda.memory._record_memory_history``); after iteration K the history is dumped
(``_dump_snapshot``) as ``memory-snapshot-iter<K>-rank<R>.pickle`` - open it in
https://pytorch.org/memory_viz - and recording stops, so the steps after K run at full speed.

On CPU there is no allocator history to record; the file is ``memory-report-iter<K>-rank<R>.json``:
the engine's model-state bytes by category, measured from its storages (param16, grad16, master32,
adam_moments, buffers) beside the paper's formula (ZeRO §5), and the process's resident set
(current and peak); the same figures go to the log in one line.

Both go to the run's TensorBoard directory, or to ``--save`` without one.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from pretrain.metrics import host_memory_bytes

log = logging.getLogger(__name__)


class MemorySnapshot:
    """Armed at the start of training, fired once after iteration ``step``."""

    def __init__(self, step: int, directory: Path, rank: int, device):
        self.step, self.directory, self.rank = step, Path(directory), rank
        self.cuda = getattr(device, "type", str(device)) == "cuda"
        self.done = False

    def start(self) -> None:
        if self.cuda:   # from the first step on: the snapshot shows how step K's memory came to be
            torch.cuda.memory._record_memory_history(max_entries=100_000)

    def due(self, iteration: int) -> bool:
        return not self.done and iteration >= self.step

    def write(self, iteration: int, optimizer) -> Path:
        """This rank's snapshot after ``iteration``; returns the file written."""
        self.done = True
        self.directory.mkdir(parents=True, exist_ok=True)
        if self.cuda:
            path = self.directory / f"memory-snapshot-iter{iteration}-rank{self.rank}.pickle"
            torch.cuda.memory._dump_snapshot(str(path))
            torch.cuda.memory._record_memory_history(enabled=None)   # stop recording
            log.info("CUDA memory snapshot after iteration %d: %s (view at "
                     "https://pytorch.org/memory_viz)", iteration, path)
            return path
        report = memory_report(optimizer)
        path = self.directory / f"memory-report-iter{iteration}-rank{self.rank}.json"
        path.write_text(json.dumps({"iteration": iteration, "rank": self.rank, **report}, indent=1))
        measured = ", ".join(f"{k} {v / 2**20:.2f} MiB" for k, v in report["measured"].items())
        log.info("memory after iteration %d (rank %d): %s; resident set %.1f MiB (peak %.1f MiB); "
                 "written to %s", iteration, self.rank, measured or "no engine report",
                 report["host"]["mem-rss-bytes"] / 2**20, report["host"]["mem-max-rss-bytes"] / 2**20,
                 path)
        return path

    def stop(self) -> None:
        """Training ended before step K (or raised): recording must not go on."""
        if self.cuda and not self.done:
            torch.cuda.memory._record_memory_history(enabled=None)


def shared_directory(directory: str | Path | None, world, device) -> Path:
    """Collective: rank 0's ``directory`` on every rank (the run directory exists on rank 0 only)."""
    from hybrid import comm
    text = torch.zeros(4096, dtype=torch.uint8)
    if world.rank == 0:
        raw = str(directory).encode()[:4096]
        text[:len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    text = text.to(device)
    with comm.unrecorded(world):
        comm.broadcast(text, world)
    return Path(bytes(text.cpu().tolist()).rstrip(b"\0").decode())


def memory_report(optimizer) -> dict:
    """Bytes by category: the engine's measured model state and the paper's formula (if it has a
    report), and the process's resident set."""
    report = getattr(optimizer, "memory_report", None)
    r = report() if report is not None else None
    return {"measured": {k: int(v) for k, v in (r.measured.items() if r else ())},
            "formula": {k: int(v) for k, v in (r.formula.items() if r else ())},
            "host": host_memory_bytes()}
