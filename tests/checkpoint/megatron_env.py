"""The test-only Python environment with megatron-core (not a project dependency).

megatron-core 0.16.1 is installed ``--no-deps`` (its declared dependencies are CUDA stacks it does
not need on CPU) into a venv over this interpreter's packages (torch, numpy, packaging, ...: see
:func:`tests.models.hf_env.build_venv`), with psutil, the one small extra package it imports when it writes
a ``torch_dist`` checkpoint. It lives under ``$HYBRID_CACHE/megatron-venv-<key>`` (default
./data-cache), built by ``launch/run_tests.sh`` before pytest (``python -m tests.checkpoint.megatron_env``) or
by the first test that needs it (one 2.6 MB wheel): a test never skips for want of it.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

from hybrid.data.default_corpus import default_cache_dir
from tests.models.hf_env import build_venv

PIP_ARGS = ("--no-deps", "megatron-core==0.16.1", "psutil")


def env_dir() -> Path:
    key = hashlib.sha256(sys.prefix.encode()).hexdigest()[:10]     # one venv per parent interpreter
    return default_cache_dir().resolve() / f"megatron-venv-{key}"


def build() -> str:
    """The environment's python, built once (concurrent builders race safely)."""
    return build_venv(env_dir(), list(PIP_ARGS))


def put_on_path() -> None:
    """Make megatron-core importable in this process: build the environment if needed, then put
    its own packages (megatron-core and psutil; pure Python) on ``sys.path``. For tests that call
    megatron-core in-process (tests/data/test_megatron_compat.py) instead of in a subprocess."""
    python = Path(build())
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    if purelib not in sys.path:
        sys.path.append(purelib)


if __name__ == "__main__":
    try:
        print(build())
    except (RuntimeError, subprocess.SubprocessError) as err:   # the tests needing it say why
        print(f"warning: the megatron-core test environment was not built: {err}", file=sys.stderr)
