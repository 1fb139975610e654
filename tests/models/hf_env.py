"""The test-only Python environment with Hugging Face transformers (not a project dependency).

transformers is installed into its own venv (``--system-site-packages`` plus a .pth file, so it reuses
this interpreter's torch and safetensors) under ``$HYBRID_CACHE/hf-venv-<key>`` (default
./data-cache; one per parent interpreter). Building it downloads packages, so the default test suite
never does: ``launch/run_tests.sh`` builds it before pytest runs (``python -m tests.models.hf_env``), and a
test that needs it and finds no environment is skipped with the command that builds it.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import site
import subprocess
import sys
from pathlib import Path

from hybrid.data.default_corpus import default_cache_dir

PACKAGES = ("transformers",)


def env_dir() -> Path:
    key = hashlib.sha256(sys.prefix.encode()).hexdigest()[:10]     # one venv per parent interpreter
    return default_cache_dir().resolve() / f"hf-venv-{key}"


def ready_python() -> str | None:
    """Python of the built environment, or None when it has not been built."""
    final = env_dir()
    return str(final / "bin" / "python") if (final / ".ready").is_file() else None


def build() -> str:
    """Create the environment once (concurrent builders race safely); return its python."""
    return build_venv(env_dir(), list(PACKAGES))


def build_venv(final: Path, pip_args: list[str]) -> str:
    """A venv at ``final`` over this interpreter's packages with ``pip install pip_args`` added,
    built once (concurrent builders race safely; a ``.ready`` file marks it complete)."""
    ready = final / "bin" / "python"
    if (final / ".ready").is_file():
        return str(ready)
    tmp = final.with_name(f".tmp-{final.name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(tmp)], check=True,
                   capture_output=True)
    # If this interpreter is itself a venv (launch/run_tests.sh's .venv), --system-site-packages
    # reaches the base Python only: a .pth file puts this torch, safetensors, ... on the path too.
    purelib = subprocess.run([str(tmp / "bin" / "python"), "-c",
                              "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    Path(purelib, "_hybrid_parent.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    result = subprocess.run([str(tmp / "bin" / "python"), "-m", "pip", "install", "-q",
                             "--disable-pip-version-check", *pip_args],
                            capture_output=True, text=True, timeout=900)
    if result.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        raise RuntimeError(f"pip install {' '.join(pip_args)} failed:\n{result.stderr[-2000:]}")
    (tmp / ".ready").write_text(" ".join(pip_args) + "\n")
    try:
        os.rename(tmp, final)
    except OSError:                        # another process finished first: use theirs
        shutil.rmtree(tmp, ignore_errors=True)
    return str(ready)


if __name__ == "__main__":
    try:
        print(build())
    except (RuntimeError, subprocess.SubprocessError) as err:   # no index: the tests needing it skip
        print(f"warning: the transformers test environment was not built: {err}", file=sys.stderr)
