"""The real trainer under EP x CP (issues 31 and 32) is exact and its checkpoints reshard across both
degrees (docs/design.md §8 and §12).

tests/training_helpers.py's tiny model with both layers MoE (4 experts, top-2 sigmoid routing with
DeepSeek-V3's expert bias, aux and z losses, a capacity factor of 1 that drops routes), fp32, 4
iterations on 4 ranks: EP 2 x CP 2 x DP 2 (2 micro-batches per rank, ZeRO 1, EP groups = CP pairs)
saving at iteration 2 gives the losses of the EP 1 x CP 1 x DP 4 run of the same batches (rtol
1e-5: routing, drops, balancing losses, the bias update and the gradient scale all whole-sequence).
Resumed from that checkpoint (expert shards, their ZeRO moments, the expert biases) at EP 1 x CP 1
(ZeRO 3) and at EP 4 x CP 4 (ZeRO 1, DP 1), iterations 3 and 4 continue the uninterrupted run.
"""

import pytest
import torch

from hybrid.testing.multirank import run_on_ranks
from tests.training_helpers import make_trainer, tiny_args

MOE = ["--swiglu", "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32",
       "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
       "--moe-router-bias-update-rate", "0.01", "--moe-aux-loss-coeff", "0.01",
       "--moe-z-loss-coeff", "0.001", "--moe-expert-capacity-factor", "1.0",
       "--lr-decay-iters", "4"]
SAVE = dict(ep=2, cp=2, zero=1)
RESUMES = [dict(ep=1, cp=1, zero=3), dict(ep=4, cp=4, zero=1)]


def _run(layout, extra):
    args = tiny_args(zero=layout["zero"], iters=4,
                     extra=MOE + ["--context-parallel-size", str(layout["cp"]),
                                  "--expert-model-parallel-size", str(layout["ep"])] + extra)
    trainer = make_trainer(args)
    trainer.train()
    return trainer.losses


def _ranks(rank, world_size, ckpt):
    out = {"saved": _run(SAVE, ["--save", ckpt, "--save-interval", "2"]),
           "ep1cp1": _run(dict(ep=1, cp=1, zero=1), [])}
    for layout in RESUMES:
        out[str(layout)] = _run(layout, ["--load", f"{ckpt}/iter_0000002"])
    return out


@pytest.mark.slow
def test_ep2_cp2_equals_ep1_cp1_and_resumes_at_ep1_cp1_and_ep4_cp4(tmp_path):
    results = run_on_ranks(_ranks, 4, args=(str(tmp_path / "ckpt"),), timeout=1200)
    saved = results[0]["saved"]
    assert len(saved) == 4
    torch.testing.assert_close(torch.tensor(saved), torch.tensor(results[0]["ep1cp1"]), rtol=1e-5,
                               atol=0, msg=lambda m: f"EP 2 x CP 2 vs EP 1 x CP 1: {m}")
    for layout in RESUMES:
        for r in results:
            torch.testing.assert_close(torch.tensor(r[str(layout)]), torch.tensor(saved[2:]),
                                       rtol=1e-5, atol=0, msg=lambda m: f"resumed at {layout}: {m}")
