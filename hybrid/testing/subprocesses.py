"""The environment of a child process started by a test or a benchmark (a torchrun job, a tool, a
host of the network-namespace test bed): not a rank of the calling job, one intra-op thread, the
framework importable."""

from __future__ import annotations

import os
from pathlib import Path

from hybrid.launch_env import without_launcher_variables

ROOT = Path(__file__).resolve().parents[2]   # the directory holding the hybrid package


def child_env(**extra: str) -> dict[str, str]:
    """``os.environ`` without the launcher's variables of the calling rank, with one intra-op thread,
    the framework on ``PYTHONPATH`` and ``extra``."""
    env = without_launcher_variables(os.environ)
    env.update({"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
                "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "5"}, **extra)
    return env
