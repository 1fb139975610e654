"""The trainer runs MoE aux / z losses under pipeline parallelism (issue 32, "PP: MoE layers on any
stage"): a 2-layer MoE GPT with top-2 routing, the aux loss and the z-loss, 4 steps, at PP 2 (one
MoE layer per stage, 1F1B over 4 micro-batches) against the same run at PP 1, fp32. The losses
agree at rtol 1e-5 (the non-last stage's aux / z gradients are scaled as on one stage: the masked
loss's kept fraction over m, pretrain/pipeline_stage.py), and the writer rank (stage 0) logs both
layers' MoE metrics, equal to the PP 1 run's (pretrain.metrics.moe_metrics over the PP group).
Slow: two trainer builds on gloo ranks.
"""

from __future__ import annotations

import pytest
import torch

from hybrid.testing.multirank import run_on_ranks
from pretrain.loggers import read_jsonl
from tests.training_helpers import make_trainer, tiny_args

MOE = ["--num-experts", "4", "--swiglu", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.1",
       "--moe-z-loss-coeff", "0.01", "--log-interval", "2", "--lr-decay-iters", "4"]


def _train(rank, world, pp, jsonl):
    extra = MOE + ["--pipeline-model-parallel-size", str(pp), "--jsonl-log", jsonl]
    trainer = make_trainer(tiny_args(iters=4, extra=extra))
    trainer.train()
    trainer.metrics.close()
    return trainer.losses


@pytest.mark.slow
def test_moe_aux_losses_train_and_log_under_pp2_like_pp1(tmp_path):
    logs = {pp: str(tmp_path / f"pp{pp}.jsonl") for pp in (1, 2)}
    losses = {pp: run_on_ranks(_train, pp, args=(pp, logs[pp]), timeout=600)[0] for pp in (1, 2)}
    assert len(losses[1]) == 4
    torch.testing.assert_close(torch.tensor(losses[2]), torch.tensor(losses[1]), rtol=1e-5, atol=0)
    metrics = {pp: [rec["metrics"] for rec in read_jsonl(logs[pp])
                    if "lm loss" in rec.get("metrics", {})] for pp in (1, 2)}
    keys = [f"moe/layer{i}/{what}" for i in (0, 1) for what in ("aux-loss", "z-loss",
                                                                "load-max-over-mean")]
    keys += ["moe/aux-loss", "moe/z-loss", "moe/load-max-over-mean"]
    assert len(metrics[2]) == len(metrics[1]) == 2   # iterations 2 and 4
    for one, two in zip(metrics[1], metrics[2]):
        for key in keys:
            assert key in two, key   # the second stage's layer reaches the writer (stage 0)
            assert two[key] == pytest.approx(one[key], rel=1e-5), key
        assert one["moe/aux-loss"] > 0 and one["moe/z-loss"] > 0
