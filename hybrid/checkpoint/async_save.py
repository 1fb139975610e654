"""Asynchronous checkpoint saves (issue 34 part 1; the role of Megatron-LM's ``--async-save``):
the step loop is blocked only while this rank's state is copied to host memory; a background thread
writes the rank file while training goes on, and the save is committed - manifest, metadata,
rename, ``latest``, pruning - once every rank's file is written. The steps are the synchronous
save's own (:mod:`hybrid.checkpoint.writer`), so the files are the same bytes:

    save(N)    finish the save in flight, if any (its wait is measured)     at most one in flight
               rank 0: writer.prepare_save -> empty iter_N.tmp owned by the run      (agreed)
               snapshot: pieces and RNG states -> this writer's host buffers
                         (CUDA: pinned buffers, copies on a side stream the compute stream waits for)
               background thread: writer.write_rank_file(iter_N.tmp, snapshot)  (hash side file too)
    poll()     once per step while a save is in flight: one MAX all-reduce of "my write is still
               running"; when no rank's is, finish() below - it then waits for nothing
    finish()   wait for this rank's write; every rank agrees it succeeded; rank 0 commits with
               writer.commit_save                                                      (agreed)

Only the step loop's thread runs collectives (the writer thread runs none: two threads issuing
collectives on one process group would interleave them differently on different ranks). So the
commit needs the loop to come by: at the next step's poll, at the next save, or at the end of
training - which includes SIGTERM, Ctrl-C and ``--exit-duration-in-mins`` stops: the trainer
finishes the save in flight before it returns, so the job exits 0 with the checkpoint committed.

A thread, not a process: the writer's bulk work - safetensors writing from the buffers' pointers,
fsync, sha256 over 1 MiB chunks - runs in C/Rust with the GIL released, so the training thread is not
held up; a process would need the snapshot in shared memory (pinned shared memory on CUDA) and a
second interpreter with torch per rank. A crash (or ``kill -9``) of the rank ends the thread with
it: ``iter_N.tmp`` is left half-written, ``latest`` still names the previous complete checkpoint,
and this run's next save removes the leftover (writer.remove_stale_saves).

Host memory: one set of buffers, shaped as this rank's saved pieces, allocated at the first save
and reused by every later one (the previous write has ended before they are overwritten), so the
copy costs exactly one checkpoint's worth of this rank's bytes (:attr:`HostSnapshot.bytes`, logged
and reported as ``checkpoint-async-host-bytes``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import torch

from hybrid import comm
from hybrid.checkpoint import writer
from hybrid.checkpoint.format import Piece

log = logging.getLogger(__name__)


class HostSnapshot:
    """Host copies of one rank's saved tensors, in buffers kept from save to save."""

    def __init__(self):
        self._buffers: dict[str, torch.Tensor] = {}
        self._stream = None   # CUDA side stream of the device-to-host copies

    @property
    def bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    @property
    def pinned(self) -> bool:
        return any(b.is_pinned() for b in self._buffers.values())

    def _buffer(self, key: str, like: torch.Tensor) -> torch.Tensor:
        buf = self._buffers.get(key)
        if buf is None or buf.shape != like.shape or buf.dtype != like.dtype:
            buf = torch.empty(like.shape, dtype=like.dtype, device="cpu",
                              pin_memory=like.is_cuda)   # pinned: the copy runs at full bus speed
            self._buffers[key] = buf
        return buf

    def take(self, pieces: list[Piece], extra: dict[str, torch.Tensor]):
        """Copy ``pieces`` (flattened, as the writer stores them) and ``extra`` into the buffers;
        returns (host pieces, host extras, CUDA event the copies end at or None). On CUDA the copies
        are queued on a side stream after the work already queued, and the compute stream waits for
        them before its next kernel (an optimizer step must not change a tensor mid-copy) - the
        host does not wait."""
        sources = [("piece:" + p.key, p.tensor.detach().reshape(-1)) for p in pieces]
        sources += [("extra:" + name, t.detach()) for name, t in extra.items()]
        device = next((t.device for _, t in sources if t.is_cuda), None)
        context = contextlib.nullcontext()
        if device is not None:
            if self._stream is None:
                self._stream = torch.cuda.Stream(device)
            self._stream.wait_stream(torch.cuda.current_stream(device))
            context = torch.cuda.stream(self._stream)
        copies = {}
        with context:
            for key, src in sources:
                buf = self._buffer(key, src)
                buf.copy_(src, non_blocking=src.is_cuda)
                if src.is_cuda:   # the caching allocator must not reuse src before the copy ran
                    src.record_stream(self._stream)
                copies[key] = buf
        for key in set(self._buffers) - set(copies):   # state that went away: memory stays bounded
            del self._buffers[key]
        ready = None
        if device is not None:
            ready = torch.cuda.Event()
            ready.record(self._stream)
            torch.cuda.current_stream(device).wait_event(ready)
        host_pieces = [dataclasses.replace(p, tensor=copies["piece:" + p.key]) for p in pieces]
        host_extra = {name: copies["extra:" + name] for name in extra}
        return host_pieces, host_extra, ready


