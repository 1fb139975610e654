"""A real 4-rank training run of a MoE GPT under expert parallelism (issue 32, "a real trainer run
(EP 2 x TP 2, ZeRO 1) ... resumes at EP 1"): the README's tiny-cpu model with every layer a MoE
layer (4 SwiGLU experts, top-2 sigmoid routing with DeepSeek-V3's expert bias and an aux loss),
fp32, on the embedded default corpus, TP 2 x DP 2 with EP 2 (each expert on one of the two DP
ranks) and ZeRO 1, launched by torchrun through the trainer's entry point. The loss falls, and the
run's checkpoint (expert shards, their ZeRO moments and the expert biases) resumes at EP 1 (same TP
and DP: every rank holds all 4 experts): its next losses continue the uninterrupted EP 2 run's
(rtol 1e-4: the same arithmetic, the experts' tokens reduced in another order)."""

import json

import pytest

from tests.reliability_helpers import FAULT_ENTRY, run_command, torchrun

ITERS, SAVED = 8, 4
MOE = ["--swiglu", "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "128",
       "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
       "--moe-router-bias-update-rate", "0.01", "--moe-aux-loss-coeff", "0.01"]


def _args(tmp_path, ep: int, extra: list[str]) -> list[str]:
    return ["--config", "tiny-cpu", "--no-bf16", "--zero-stage", "1", *MOE,
            "--expert-model-parallel-size", str(ep), "--train-iters", str(ITERS),
            "--lr-warmup-iters", "1", "--lr-decay-iters", str(ITERS), "--eval-iters", "0",
            "--log-interval", "1", "--tensorboard-dir", str(tmp_path / "runs"),
            "--data-cache-dir", "data-cache", *extra]


def _losses(path) -> dict[int, float]:
    rows = map(json.loads, path.read_text().splitlines())
    return {r["iteration"]: float(r["loss"]) for r in rows}


@pytest.mark.slow
def test_ep2_tp2_zero1_run_trains_and_resumes_at_ep1(tmp_path):
    ckpt = tmp_path / "ckpt"
    first = run_command(torchrun(4, _args(tmp_path, 2, ["--save", str(ckpt), "--save-interval",
                                                         str(SAVED)]), entry=FAULT_ENTRY),
                        timeout=1500, LOSS_LOG=str(tmp_path / "ep2.jsonl"))
    assert first.returncode == 0, first.stderr[-3000:]
    ep2 = _losses(tmp_path / "ep2.jsonl")
    assert sorted(ep2) == list(range(1, ITERS + 1))
    assert ep2[ITERS] < ep2[1] - 0.5, ep2                     # it learns
    resumed = run_command(torchrun(4, _args(tmp_path, 1, ["--load", f"{ckpt}/iter_{SAVED:07d}",
                                                           "--save", str(tmp_path / "ckpt1")]),
                                   entry=FAULT_ENTRY),
                          timeout=1500, LOSS_LOG=str(tmp_path / "ep1.jsonl"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    ep1 = _losses(tmp_path / "ep1.jsonl")
    assert sorted(ep1) == list(range(SAVED + 1, ITERS + 1))
    for i in ep1:   # EP 1 continues the EP 2 curve
        assert ep1[i] == pytest.approx(ep2[i], rel=1e-4), (i, ep1, ep2)
