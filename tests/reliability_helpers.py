"""Shared pieces of the reliability tests (docs/design.md §10): the CLI of a tiny GPT run on the
corpus of :func:`hybrid.testing.corpus.build_corpus`, the entry point ``launch/pretrain_gpt.py`` loaded
in-process, tree hashes to prove checkpoints are untouched, and a torchrun command line."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENTRY = ROOT / "launch" / "pretrain_gpt.py"
FAULT_ENTRY = Path(__file__).resolve().parent / "fault_entry.py"


def load_entry():
    """``launch/pretrain_gpt.py`` as a module (launch/ is not a package)."""
    spec = importlib.util.spec_from_file_location("pretrain_gpt_entry", ENTRY)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tiny_cli(corpus: dict, cache: Path, iters: int = 2, extra: list[str] = ()) -> list[str]:
    """A ~2-second fp32 run of a 2-layer GPT on the tiny corpus (single process or torchrun)."""
    return ["--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2",
            "--seq-length", "16", "--make-vocab-size-divisible-by", "8",
            "--micro-batch-size", "2", "--train-iters", str(iters), "--eval-iters", "0",
            "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-iters", str(max(iters, 2)),
            "--log-interval", "1", "--seed", "5", "--zero-stage", "1", "--zero-bucket-size", "4000",
            "--data-path", corpus["prefix"], "--tokenizer-model", corpus["tokenizer"],
            "--data-cache-dir", str(cache), *extra]


def tree_hashes(*dirs: Path) -> dict[str, str]:
    """sha256 of every file under ``dirs`` (relative path -> digest): a checkpoint fingerprint."""
    out = {}
    for d in dirs:
        for p in sorted(Path(d).rglob("*")):
            if p.is_file():
                out[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def torchrun(nproc: int, args: list[str], *, max_restarts: int = 0, entry: Path = ENTRY,
             port: int | None = None) -> list[str]:
    """A single-machine torchrun command (rendezvous on localhost)."""
    rdzv = ["--standalone"] if port is None else ["--rdzv-backend", "c10d", "--rdzv-endpoint",
                                                   f"127.0.0.1:{port}"]
    return [sys.executable, "-m", "torch.distributed.run", *rdzv, "--nnodes", "1",
            "--nproc-per-node", str(nproc), "--max-restarts", str(max_restarts), str(entry), *args]


def logged_losses(log: Path) -> dict[int, str]:
    """The LOSS_LOG of tests/fault_entry.py: the last logged loss (repr) of every iteration (a
    restart logs the redone iterations again)."""
    out = {}
    for line in log.read_text().splitlines():
        rec = json.loads(line)
        out[rec["iteration"]] = rec["loss"]
    return out


def run_command(cmd: list[str], timeout: float, **env) -> subprocess.CompletedProcess:
    """``cmd`` from the repository root in the test environment (hybrid.testing's child_env plus
    ``env``), output captured."""
    from hybrid.testing.subprocesses import child_env
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env=child_env(**env))