@dataclass
class _InFlight:
    """One save whose rank file is being written in the background."""

    iteration: int
    save_dir: Path
    tmp: Path
    final: Path
    metadata: dict
    keep_last: int
    run_id: str | None
    replace_other_runs: bool
    written: Future   # its result: the seconds the write took


class AsyncCheckpointWriter:
    """One per rank and run; every method but :attr:`in_flight` is collective over ``world``."""

    def __init__(self, world: comm.Group, device: str | torch.device = "cpu"):
        self.world, self.device = world, device
        self.snapshot = HostSnapshot()
        self._in_flight: _InFlight | None = None
        self.last_wait = 0.0    # seconds the last finish() waited for a write
        self.total_wait = 0.0
        self.committed: list[Path] = []
        self._pruning: threading.Thread | None = None   # rank 0: old checkpoints being deleted

    @property
    def in_flight(self) -> bool:
        return self._in_flight is not None

    def save(self, save_dir: str | Path, iteration: int, pieces: list[Piece],
             extra: dict[str, torch.Tensor], metadata: dict, *, keep_last: int = 2,
             run_id: str | None = None, replace_other_runs: bool = False) -> Path:
        """Start the save of ``iteration`` (arguments as :func:`writer.save_checkpoint`'s) after
        finishing the one in flight; returns when this rank's state is in host memory."""
        self.finish()
        save_dir, final, tmp = writer.save_paths(save_dir, iteration)
        first = self.world.rank == 0
        writer.agree_on_failure(
            self.world, (lambda: writer.prepare_save(save_dir, tmp, run_id, replace_other_runs))
            if first else None, f"creating {tmp}", self.device)
        first_snapshot = not self.snapshot.bytes
        host_pieces, host_extra, ready = self.snapshot.take(pieces, extra)
        if first_snapshot:
            log.info("--async-save: %.1f MiB of %shost memory hold this rank's checkpoint copy",
                     self.snapshot.bytes / 2**20, "pinned " if self.snapshot.pinned else "")
        rank = self.world.ranks[self.world.rank]
        written: Future = Future()

        def write() -> None:
            try:
                start = time.perf_counter()
                if ready is not None:
                    ready.synchronize()
                # looked up at call time: the writer's function, as the synchronous save calls it
                path = writer.write_rank_file(tmp, rank, host_pieces, host_extra, run_id, copy=False)
                written.set_result(time.perf_counter() - start)
                del path
            except BaseException as err:   # handed to the loop's thread, raised there on every rank
                written.set_exception(err)

        threading.Thread(target=write, name=f"async-save-{iteration}", daemon=True).start()
        self._in_flight = _InFlight(iteration, save_dir, tmp, final, metadata, keep_last, run_id,
                                    replace_other_runs, written)
        return final

    def close(self) -> None:
        """Wait for the pruning of the last commit (the write itself: :meth:`finish`)."""
        if self._pruning is not None:
            self._pruning.join()
            self._pruning = None

    def poll(self) -> bool:
        """Commit the save in flight if every rank's write has ended (one small all-reduce, no
        wait); True if it committed one."""
        if self._in_flight is None:
            return False
        running = comm.max_over(self.world, int(not self._in_flight.written.done()), self.device)
        if running:
            return False
        self.finish()
        return True

    def finish(self) -> float:
        """Wait for the write in flight, agree that every rank's succeeded, commit on rank 0;
        returns the seconds this rank waited for its write (0 with nothing in flight)."""
        job = self._in_flight
        self.last_wait = 0.0
        if job is None:
            return 0.0
        self._in_flight = None
        start = time.perf_counter()
        try:
            job.written.exception()   # waits; the error, if any, is raised by the agreement below
        finally:
            self.last_wait = time.perf_counter() - start
            self.total_wait += self.last_wait
        writer.agree_on_failure(self.world, job.written.result,
                                "writing the rank file (in the background)", self.device)

        def commit() -> None:
            if self._pruning is not None:   # the last commit's pruning, before this one's
                self._pruning.join()
            writer.commit_save(job.save_dir, job.tmp, job.final, job.metadata, job.iteration,
                               self.world.size, job.keep_last, job.run_id, job.replace_other_runs,
                               prune=False)
            # deleting old checkpoints (gigabytes) is no reason to hold the loop: a thread of its own
            self._pruning = threading.Thread(
                target=writer.prune_checkpoints, name="async-save-prune", daemon=True,
                args=(job.save_dir, job.keep_last, job.run_id),
                kwargs={"replace_other_runs": job.replace_other_runs})
            self._pruning.start()

        writer.agree_on_failure(self.world, commit if self.world.rank == 0 else None,
                                f"committing {job.final}", self.device)
        self.committed.append(job.final)
        if self.world.rank == 0:
            log.info("saved checkpoint %s (rank 0 wrote it in the background in %.2f s; the loop "
                     "waited %.2f s for it)", job.final, job.written.result(), self.last_wait)
        return self.last_wait
