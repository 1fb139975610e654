"""Checkpoints are independent of the layout that wrote them (docs/design.md §8).

A run saved at TP2 x DP2 with ZeRO stage 3 after 2 of 4 iterations is resumed at TP1 x DP4 stage 1,
TP4 x DP1 stage 2 (4 ranks, one spawn) and TP1 x DP1 stage 0 (one process). The oracle is the same
run continued uninterrupted at TP2 x DP2: the next-step loss (forward with the loaded weights) must
match to rtol 1e-6, the loss after one more step (loaded Adam moments and step count) to 1e-5, and the
samples of iteration 3 must be exactly the next global batch (no repeat, no skip) in every layout.
The vocab (200) is padded differently at TP 1 and TP 2/4, so the embedding crosses padding. Finally
the exported canonical weights, loaded into the single-device reference GPT, give the same loss.
"""

import numpy as np
import torch

from hybrid.testing.multirank import run_on_ranks
from models.gpt.config import GPTConfig
from models.gpt.reference import ReferenceGPT
from models.gpt.weights import canonical_state_dict
from tests.training_helpers import IndexedSamples, make_trainer, tiny_args

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
    exported = _reference_loss(f"{ckpt}/iter_0000002", 2 * GLOBAL_BATCH, GLOBAL_BATCH)
    torch.testing.assert_close(exported, reference[2], rtol=1e-5, atol=0)
    record = []
    single = _run(dict(tp=1, zero=0), 4, ["--load", f"{ckpt}/iter_0000002"], record)
    assert sorted(_check(single, record, reference, GLOBAL_BATCH // 2)) == \
        list(range(2 * GLOBAL_BATCH, 3 * GLOBAL_BATCH))


def _reference_loss(ckpt_iter_dir: str, first: int, count: int) -> float:
    state_dict, config = canonical_state_dict(ckpt_iter_dir)
    model = ReferenceGPT(GPTConfig.from_dict(config))
    model.load_state_dict(state_dict)
    batch = torch.from_numpy(np.stack([IndexedSamples(4096)[i] for i in range(first, first + count)]))
    with torch.no_grad():
        return model(batch[:, :-1], batch[:, 1:]).mean().item()
