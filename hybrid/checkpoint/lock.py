"""One job per ``--save`` directory: an exclusive lock held for the job's lifetime (docs/design.md §8).

Two jobs writing one directory lose checkpoints silently (each prunes, replaces ``latest`` and
cleans up "stale" temporary directories of the other) or mix their files into one checkpoint. So
the job's rank 0 - the rank that creates, commits and prunes checkpoint directories - takes an
``flock`` on ``<save>/job.lock`` before anything else and keeps it until the process ends:

- a second job finds the lock taken and stops at start-up, naming the holder (host, pid, start
  time, written into the lock file by the holder) and the fix;
- a job that dies (crash, ``kill -9``, node loss) releases the lock with its file descriptor, so
  the next job takes it over; the holder it finds in the file is reported as gone.

``flock`` is honoured across nodes by NFS (v4, or v3 with lockd), GPFS, BeeGFS, and Lustre mounted
with ``-o flock``. On a filesystem without it (Lustre ``-o noflock``) the lock is skipped with a
warning and only the run-identity checks (:func:`claim_save_dir`) protect the directory.

Every rank files a run's identity (a ``run_id``) in its checkpoint files; a fresh run (not resuming)
into a directory holding another run's checkpoints is refused unless ``--overwrite`` is given.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import time
import uuid
from pathlib import Path

import torch

from hybrid import comm
from hybrid.checkpoint.format import LATEST_FILE, CheckpointError

log = logging.getLogger(__name__)
LOCK_FILE = "job.lock"


def new_run_id() -> str:
    """A run identity: the start time (readable) and 8 random hex digits (unique)."""
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + uuid.uuid4().hex[:8]


def _holder_text(info: dict) -> str:
    return (f"host {info.get('host', '?')}, pid {info.get('pid', '?')}, "
            f"started {info.get('started', '?')}")


class SaveDirLock:
    """The exclusive lock on one save directory, held while the object lives (or until
    :meth:`release`)."""

    def __init__(self, save_dir: str | Path):
        self.path = Path(save_dir) / LOCK_FILE
        try:
            self.path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
            self._fd: int | None = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:
            raise CheckpointError(f"cannot open the lock file {self.path} ({err.strerror}); --save "
                                  f"must be a directory this user can write") from None
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = self._read_holder()
            self._close()
            raise CheckpointError(
                f"--save {self.path.parent} is in use by another job ({_holder_text(holder)}); "
                f"wait for that job to finish or stop it, or give this job another --save") from None
        except OSError as err:
            if err.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                raise
            log.warning("the filesystem of %s does not support flock (%s): running without the "
                        "one-job-per-directory lock; make sure no other job uses this --save",
                        self.path.parent, err.strerror)
            self._close()
            return
        previous = self._read_holder()
        if previous:
            log.warning("taking over %s: the job that held it is gone (%s)", self.path,
                        _holder_text(previous))
        self._write_holder({"host": socket.gethostname(), "pid": os.getpid(),
                            "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())})

    def _read_holder(self) -> dict:
        try:
            text = self.path.read_text()
            return json.loads(text) if text.strip() else {}
        except (OSError, ValueError):
            return {"host": "unknown (unreadable lock file)"}

    def _write_holder(self, info: dict) -> None:
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, json.dumps(info).encode(), 0)
        os.fsync(self._fd)

    def _close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        """Clear the holder (a clean exit leaves nothing to report) and unlock."""
        if self._fd is None:
            return
        os.ftruncate(self._fd, 0)
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        self._close()

    def __enter__(self) -> SaveDirLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def holds_checkpoints(save_dir: Path) -> bool:
    """A ``latest`` marker or any complete ``iter_*`` directory."""
    return (save_dir / LATEST_FILE).is_file() or any(
        p.is_dir() and not p.name.endswith(".tmp") for p in save_dir.glob("iter_*"))


def check_fresh_run(save_dir: Path, overwrite: bool) -> None:
    """A run that does not resume must not write into another run's checkpoints silently."""
    if not holds_checkpoints(save_dir):
        return
    if overwrite:
        log.warning("--overwrite: %s holds the checkpoints of another run; this run replaces them "
                    "(they are deleted when it saves its first checkpoint)", save_dir)
        return
    raise CheckpointError(f"--save {save_dir} already holds the checkpoints of another run; resume "
                          f"that run with --load {save_dir}, start a new one elsewhere with another "
                          f"--save, or pass --overwrite to replace them")


def claim_save_dir(save_dir: str | Path, *, resuming: bool, overwrite: bool, world: comm.Group,
                   device: str | torch.device = "cpu") -> SaveDirLock | None:
    """Collective over ``world`` at start-up: rank 0 locks ``save_dir`` and, for a fresh run, checks
    it holds no other run's checkpoints. Returns the lock on rank 0 (None elsewhere); if rank 0
    refuses, every rank raises, rank 0 with the reason."""
    error, lock = None, None
    if world.rank == 0:
        try:
            lock = SaveDirLock(save_dir)
            if not resuming:
                check_fresh_run(Path(save_dir), overwrite)
        except CheckpointError as err:
            error = err
            if lock is not None:
                lock.release()
    failed = comm.max_over(world, int(error is not None), device)
    if error is not None:
        raise error
    if failed:
        raise CheckpointError(f"rank 0 refused --save {save_dir} (see its error line); nothing was "
                              f"trained")
    return lock
