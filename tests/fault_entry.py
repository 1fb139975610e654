"""``launch/pretrain_gpt.py`` with injected faults, for the reliability tests (run by torchrun or
python; never imported by the library). Faults are chosen by environment variables and fire only
in the first attempt of a torchrun job (TORCHELASTIC_RESTART_COUNT 0), so a restart runs clean:

    FAULT_KILL_RANK=r[,r..] FAULT_AT_ITER=k
                                         rank(s) r SIGKILL themselves before training iteration k+1
    FAULT_RAISE_RANK=r FAULT_AT_ITER=k   rank r raises RuntimeError there (a bug on one rank)
    FAULT_SAVE_CRASH=rank-file|before-latest FAULT_AT_ITER=k
                                         os._exit(9) inside the save of iteration k: after the rank
                                         file is written / after the rename, before ``latest``
    FAULT_SLOW_SAVE=seconds              every rank sleeps this long after writing its rank file
                                         (a save that is still running when a test signals)
    LOSS_LOG=path                        rank 0 appends {"iteration", "loss"} (repr-exact) per step,
                                         and its resident set size ("rss", bytes) every 10 steps
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hybrid.checkpoint import writer  # noqa: E402
from pretrain.trainer import Trainer  # noqa: E402
from tests.reliability_helpers import load_entry  # noqa: E402

RANK = int(os.environ.get("RANK", "0"))
FIRST_ATTEMPT = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
AT = int(os.environ.get("FAULT_AT_ITER", "-1"))


def _patch_step() -> None:
    step = Trainer.train_step
    kill = os.environ.get("FAULT_KILL_RANK")
    fail = os.environ.get("FAULT_RAISE_RANK")

    def faulty_step(self, loader, lr):
        if FIRST_ATTEMPT and self.ts.iteration == AT:
            if kill is not None and str(RANK) in kill.split(","):
                os.kill(os.getpid(), signal.SIGKILL)
            if fail is not None and int(fail) == RANK:
                raise RuntimeError(f"injected failure on rank {RANK} at iteration {AT}")
        return step(self, loader, lr)

    Trainer.train_step = faulty_step


def _patch_loss_log(path: str) -> None:
    advance = Trainer._advance

    def logged(self, stats):
        advance(self, stats)
        self._settle(stats)   # the iteration's loss, read now (the trainer reads it per interval)
        if self.state.rank == 0:
            rec = {"iteration": self.ts.iteration, "loss": repr(self.losses[-1]),
                   "restart": os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")}
            if self.ts.iteration % 10 == 0:
                rec["rss"] = _rss_bytes()
            with open(path, "a") as f:
                f.write(json.dumps(rec) + "\n")

    Trainer._advance = logged


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _patch_save(where: str) -> None:
    target = writer.iteration_dir_name(AT)
    if where == "rank-file":
        write = writer.write_rank_file

        def crashing_write(directory, rank, pieces, extra, *identity, **options):
            path = write(directory, rank, pieces, extra, *identity, **options)
            if directory.name == target + ".tmp":
                os._exit(9)
            return path
        writer.write_rank_file = crashing_write
    elif where == "before-latest":
        rename = os.rename

        def crashing_rename(src, dst):
            rename(src, dst)
            if Path(dst).name == target:
                os._exit(9)
        writer.os.rename = crashing_rename
    else:
        raise ValueError(f"FAULT_SAVE_CRASH must be rank-file or before-latest, got {where!r}")


def _patch_slow_save(seconds: float) -> None:
    write = writer.write_rank_file

    def slow_write(*args, **kwargs):
        path = write(*args, **kwargs)
        time.sleep(seconds)
        return path
    writer.write_rank_file = slow_write


def main() -> int:
    _patch_step()
    if os.environ.get("FAULT_SLOW_SAVE"):
        _patch_slow_save(float(os.environ["FAULT_SLOW_SAVE"]))
    if os.environ.get("LOSS_LOG"):
        _patch_loss_log(os.environ["LOSS_LOG"])
    if os.environ.get("FAULT_SAVE_CRASH") and FIRST_ATTEMPT:
        _patch_save(os.environ["FAULT_SAVE_CRASH"])
    return load_entry().main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
