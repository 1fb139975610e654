"""A real 4-rank training run under context parallelism (issue 31): the README's tiny-cpu model on
the embedded default corpus at sequence 2048, CP 2 x TP 2 with --reset-position-ids and
--reset-attention-mask (ring attention over document-masked packed samples), launched by torchrun
through the trainer's entry point. The loss falls, and the run's checkpoint resumes at CP 1 x DP 2
(same TP): its next losses continue the uninterrupted CP 2 run's (fp32, rtol 1e-4: the same
arithmetic in another order)."""

import json

import pytest

from tests.reliability_helpers import FAULT_ENTRY, run_command, torchrun

ITERS, SAVED = 8, 4


def _args(tmp_path, cp: int, extra: list[str]) -> list[str]:
    return ["--config", "tiny-cpu", "--no-bf16", "--seq-length", "2048",
            "--max-position-embeddings", "2048", "--context-parallel-size", str(cp),
            "--reset-position-ids", "--reset-attention-mask", "--eod-mask-loss",
            "--micro-batch-size", "1", "--global-batch-size", "2", "--train-iters", str(ITERS),
            "--lr-warmup-iters", "1", "--lr-decay-iters", str(ITERS), "--eval-iters", "0",
            "--log-interval", "1", "--tensorboard-dir", str(tmp_path / "runs"),
            "--data-cache-dir", "data-cache", *extra]


def _losses(path) -> dict[int, float]:
    return {r["iteration"]: float(r["loss"]) for r in map(json.loads, path.read_text().splitlines())}


@pytest.mark.slow
def test_cp2_tp2_document_masked_run_trains_and_resumes_at_cp1(tmp_path):
    ckpt = tmp_path / "ckpt"
    first = run_command(torchrun(4, _args(tmp_path, 2, ["--save", str(ckpt), "--save-interval",
                                                         str(SAVED)]), entry=FAULT_ENTRY),
                        timeout=1500, LOSS_LOG=str(tmp_path / "cp2.jsonl"))
    assert first.returncode == 0, first.stderr[-3000:]
    cp2 = _losses(tmp_path / "cp2.jsonl")
    assert sorted(cp2) == list(range(1, ITERS + 1))
    assert cp2[ITERS] < cp2[1] - 0.5, cp2                     # it learns
    resumed = run_command(torchrun(4, _args(tmp_path, 1, ["--load", f"{ckpt}/iter_{SAVED:07d}",
                                                           "--save", str(tmp_path / "ckpt1")]),
                                   entry=FAULT_ENTRY),
                          timeout=1500, LOSS_LOG=str(tmp_path / "cp1.jsonl"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    cp1 = _losses(tmp_path / "cp1.jsonl")
    assert sorted(cp1) == list(range(SAVED + 1, ITERS + 1))
    for i in cp1:   # CP 1 x DP 2 continues the CP 2 x DP 1 curve
        assert cp1[i] == pytest.approx(cp2[i], rel=1e-4), (i, cp1, cp2)
