"""Muon's momentum in checkpoints (issue 33 part 5): a Muon run saved at TP 2 x DP 2 with ZeRO
stage 3 after 2 of 4 iterations resumes at TP 1 x DP 4 stage 1 and at PP 2 x TP 2 stage 1, and
continues as the uninterrupted run does (fp32 Newton-Schulz: the next losses to rtol 1e-5).

The momentum lives in the Adam first-moment slot (``exp_avg``) of each Muon matrix's pieces, so it
is saved and resharded by name and offset like Adam's moments; a lost or misplaced momentum changes
the update of iteration 3 and 4 (Muon's update is the orthogonalised momentum)."""

import pytest
import torch

from hybrid.testing.multirank import run_on_ranks
from tests.training_helpers import make_trainer, tiny_args

MUON = ["--optimizer", "muon", "--muon-ns-dtype", "fp32", "--lr-decay-iters", "4"]
SAVE = dict(tp=2, zero=3)
RESUME = {"tp1 dp4 zero1": (dict(tp=1, zero=1), []),
          "pp2 tp2 zero1": (dict(tp=2, zero=1), ["--pipeline-model-parallel-size", "2"])}


def _run(layout, extra):
    trainer = make_trainer(tiny_args(iters=4, extra=MUON + extra, **layout))
    trainer.train()
    return trainer.losses


def _ranks(rank, world_size, ckpt):
    out = {"reference": _run(SAVE, ["--save", ckpt, "--save-interval", "2"])}
    for name, (layout, extra) in RESUME.items():
        out[name] = _run(layout, extra + ["--load", f"{ckpt}/iter_0000002"])
    return out


@pytest.mark.slow
def test_muon_momentum_reshards_across_tp_pp_dp_and_stage(tmp_path):
    results = run_on_ranks(_ranks, 4, args=(str(tmp_path / "ckpt"),), timeout=900)
    reference = results[0]["reference"]
    for name in RESUME:
        losses = [r[name] for r in results if r[name]]
        torch.testing.assert_close(losses[-1][:2], reference[2:], rtol=1e-5, atol=0,
                                   msg=lambda m: f"{name}: {m}")
