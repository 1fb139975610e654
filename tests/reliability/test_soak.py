"""Soak (slow, outside CI): a long CPU run of ``launch/pretrain_gpt.py`` under torchrun (TP 1 x DP 2)
with periodic checkpoints, cut into three launches by ``--exit-duration-in-mins`` (a clean stop
saves a checkpoint) so the run goes through two forced resumes.

Checks: rank 0's resident memory is flat after warm-up in every launch (growth < 2 %: no leak per
step, per save or per log line); the iterations of the three launches join without a gap or a repeat;
no loss jump at a resume exceeds the largest step-to-step change inside a launch; the loss falls.

    SOAK_MINUTES=30 python -m pytest -q -s -m slow tests/reliability/test_soak.py     # default 30 minutes
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from hybrid.checkpoint import read_latest
from hybrid.testing.corpus import build_corpus
from hybrid.testing.subprocesses import child_env
from tests.reliability_helpers import FAULT_ENTRY, ROOT, tiny_cli, torchrun

pytestmark = pytest.mark.slow
MINUTES = float(os.environ.get("SOAK_MINUTES", "30"))
LAUNCHES = 3
WARMUP = 0.25          # share of each launch's RSS samples treated as warm-up
MAX_GROWTH = 0.02


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _rss_growth(rss: list[int]) -> float:
    """Max RSS after warm-up relative to RSS at the end of warm-up."""
    start = int(len(rss) * WARMUP)
    base = rss[start]
    return max(rss[start:]) / base - 1.0


def test_soak_memory_flat_losses_continuous(tmp_path):
    corpus = build_corpus(tmp_path / "corpus")
    save = tmp_path / "ckpt"
    per_launch = MINUTES / LAUNCHES
    iters = int(MINUTES * 60 * 1000)   # never reached (~80 it/s here): launches stop on their clocks
    args = tiny_cli(corpus, tmp_path / "cache", iters=iters,
                    extra=["--global-batch-size", "4", "--save", str(save), "--load", str(save),
                           "--save-interval", "200", "--log-interval", "200",
                           "--exit-duration-in-mins", f"{per_launch:.3f}"])
    per_launch_records = []
    for launch in range(LAUNCHES):
        log = tmp_path / f"loss{launch}.jsonl"
        with open(tmp_path / f"out{launch}.log", "w") as out:
            proc = subprocess.run(torchrun(2, args, entry=FAULT_ENTRY), cwd=ROOT, stdout=out,
                                  stderr=subprocess.STDOUT, timeout=per_launch * 60 + 300,
                                  env=child_env(LOSS_LOG=str(log)))
        assert proc.returncode == 0, (tmp_path / f"out{launch}.log").read_text()[-3000:]
        per_launch_records.append(_records(log))
        assert read_latest(save) == f"iter_{per_launch_records[-1][-1]['iteration']:07d}"

    iterations = [r["iteration"] for recs in per_launch_records for r in recs]
    assert iterations == list(range(1, len(iterations) + 1))      # no gap, no repeat
    losses = [float(r["loss"]) for recs in per_launch_records for r in recs]
    inner = max(abs(b - a) for recs in per_launch_records
                for a, b in zip([float(r["loss"]) for r in recs], [float(r["loss"]) for r in recs[1:]]))
    bounds = [len(recs) for recs in per_launch_records]
    joins = [sum(bounds[:k]) for k in range(1, LAUNCHES)]
    jumps = [abs(losses[j] - losses[j - 1]) for j in joins]
    assert max(jumps) <= inner, (jumps, inner)
    tenth = max(1, len(losses) // 10)
    first, last = sum(losses[:tenth]) / tenth, sum(losses[-tenth:]) / tenth
    assert last < first

    growths = []
    for recs in per_launch_records:
        rss = [r["rss"] for r in recs if "rss" in r]
        assert len(rss) >= 8, "launch too short to judge memory; raise SOAK_MINUTES"
        growths.append(_rss_growth(rss))
    print(f"soak {MINUTES:g} min: {len(losses)} iterations in {LAUNCHES} launches, loss "
          f"{first:.3f} -> {last:.3f}, resume jumps {[round(j, 4) for j in jumps]} (max step "
          f"change {inner:.4f}), rank-0 RSS growth after warm-up "
          f"{[f'{100 * g:.2f}%' for g in growths]}, RSS {rss[0] / 2**20:.0f}-{max(rss) / 2**20:.0f} MiB")
    assert max(growths) < MAX_GROWTH
