"""A real trainer run of a MoE GPT (issue 32): the MoE scalars of docs/tensorboard.md reach the
JSON-lines log (and so every logger backend), their values agree with each other, and the
expert biases of DeepSeek-V3's balancing move during training, are saved with the checkpoint and
come back on resume (one rank, 3 iterations, then a resumed trainer built)."""

import json

import pytest
import torch

from hybrid.testing.multirank import run_on_ranks
from tests.training_helpers import make_trainer, tiny_args

MOE = ["--swiglu", "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32",
       "--moe-layer-freq", "0", "1", "--moe-router-score-function", "sigmoid",
       "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "0.01",
       "--moe-aux-loss-coeff", "0.01", "--moe-z-loss-coeff", "0.001",
       "--moe-expert-capacity-factor", "1.0", "--log-interval", "1"]


def _run(rank, world_size, work):
    first = make_trainer(tiny_args(iters=3, extra=MOE + ["--save", f"{work}/ckpt", "--jsonl-log",
                                                         f"{work}/log.jsonl"]))
    first.train()
    bias = first.model.expert_biases()[1].clone()
    resumed = make_trainer(tiny_args(iters=3, extra=MOE + ["--load", f"{work}/ckpt", "--save",
                                                           f"{work}/ckpt2"]))
    loaded = resumed.model.expert_biases()[1].clone()
    return bias.tolist(), loaded.tolist()


pytestmark = pytest.mark.slow   # two trainer builds and 3 iterations: ~12 s of CPU


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    work = tmp_path_factory.mktemp("moe")
    bias, loaded = run_on_ranks(_run, 1, args=(str(work),), timeout=300)[0]
    rows = [json.loads(line) for line in open(work / "log.jsonl") if line.strip()]
    return bias, loaded, [r["metrics"] for r in rows if "metrics" in r and "lm loss" in r["metrics"]]


def test_moe_scalars_are_logged_and_consistent(run):
    _, _, steps = run
    assert len(steps) == 3
    for m in steps:
        counts = [m[f"moe/layer1/tokens-per-expert/{e}"] for e in range(4)]
        # 2 micro-batches x 16 tokens x top-2 per micro-batch: 64 routes (micro-batch 2, seq 16)
        assert sum(counts) == pytest.approx(2 * 16 * 2)
        assert m["moe/layer1/load-max-over-mean"] == pytest.approx(max(counts) / (sum(counts) / 4))
        assert m["moe/load-max-over-mean"] == m["moe/layer1/load-max-over-mean"]
        assert 0 < m["moe/aux-loss"] < 0.1 and 0 < m["moe/z-loss"] < 0.1
        assert 0 <= m["moe/dropped-fraction"] < 1
        assert not any(k.startswith("moe/layer0") for k in m)   # layer 0 is dense


def test_expert_bias_trains_and_resumes(run):
    bias, loaded, _ = run
    # three updates of +-0.01 (0 where an expert's load is the mean): an odd number of moves
    assert all(round(abs(b) / 0.01) in (1, 3) or abs(b) < 1e-6 for b in bias)
    assert any(b != 0 for b in bias)
    assert torch.equal(torch.tensor(loaded), torch.tensor(bias))
