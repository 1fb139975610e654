"""Private virtual environments for peer frameworks, so they never become project dependencies.

A peer venv is created from the base interpreter WITHOUT system site packages (the system python
has no torch). It gets, in this order:

1. ``torch==2.13.0`` alone, so pip takes this machine's local CPU wheel (an unpinned torch is
   several GB of CUDA packages);
2. the project's ``requirements.txt`` and the peers, under a constraint file pinning
   ``torch==2.13.0``, so no peer can swap the torch underneath (``--no-deps`` peers skip their own
   dependency resolution, e.g. megatron-core).

The project itself is importable there through ``sys.path`` (the benchmarks insert the repo root),
not installed. ``DS_BUILD_OPS=0`` keeps DeepSpeed from compiling its C++ ops at install time (they
are JIT-built on first use, then cached); ``DS_ACCELERATOR=cpu`` makes it run without CUDA.

A benchmark calls :func:`reexec_in_venv` (or :func:`reexec_in_peer_env`) first: it returns only once
the running interpreter can import every requested module, re-running the script inside the venv
otherwise, or raises :class:`PeerEnvError` saying why the venv could not be made.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VENV = Path(__file__).resolve().parent / ".venv-peers"
TORCH_PIN = "torch==2.13.0"   # must equal requirements.txt's pin
PEER_ENV = {"DS_BUILD_OPS": "0", "DS_ACCELERATOR": "cpu"}


class PeerEnvError(RuntimeError):
    """The peer venv could not be created or lacks a module after installing."""


def _importable(modules: list[str]) -> bool:
    return all(importlib.util.find_spec(m.split(".")[0]) is not None for m in modules)


def _running_in(venv: Path) -> bool:
    return Path(sys.prefix).resolve() == venv.resolve()


def ensure_venv(venv: Path, modules: dict[str, str], *, no_deps: bool = False,
                timeout: float | None = None) -> Path:
    """Create ``venv`` if needed and install what ``modules`` (importable name -> pip requirement)
    lists, torch pinned (see the module docstring). Returns the venv's python."""
    python = venv / "bin" / "python"
    env = {**os.environ, **PEER_ENV}
    probe = "import " + ", ".join(sorted({m.split(".")[0] for m in [*modules, "torch", "numpy"]}))
    try:
        if python.exists() and subprocess.run([str(python), "-c", probe], env=env,
                                              capture_output=True, timeout=timeout).returncode == 0:
            return python
        if not python.exists():
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=timeout)
        pip = [str(python), "-m", "pip", "install", "-q"]
        subprocess.run([*pip, TORCH_PIN], check=True, env=env, timeout=timeout)
        constraint = venv / "constraints.txt"
        constraint.write_text(TORCH_PIN + "\n")
        subprocess.run([*pip, "-c", str(constraint), "-r", str(ROOT / "requirements.txt")],
                       check=True, env=env, timeout=timeout)
        subprocess.run([*pip, "-c", str(constraint), *(["--no-deps"] if no_deps else []),
                        *modules.values()], check=True, env=env, timeout=timeout)
        done = subprocess.run([str(python), "-c", probe], env=env, capture_output=True, text=True,
                              timeout=timeout)
    except (OSError, subprocess.CalledProcessError, subprocess.TimeoutExpired) as err:
        raise PeerEnvError(f"could not set up {venv}: {err}") from err
    if done.returncode:
        raise PeerEnvError(f"{venv} still cannot run `{probe}`: "
                           f"{(done.stderr.strip().splitlines() or ['?'])[-1]}")
    return python


def reexec_in_venv(venv: Path, modules: dict[str, str], *, no_deps: bool = False) -> None:
    """Return if the running interpreter imports ``modules``; otherwise make ``venv`` and re-run
    this script (same argv) inside it with :data:`PEER_ENV` set. Raises PeerEnvError."""
    if _importable(list(modules)):
        os.environ.update(PEER_ENV)
        return
    if _running_in(venv):
        raise PeerEnvError(f"{venv} lacks {sorted(modules)}; delete it and retry")
    python = ensure_venv(venv, modules, no_deps=no_deps)
    os.execve(str(python), [str(python), *sys.argv], {**os.environ, **PEER_ENV})


def reexec_in_peer_env(modules: dict[str, str]) -> None:
    """``modules`` maps an importable module to the pip requirement that provides it (installed
    ``--no-deps`` into benchmarks/.venv-peers)."""
    missing = {m: req for m, req in modules.items() if not _importable([m])}
    if missing:
        reexec_in_venv(VENV, missing, no_deps=True)
