"""torchrun for the launch scripts: its flags and its agent, with stops and failures a scheduler reads.

    python launch/torchrun.py --standalone --nproc-per-node 4 launch/pretrain_gpt.py --config tiny-cpu

torchrun's own command-line parser and agent run in this process (``torch.distributed.run``); four
things differ, so that the command a user or a scheduler ran ends the way the job ended:

- Before torch is imported or any rank starts, the trainer's arguments are parsed and checked
  against ``--nnodes`` x ``--nproc-per-node`` (pretrain/preflight.py): a config or layout error (a
  TP group larger than a host, a batch the world size cannot split) is one ``error:`` line, exit 2,
  within a second, on every host before its rendezvous.

- SIGTERM (preemption, ``scancel``, a time limit) or SIGINT (Ctrl-C) goes to every rank of this
  host, and the ranks agree to save a checkpoint and stop (pretrain/exit.py): they exit 0 and
  so does this command. torchrun itself would also pass the signal on, but then exit 1 with a
  traceback. A second Ctrl-C stops every rank at once (SIGKILL): nothing more is written, and a save
  cut short leaves only its ``iter_N.tmp`` directory, which no load reads. Exit 130.
- A rank that fails decides the exit code: 2 bad input, 3 non-finite loss, 4 lost peer (the ranks
  printed their one ``error:`` line), 1 anything else, instead of torchrun's ChildFailedError
  traceback and exit 1. A rank killed by a signal gives 128 + its number and one line naming it.
- The trainer's ``--max-restarts N`` is torchrun's ``--max-restarts N`` too: a failed rank makes
  torchrun restart them all, and the restarted job resumes from ``--save`` (pretrain/restarts.py).
- SIGHUP or SIGQUIT: torchrun's own handling (the ranks get the signal), exit 128 + its number.
  An agent that fails itself (its rendezvous store lost with another host) prints one line, exit 4.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a plain checkout

from hybrid.processes import child_pids  # noqa: E402

if TYPE_CHECKING:   # torch is imported once the command is checked (check_before_launch)
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

TRAINER = "pretrain_gpt.py"   # the entry point whose arguments are checked before launching
BAD_INPUT = 2   # launch/pretrain_gpt.py's code for bad input

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


def trainer_launch(argv: list[str]) -> tuple[list[str], int | None, int | None] | None:
    """(the trainer's arguments, hosts, ranks per host) of a torchrun command line that runs
    launch/pretrain_gpt.py, else None. A count fixed only at the rendezvous (``--nnodes 1:4``,
    ``--nproc-per-node gpu``) is None. torchrun reads unset flags from ``PET_*`` variables."""
    script = next((i for i, arg in enumerate(argv) if Path(arg).name == TRAINER), None)
    if script is None:
        return None
    flags = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    flags.add_argument("--nnodes", default=os.environ.get("PET_NNODES", "1:1"))
    flags.add_argument("--nproc-per-node", "--nproc_per_node",
                       default=os.environ.get("PET_NPROC_PER_NODE", "1"))
    flags.add_argument("--standalone", action="store_true")
    ns, _ = flags.parse_known_args(argv[:script])
    low, _, high = ns.nnodes.partition(":")
    nnodes = 1 if ns.standalone else _count(low) if _count(low) == _count(high or low) else None
    return argv[script + 1:], nnodes, _count(ns.nproc_per_node)


def _count(text: str) -> int | None:
    return int(text) if text.isdigit() else None


def check_before_launch(argv: list[str]) -> int | None:
    """The trainer's config and layout checked in this process before any rank starts (no torch
    imported yet): its exit code after one ``error:`` line, else None (launch)."""
    launch = trainer_launch(argv)
    if launch is None:
        return None
    from pretrain.preflight import check_command
    try:
        check_command(*launch)
    except ValueError as err:   # TrainConfigError, TopologyError, ConfigError
        print("error: " + " ".join(str(err).split()), file=sys.stderr, flush=True)
        return BAD_INPUT
    return None


def with_trainer_restarts(argv: list[str]) -> list[str]:
    """The trainer's ``--max-restarts N`` (after launch/pretrain_gpt.py) is carried out by torchrun:
    it is added to torchrun's flags (before the script) unless they give it already; a different
    count there is bad input (ValueError). pretrain/restarts.py has the resume side."""
    script = next((i for i, arg in enumerate(argv) if Path(arg).name == TRAINER), None)
    if script is None:
        return argv
    asked = _flag_value(argv[script + 1:], "--max-restarts")
    if asked is None:
        return argv
    given = _flag_value(argv[:script], "--max-restarts", "--max_restarts")
    if given is None:
        return ["--max-restarts", asked, *argv]
    if given != asked:
        raise ValueError(f"torchrun --max-restarts {given} and the trainer's --max-restarts {asked} "
                         f"disagree; give it once (after the script, or to torchrun)")
    return argv


def _flag_value(args: list[str], *names: str) -> str | None:
    for i, arg in enumerate(args):
        for name in names:
            if arg == name and i + 1 < len(args):
                return args[i + 1]
            if arg.startswith(name + "="):
                return arg.partition("=")[2]
    return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    code = check_before_launch(argv)
    if code is not None:
        return code
    try:
        argv = with_trainer_restarts(argv)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return BAD_INPUT
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
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
