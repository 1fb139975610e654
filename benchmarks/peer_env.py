"""A private virtual environment for peer frameworks, so they never become project dependencies.

The environment sees this machine's packages (--system-site-packages: the pinned torch is reused, not
downloaded again) and adds the peers with ``--no-deps``. A benchmark calls :func:`reexec_in_peer_env`
first; it returns only once the running interpreter can import every requested module.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

VENV = Path(__file__).resolve().parent / ".venv-peers"


def reexec_in_peer_env(modules: dict[str, str]) -> None:
    """``modules`` maps an importable module to the pip requirement that provides it."""
    missing = {m: req for m, req in modules.items() if importlib.util.find_spec(m.split(".")[0]) is None}
    if not missing:
        return
    python = VENV / "bin" / "python"
    if Path(sys.executable) == python:
        raise SystemExit(f"peer environment {VENV} still lacks {sorted(missing)}; delete it and retry")
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(VENV)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", *missing.values()], check=True)
    os.execv(str(python), [str(python), *sys.argv])
