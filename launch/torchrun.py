"""torchrun for the launch scripts: its flags and its agent, with stops and failures a scheduler reads.

    python launch/torchrun.py --standalone --nproc-per-node 4 launch/pretrain_gpt.py --config tiny-cpu

torchrun's own command-line parser and agent run in this process (``torch.distributed.run``); three
things differ, so that the command a user or a scheduler ran ends the way the job ended:

- SIGTERM (preemption, ``scancel``, a time limit) or SIGINT (Ctrl-C) goes to every rank of this
  host, and the ranks agree to save a checkpoint and stop (pretrain/exit.py): they exit 0 and
  so does this command. torchrun itself would also pass the signal on, but then exit 1 with a
  traceback. A second Ctrl-C stops every rank at once (SIGKILL): nothing more is written, and a save
  cut short leaves only its ``iter_N.tmp`` directory, which no load reads. Exit 130.
- A rank that fails decides the exit code: 2 bad input, 3 non-finite loss, 4 lost peer (the ranks
  printed their one ``error:`` line), 1 anything else, instead of torchrun's ChildFailedError
  traceback and exit 1. A rank killed by a signal gives 128 + its number and one line naming it.
- SIGHUP or SIGQUIT: torchrun's own handling (the ranks get the signal), exit 128 + its number.
  An agent that fails itself (its rendezvous store lost with another host) prints one line, exit 4.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a plain checkout

from torch.distributed import run as torchrun  # noqa: E402
from torch.distributed.elastic.multiprocessing.api import SignalException  # noqa: E402
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError  # noqa: E402

from hybrid.processes import child_pids  # noqa: E402

ABORTED = 130   # 128 + SIGINT, what a shell reports for a job stopped by Ctrl-C
LOST = 4        # launch/pretrain_gpt.py's code for lost peers, launcher or rendezvous store


class Stopped(Exception):
    """This command ends now with ``code`` after printing ``line`` (no traceback)."""

    def __init__(self, line: str, code: int):
        super().__init__(line)
        self.line, self.code = line, code


class StopSignals:
    """SIGTERM and SIGINT of the launcher: the first is passed to the ranks (they save and stop), a
    second SIGINT kills them and raises :class:`Stopped` inside the agent's loop."""

    def __init__(self):
        self.first: int | None = None

    def install(self) -> None:
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self.handle)

    def handle(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        ranks = child_pids(os.getpid())
        if self.first is None:
            self.first = signum
            if not ranks:
                raise Stopped(f"launcher: {name} before the ranks started: nothing to save", 0)
            again = " (Ctrl-C again to stop at once without saving)" if signum == signal.SIGINT else ""
            print(f"launcher: {name}: every rank saves a checkpoint and stops{again}",
                  file=sys.stderr, flush=True)
            _send(ranks, signum)
        elif signum == signal.SIGINT:
            _send(ranks, signal.SIGKILL)
            raise Stopped("error: interrupted again: every rank stopped at once without saving; the "
                          "last complete checkpoint is unchanged", ABORTED)


def _send(pids: list[int], signum: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:   # it has just exited
            pass


def ranks_exit_code(err: ChildFailedError) -> tuple[int, str | None]:
    """The job's exit code from the failed ranks: the first that exited with a code of its own,
    else 128 + the signal that killed the first (with a line naming it: it could not print one)."""
    failures = sorted(err.failures.items())
    coded = [(rank, f) for rank, f in failures if f.exitcode > 0]
    if coded:
        return coded[0][1].exitcode, None
    rank, failure = err.get_first_failure()
    signum = -failure.exitcode
    return 128 + signum, (f"error: rank {rank} (pid {failure.pid}) was killed by signal "
                          f"{failure.signal_name()}; the job stopped")


def main(argv: list[str] | None = None) -> int:
    args = torchrun.parse_args(argv)
    args.signals_to_handle = "SIGHUP,SIGQUIT"   # SIGTERM and SIGINT are StopSignals'
    stop = StopSignals()
    stop.install()
    try:
        torchrun.run(args)
    except Stopped as done:
        print(done.line, file=sys.stderr, flush=True)
        return done.code
    except ChildFailedError as err:
        code, line = ranks_exit_code(err)
        if stop.first is not None and code == 128 + stop.first:   # stopped before they could save
            line, code = "launcher: the ranks stopped before training started: nothing to save", 0
        if line is not None:
            print(line, file=sys.stderr, flush=True)
        return code
    except SignalException as err:
        print(f"error: launcher stopped by {signal.Signals(err.sigval).name}", file=sys.stderr,
              flush=True)
        return 128 + err.sigval
    except Exception as err:   # the agent itself failed: its rendezvous or store is gone
        message = " ".join(f"{type(err).__name__}: {err}".split())
        print(f"error: torchrun's agent stopped ({message}); its ranks stop too", file=sys.stderr,
              flush=True)
        return LOST
    return 0


if __name__ == "__main__":
    sys.exit(main())
