"""In-job restart (issue 34 part 5): ``--max-restarts N`` resumes a restarted job by itself.

The restarting is torchrun's: its agent watches the ranks and, when one fails, stops the others and
starts them all again, up to ``--max-restarts`` times (a proven loop; ours would be the same loop
with fewer of its cases handled). ``launch/torchrun.py`` (and so ``launch/local.sh`` /
``main_job.sh``) passes the trainer's ``--max-restarts N`` on to torchrun; under plain torchrun give
it to torchrun (``torchrun --max-restarts N ... launch/pretrain_gpt.py ...``). Each rank sees the
limit and its attempt number in ``TORCHELASTIC_MAX_RESTARTS`` / ``TORCHELASTIC_RESTART_COUNT``.

What this module adds is the resume: rank 0 keeps ``<save>/restarts.json`` - the torchrun job it
belongs to (``TORCHELASTIC_RUN_ID``), the run id, the restarts so far, the iterations lost so far
and the last iteration the attempt finished. A restarted attempt (count > 0) of the same torchrun
job reads it and

- resumes from ``latest`` in ``--save`` when that checkpoint is this run's (its run id), as if
  ``--load <save>`` had been given: lock, run id and data position come from that checkpoint;
- starts again from iteration 0, under the same run id, when the run had not saved a checkpoint
  yet (a leftover ``iter_N.tmp`` of its own is then removed by its first save);

and counts the iterations the failed attempt had done past the checkpoint as lost. The counter is
logged (a log line and the ``restarts`` scalar) and the totals are reported at the end of training.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from pretrain.config import TrainConfig

log = logging.getLogger(__name__)
RECORD_FILE = "restarts.json"


@dataclass
class RestartRecord:
    """One attempt's view of the job's restarts (every rank holds one; rank 0 writes the file)."""

    path: Path
    job: str
    max_restarts: int
    restarts: int = 0             # this attempt's number (TORCHELASTIC_RESTART_COUNT)
    lost_iterations: int = 0      # done by failed attempts past the checkpoint resumed from, total
    run_id: str | None = None     # the run's id, kept by a restart that starts from scratch
    resumed_from: int | None = None
    writer: bool = False

    def started(self, trainer) -> None:
        """Adopt the trainer's run id, log the counter, record the attempt."""
        self.run_id = trainer.ts.run_id
        trainer.metrics.log({"restarts": float(self.restarts)}, trainer.ts.iteration)
        if self.restarts:
            where = (f"resumed from iteration {self.resumed_from}" if self.resumed_from is not None
                     else "no checkpoint of this run yet: started again from iteration 0")
            log.warning("in-job restart %d of at most %d (run %s): %s; %d iteration(s) lost so far",
                        self.restarts, self.max_restarts, self.run_id, where, self.lost_iterations)
        self.progress(trainer.ts.iteration)

    def progress(self, iteration: int) -> None:
        """Rank 0, after every iteration: where this attempt is (a small file, replaced whole)."""
        if not self.writer:
            return
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps({"job": self.job, "run_id": self.run_id, "restarts": self.restarts,
                                   "lost_iterations": self.lost_iterations,
                                   "last_iteration": iteration}))
        os.replace(tmp, self.path)

    def report(self, iteration: int) -> None:
        log.info("in-job restarts: %d of at most %d; iterations lost to failures (done again): %d; "
                 "finished at iteration %d", self.restarts, self.max_restarts, self.lost_iterations,
                 iteration)


def plan_restart(cfg: TrainConfig, env, rank: int) -> RestartRecord | None:
    """Every rank, before the --save lock is claimed: None without restarts; else the record of
    this attempt, with ``cfg.checkpoint.load`` set to ``--save`` when a restart resumes. Refuses a
    ``--max-restarts`` that the launcher does not apply."""
    launcher = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0)
    asked = cfg.checkpoint.max_restarts
    if asked and launcher != asked:
        raise ValueError(f"--max-restarts {asked} is carried out by the launcher, which restarts the "
                         f"ranks {launcher} time(s): start the job with launch/torchrun.py (or "
                         f"launch/local.sh), which passes it on, or give torchrun --max-restarts "
                         f"{asked} before the script")
    if not launcher or not cfg.checkpoint.save:
        if asked:
            raise ValueError("--max-restarts resumes a restarted job from its checkpoints: give "
                             "--save DIR (and --save-interval N)")
        return None
    save = Path(cfg.checkpoint.save)
    record = RestartRecord(save / RECORD_FILE, os.environ.get("TORCHELASTIC_RUN_ID", ""), launcher,
                           restarts=env.restart_count, writer=rank == 0)
    if env.restart_count == 0:
        return record
    previous = _read(record.path)
    if previous is None or previous.get("job") != record.job:
        log.warning("restart %d: no record of this job's earlier attempt in %s; starting as the "
                    "command line says", env.restart_count, record.path)
        return record
    record.run_id = previous.get("run_id")
    record.lost_iterations = int(previous.get("lost_iterations", 0))
    from hybrid.checkpoint.writer import checkpoint_run_id, read_latest
    latest = read_latest(save)
    if latest is not None and record.run_id and checkpoint_run_id(save / latest) == record.run_id:
        record.resumed_from = int(latest.removeprefix("iter_"))
        if cfg.checkpoint.load is None:
            cfg.checkpoint.load = cfg.checkpoint.save
    record.lost_iterations += max(0, int(previous.get("last_iteration", 0))
                                  - (record.resumed_from or 0))
    return record


def _read(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
