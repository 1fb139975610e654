"""Context parallelism composed with the rest of the trainer (issue 31, "composition"): TP with
sequence parallelism and each recompute mode (Pa partitioning over TP as without CP), rotary
positions, ZeRO 2 / 3 and bf16, through the real trainer (tests/training_helpers.py). The oracle of
each CP run is the same run at CP 1 on as many ranks (its own parity with the single-device model is
tests/zero's and tests/recompute's): the losses of 4 iterations agree to rtol 1e-5 in fp32, 2e-2 in
bf16 (another order of bf16 sums)."""

import pytest
import torch

from hybrid.testing.multirank import run_on_ranks
from tests.training_helpers import make_trainer, tiny_args

CASES = {   # name: (tp, zero, precision, extra flags, rtol)
    "tp2-sp-full-pa": (2, 2, "fp32", ["--sequence-parallel", "--recompute", "full-pa"], 1e-5),
    "rope-selective-zero3": (1, 3, "fp32", ["--position-embedding-type", "rope", "--recompute",
                                            "selective"], 1e-5),
    "bf16-a2a": (1, 1, "bf16", ["--cp-comm-type", "a2a"], 2e-2),
}


def _losses(tp, zero, precision, extra, cp):
    args = tiny_args(tp=tp, zero=zero, precision=precision, iters=4,
                     extra=["--lr-decay-iters", "4", "--context-parallel-size", str(cp)] + extra)
    trainer = make_trainer(args)
    trainer.train()
    return trainer.losses


def _ranks(rank, world_size):
    return {name: (_losses(tp, zero, p, extra, 2), _losses(tp, zero, p, extra, 1))
            for name, (tp, zero, p, extra, _) in CASES.items()}


@pytest.mark.slow
def test_cp2_composes_with_sp_recompute_rope_zero3_and_bf16():
    results = run_on_ranks(_ranks, 4, timeout=1500)
    for name, (*_, rtol) in CASES.items():
        for r in results:
            cp2, cp1 = r[name]
            torch.testing.assert_close(torch.tensor(cp2), torch.tensor(cp1), rtol=rtol, atol=0,
                                       msg=lambda m: f"{name}: {m}")
