"""How every tool in tools/ fails and where it may write (docs/design.md §9; docs/troubleshooting.md).

Bad input ends a tool the way it ends the trainer: one ``error: <problem>; <fix>`` line on stderr,
exit status 2, no traceback, nothing written. :func:`run_cli` maps the error classes that mean bad
input (``ValueError`` and its subclasses such as TrainConfigError, ConfigError, IndexedDatasetError,
TokenizerError; ``OSError`` for paths; CheckpointError) to that line; anything else is a bug and
keeps its traceback. :class:`ArgumentParser` turns argparse's usage-and-exit into the same line.

Outputs never clobber: :func:`check_output_dir` and :func:`check_output_files` refuse, before any
work, to write into a non-empty directory or over existing files unless ``--overwrite`` is given,
and always refuse to write onto the tool's own input; with ``--overwrite`` only the files the tool
writes are replaced (:func:`install_files`).
"""

from __future__ import annotations

import argparse
import errno
import os
import shutil
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterable, Iterator

BAD_INPUT = 2
# OSErrors that mean a wrong path or permission (bad input); others (disk full, I/O) exit 1.
_PATH_ERRNOS = {errno.ENOENT, errno.ENOTDIR, errno.EISDIR, errno.EACCES, errno.EPERM, errno.EEXIST,
                errno.EROFS, errno.ENAMETOOLONG}


class ToolError(ValueError):
    """Bad input a tool found itself; the message names the problem and the fix."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose errors raise :class:`ToolError` (one line) instead of printing usage."""

    def error(self, message: str):
        raise ToolError(f"{message}; run with --help for the list of flags")


def run_cli(main: Callable[[list[str] | None], int | None], argv: list[str] | None = None) -> int:
    """``main(argv)``'s exit status; a bad-input error becomes one ``error:`` line and status 2."""
    try:
        return main(argv) or 0
    except Exception as err:   # noqa: BLE001  (re-raised below unless it is bad input)
        status = _status_of(err)
        if status is None:
            raise
        print("error: " + error_message(err), file=sys.stderr, flush=True)
        return status


def _status_of(err: Exception) -> int | None:
    if isinstance(err, OSError):
        return BAD_INPUT if err.errno in _PATH_ERRNOS or err.errno is None else 1
    if isinstance(err, ValueError):
        return BAD_INPUT
    checkpoint = sys.modules.get("hybrid.checkpoint.format")   # loaded if a checkpoint was read
    if checkpoint is not None and isinstance(err, checkpoint.CheckpointError):
        return BAD_INPUT
    return None


def error_message(err: Exception) -> str:
    """One line: the error's own message, or for a bare OSError the path and what is wrong."""
    if isinstance(err, OSError) and err.strerror and err.filename is not None:
        text = f"{err.filename}: {err.strerror}; check the path and its permissions"
    else:
        text = str(err)
    return " ".join(text.split())


def require(condition: bool, message: str) -> None:
    """Raise :class:`ToolError` with ``message`` unless ``condition``."""
    if not condition:
        raise ToolError(message)


def positive(parser_value: str) -> int:
    """argparse ``type=`` for counts that must be >= 1."""
    value = int(parser_value)
    if value < 1:
        raise ValueError(parser_value)
    return value


# ---- outputs --------------------------------------------------------------------------------------

def _overlaps(a: Path, b: Path) -> bool:
    a, b = a.resolve(), b.resolve()
    return a == b or a in b.parents or b in a.parents


def check_output_dir(out: Path, *, flag: str, inputs: Iterable[Path], overwrite: bool,
                     writes: Iterable[str]) -> None:
    """``out`` may receive the files ``writes``: it is not a file, not one of ``inputs`` (nor inside
    or around one), and empty unless ``overwrite``."""
    for source in inputs:
        require(not _overlaps(out, Path(source)),
                f"{flag} {out} overlaps the input {source}; writing there would mix the output "
                f"with (or delete) what is being read - choose another directory")
    require(not out.exists() or out.is_dir(), f"{flag} {out} is a file; pass a directory")
    present = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if present and not overwrite:
        shown = ", ".join(present[:4]) + (" ..." if len(present) > 4 else "")
        raise ToolError(f"{flag} {out} is not empty ({shown}); choose a new directory, or pass "
                        f"--overwrite to replace only the files this tool writes "
                        f"({', '.join(sorted(writes))})")


def check_output_files(outputs: Iterable[Path], *, flag: str, inputs: Iterable[Path],
                       overwrite: bool) -> None:
    """Each of ``outputs`` is not an input and, unless ``overwrite``, does not exist yet; its
    directory exists or can be created."""
    outputs, inputs = [Path(p) for p in outputs], [Path(p) for p in inputs]
    for out in outputs:
        for source in inputs:
            require(out.resolve() != source.resolve(),
                    f"{flag} would write {out}, which is an input; choose another output name")
        require(not out.is_dir(), f"{flag} would write {out}, which is a directory; choose "
                                  f"another output name")
    existing = [str(p) for p in outputs if p.exists()]
    if existing and not overwrite:
        verb = "already exists" if len(existing) == 1 else "already exist"
        raise ToolError(f"{flag}: {', '.join(existing)} {verb}; choose another name, or pass "
                        f"--overwrite to replace {'it' if len(existing) == 1 else 'them'}")
    parent = outputs[0].parent
    for ancestor in (parent, *parent.parents):
        if ancestor.exists():
            require(ancestor.is_dir(), f"{flag}: {ancestor} is a file, so {parent} cannot be "
                                       f"created; choose another output location")
            break


@contextmanager
def staging_dir(near: Path) -> Iterator[Path]:
    """A fresh directory beside ``near`` (same filesystem, so files move by rename), removed
    afterwards whatever happens."""
    near.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{near.name}.staging-", dir=near.parent))
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def install_files(staged: Path, out: Path, replaces: Iterable[str]) -> None:
    """Move every file of ``staged`` into ``out``; first remove the files named ``replaces`` that
    ``out`` holds (a previous run's output) and nothing else."""
    out.mkdir(parents=True, exist_ok=True)
    for name in replaces:
        if (out / name).is_file():
            (out / name).unlink()
    for f in sorted(staged.iterdir()):
        os.replace(f, out / f.name)
