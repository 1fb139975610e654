"""Checkpoints do not depend on the CP degree (issue 31; docs/design.md §8): CP shards no parameter,
but the ZeRO partitions span DP x CP, so a save at CP 2 must reshard to CP 1 and CP 4.

The real trainer (pretrain.setup, tests/training_helpers.py's tiny model and indexed corpus) runs 4
iterations at CP 2 x DP 2 with ZeRO 1 (its optimizer state partitioned over the 4 DP x CP ranks),
saving at iteration 2. Resumed from that checkpoint at CP 1 x DP 4 (ZeRO 3), CP 4 x DP 1 (ZeRO 1)
and TP 2 x CP 2 (ZeRO 2), iterations 3 and 4 must give the uninterrupted run's losses (rtol 1e-5:
loaded weights, Adam moments and step count), reading exactly the next samples. Since CP is exact,
the uninterrupted CP 2 run itself equals a CP 1 run of the same batches, and so does a run at
PP 2 x CP 2 (the pipeline's micro-batches split over CP, each stage given the token layout).
"""

import pytest
import torch

from hybrid.testing.multirank import run_on_ranks
from tests.training_helpers import make_trainer, tiny_args

FIXED = ["--lr-decay-iters", "4"]
SAVE = dict(tp=1, zero=1, cp=2)
RESUMES = [dict(tp=1, zero=3, cp=1), dict(tp=1, zero=1, cp=4), dict(tp=2, zero=2, cp=2)]


def _run(layout, extra, record=None):
    pp = ["--pipeline-model-parallel-size", str(layout["pp"])] if layout.get("pp") else []
    args = tiny_args(tp=layout["tp"], zero=layout["zero"], iters=4,
                     extra=FIXED + ["--context-parallel-size", str(layout["cp"])] + pp + extra)
    trainer = make_trainer(args, record)
    trainer.train()
    return trainer.losses


def _ranks(rank, world_size, ckpt):
    out = {"saved": _run(SAVE, ["--save", ckpt, "--save-interval", "2"]),
           "cp1": _run(dict(tp=1, zero=1, cp=1), []),
           "pp2": _run(dict(tp=1, zero=1, cp=2, pp=2), [])}
    for layout in RESUMES:
        record = []
        out[str(layout)] = (_run(layout, ["--load", f"{ckpt}/iter_0000002"], record), record)
    return out


@pytest.mark.slow
def test_save_at_cp2_resume_at_cp1_cp4_and_tp2_and_pp2_equals_cp1(tmp_path):
    results = run_on_ranks(_ranks, 4, args=(str(tmp_path / "ckpt"),), timeout=1200)
    saved = results[0]["saved"]
    torch.testing.assert_close(torch.tensor(saved), torch.tensor(results[0]["cp1"]), rtol=1e-5,
                               atol=0)
    for r in results:   # PP 2 x CP 2: every rank agrees on the last stage's loss
        torch.testing.assert_close(torch.tensor(r["pp2"]), torch.tensor(saved), rtol=1e-5, atol=0,
                                   msg=lambda m: f"PP 2 x CP 2: {m}")
    for layout in RESUMES:
        seen = set()
        for r in results:
            losses, record = r[str(layout)]
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(saved[2:]), rtol=1e-5,
                                       atol=0, msg=lambda m: f"resumed at {layout}: {m}")
            dp = 4 // (layout["tp"] * layout["cp"])
            seen |= {tag for batch in record[:8 // (2 * dp)] for tag in batch}
        assert sorted(seen) == list(range(16, 24)), layout
