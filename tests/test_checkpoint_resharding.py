"""Checkpoints are independent of the layout that wrote them (DESIGN.md invariant 8).

A run saved at TP2 x DP2 with ZeRO stage 3 after 2 of 4 iterations is resumed at TP1 x DP4 stage 1,
TP4 x DP1 stage 2 (4 ranks, one spawn) and TP1 x DP1 stage 0 (one process). The oracle is the same
run continued uninterrupted at TP2 x DP2: the next-step loss (forward with the loaded weights) must
match to rtol 1e-6, the loss after one more step (loaded Adam moments and step count) to 1e-5, and the
samples of iteration 3 must be exactly the next global batch (no repeat, no skip) in every layout.
"""

import torch

from tests.multirank import run_on_ranks
from tests.training_helpers import make_trainer, tiny_args

SAVE_LAYOUT = dict(tp=2, zero=3)
RESUME_LAYOUTS = [dict(tp=1, zero=1), dict(tp=4, zero=2)]
GLOBAL_BATCH = 8
FIXED = ["--lr-decay-iters", "4"]


def _run(layout, iters, extra, record=None):
    trainer = make_trainer(tiny_args(iters=iters, extra=FIXED + extra, **layout), record)
    trainer.train()
    return trainer.losses


def _ranks(rank, world_size, ckpt):
    reference = _run(SAVE_LAYOUT, 4, ["--save", ckpt, "--save-interval", "2"])
    out = {"reference": reference}
    for layout in RESUME_LAYOUTS:
        record = []
        out[str(layout)] = (_run(layout, 4, ["--load", f"{ckpt}/iter_0000002"], record), record)
    return out


def _check(losses, record, reference, micro_batches_per_rank):
    torch.testing.assert_close(losses[0], reference[2], rtol=1e-6, atol=0)
    torch.testing.assert_close(losses[1], reference[3], rtol=1e-5, atol=0)
    first_step = [tag for batch in record[:micro_batches_per_rank] for tag in batch]
    return first_step


def test_save_tp2_dp2_stage3_resume_at_other_layouts(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    results = run_on_ranks(_ranks, 4, args=(ckpt,), timeout=600)
    reference = results[0]["reference"]
    for layout in RESUME_LAYOUTS:
        dp = 4 // layout["tp"]
        per_rank = GLOBAL_BATCH // (2 * dp)              # micro-batches of 2 samples per rank
        seen = []
        for r in results:
            losses, record = r[str(layout)]
            seen += _check(losses, record, reference, per_rank)
        # each TP rank of a DP replica reads the same samples: count every replica once
        assert sorted(set(seen)) == list(range(2 * GLOBAL_BATCH, 3 * GLOBAL_BATCH)), layout
    record = []
    single = _run(dict(tp=1, zero=0), 4, ["--load", f"{ckpt}/iter_0000002"], record)
    assert sorted(_check(single, record, reference, GLOBAL_BATCH // 2)) == \
        list(range(2 * GLOBAL_BATCH, 3 * GLOBAL_BATCH))
