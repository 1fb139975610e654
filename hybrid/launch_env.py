"""The launcher's environment, read once: what torchrun (or a plain ``env://`` launcher) tells a rank.

torchrun starts every rank with ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
``MASTER_ADDR``/``MASTER_PORT`` (its c10d store) and ``TORCHELASTIC_*`` (restart count, run id,
whether the store is the agent's). :meth:`LaunchEnv.from_environ` is the one parser of these
variables: entry points build it once and pass it down (to
:meth:`hybrid.parallel_state.ParallelState.from_launch_env` and the liveness watch); nothing else in
the framework reads them. A malformed value is a :class:`LaunchEnvError` naming the variable.
:func:`without_launcher_variables` removes them from the environment of a child process that is
not a rank of the job.

Without any of them a program runs as one process (``world_size`` 1, not :attr:`distributed`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass


class LaunchEnvError(ValueError):
    """A launcher variable with a value no launcher writes; the message names it and the fix."""


@dataclass(frozen=True)
class LaunchEnv:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int | None = None   # ranks on this host (torchrun --nproc-per-node)
    master_addr: str | None = None        # host of the c10d store
    master_port: int | None = None
    restart_count: int = 0                # torchrun --max-restarts: which attempt this is
    agent_store: bool = False             # the store is torchrun's agent's, not rank 0's
    run_id: str | None = None             # set by torchrun only
    error_file: str | None = None         # where torchrun's agent reads this rank's failure message

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise LaunchEnvError(f"WORLD_SIZE={self.world_size} must be at least 1")
        if not 0 <= self.rank < self.world_size:
            raise LaunchEnvError(f"RANK={self.rank} is outside the job's WORLD_SIZE={self.world_size} "
                                 f"ranks; launch with torchrun, which sets both")
        if self.local_world_size is not None and not 0 <= self.local_rank < self.local_world_size:
            raise LaunchEnvError(f"LOCAL_RANK={self.local_rank} is outside LOCAL_WORLD_SIZE="
                                 f"{self.local_world_size}; launch with torchrun, which sets both")
        if self.master_port is not None and not 0 < self.master_port < 65536:
            raise LaunchEnvError(f"MASTER_PORT={self.master_port} is not a TCP port (1-65535)")

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> "LaunchEnv":
        """Parse ``environ`` (default ``os.environ``); absent variables take the one-process values."""
        env = os.environ if environ is None else environ
        return cls(rank=_int(env, "RANK", 0), world_size=_int(env, "WORLD_SIZE", 1),
                   local_rank=_int(env, "LOCAL_RANK", 0),
                   local_world_size=_int(env, "LOCAL_WORLD_SIZE", None),
                   master_addr=env.get("MASTER_ADDR") or None,
                   master_port=_int(env, "MASTER_PORT", None),
                   restart_count=_int(env, "TORCHELASTIC_RESTART_COUNT", 0),
                   agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
                   run_id=env.get("TORCHELASTIC_RUN_ID") or None,
                   error_file=env.get("TORCHELASTIC_ERROR_FILE") or None)

    @property
    def distributed(self) -> bool:
        """Whether this process joins a process group (several ranks, or one rank told where to meet)."""
        return self.world_size > 1 or self.master_addr is not None

    @property
    def under_torchrun(self) -> bool:
        """Started by a torchrun agent, which stays this process's parent for the job's lifetime."""
        return self.run_id is not None


# The launcher's variables are the names that start with one of these (MASTER_ADDR, LOCAL_RANK, ...).
_LAUNCHER_PREFIXES = ("RANK", "WORLD_SIZE", "MASTER_", "LOCAL_", "TORCHELASTIC")


def without_launcher_variables(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` without the launcher's variables: the environment of a child process (a tool, another
    torchrun job) that must not take itself for a rank of this one."""
    return {k: v for k, v in env.items() if not k.startswith(_LAUNCHER_PREFIXES)}


def _int(env: Mapping[str, str], name: str, default):
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise LaunchEnvError(f"environment variable {name}={raw!r} is not an integer; launch with "
                             f"torchrun (it sets RANK, WORLD_SIZE, LOCAL_RANK, ...) or unset it") from None
