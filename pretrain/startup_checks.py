"""Checks each rank makes at start-up, before it builds the model, so that a run fails at launch and
not after hours of training: the output directories can be written, ``--compile`` has its compiler,
whether ``--load`` resumes, and the job's lock on ``--save`` (hybrid.checkpoint.lock). The checks
made before any rank starts (config and layout, no torch) are :mod:`pretrain.preflight`'s."""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

from hybrid.parallel_state import ParallelState
from pretrain.config import TrainConfig

log = logging.getLogger(__name__)


def check_save_dir(cfg: TrainConfig) -> None:
    """Fail at launch, not after hours of training, when --save cannot be written."""
    from hybrid.checkpoint.format import CheckpointError
    if not cfg.checkpoint.save:
        return
    save = Path(cfg.checkpoint.save)
    problem = writable_dir_problem(save, mode=0o755)   # checkpoints: never world-writable
    if problem:
        raise CheckpointError(f"cannot write checkpoints to --save {str(save)!r} ({problem}); "
                              f"choose a writable directory")


def check_output_dirs(cfg: TrainConfig) -> None:
    """Fail at launch when a directory the run writes to (besides --save) cannot be a writable
    directory: the TensorBoard events, the sample-index cache and the NVMe offload files (each is
    created, as the run would; every rank probes with its own file, so ranks do not race)."""
    dirs = {"--tensorboard-dir": cfg.logging.tensorboard_dir, "--data-cache-dir": cfg.data.data_cache_dir,
            "--offload-nvme-path": cfg.parallel.offload_nvme_path}
    for flag, path in dirs.items():
        problem = None if path is None else writable_dir_problem(Path(path))
        if problem:
            raise ValueError(f"{flag} {path!r} is not a writable directory ({problem}); choose a "
                             f"directory this job can create and write")


def writable_dir_problem(path: Path, mode: int = 0o777) -> str | None:
    """Why ``path`` cannot be used as an output directory, or None; tries it for real, creating it
    (with ``mode``, less the umask) when it is missing."""
    if path.exists() and not path.is_dir():
        return "it is a file"
    try:
        path.mkdir(mode=mode, parents=True, exist_ok=True)
        probe = path / f".write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        return err.strerror or str(err)
    return None


def check_compile(cfg: TrainConfig, state: ParallelState) -> None:
    """--compile without a C++ compiler / Triton on this device: say so before building anything."""
    if cfg.training.compile:
        from models.gpt.compile import check_compile_support
        check_compile_support(state.device)


def resume_wanted(cfg: TrainConfig) -> bool:
    """--load given; ``--load`` = ``--save`` with no checkpoint yet is a fresh start (so the same
    command serves the first launch and every restart, e.g. under ``torchrun --max-restarts``)."""
    from hybrid.checkpoint.format import LATEST_FILE
    c = cfg.checkpoint
    if not c.load:
        return False
    fresh = (c.save is not None and Path(c.load).resolve() == Path(c.save).resolve()
             and not (Path(c.load) / LATEST_FILE).is_file())
    if fresh:
        log.info("no checkpoint in %s yet: starting from iteration 0", c.load)
    return not fresh


def claim_save(cfg: TrainConfig, state: ParallelState):
    """Collective: the job's lock on --save, held until the block ends (refuses a directory another
    job holds, or another run's checkpoints unless resuming or --overwrite)."""
    from hybrid.checkpoint.lock import claim_save_dir
    if not cfg.checkpoint.save:
        return contextlib.nullcontext()
    lock = claim_save_dir(cfg.checkpoint.save, resuming=resume_wanted(cfg),
                          overwrite=cfg.checkpoint.overwrite, world=state.world, device=state.device)
    return lock if lock is not None else contextlib.nullcontext()
