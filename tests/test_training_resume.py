"""Resume is exact: 2N uninterrupted steps give bit-identical losses to N steps + save + load + N
steps (fp32 and bf16), also when the stop comes from SIGTERM or --exit-duration-in-mins. The oracle
is the uninterrupted run in the same layout (one process)."""

import os
import signal

import pytest

from hybrid.checkpoint import CheckpointReader
from tests.training_helpers import make_trainer, tiny_args

FIXED_SCHEDULE = ["--lr-decay-iters", "4"]  # the schedule must not depend on where a run stops


def _losses(args, record=None):
    trainer = make_trainer(args, record)
    trainer.train()
    return trainer


@pytest.mark.parametrize("precision,stage", [("fp32", 1), ("bf16", 2)])
def test_resume_is_bit_identical(tmp_path, precision, stage):
    base = tiny_args(zero=stage, precision=precision, extra=FIXED_SCHEDULE)
    full_record, part_record = [], []
    full = _losses(base + ["--train-iters", "4"], full_record).losses
    first = _losses(base + ["--train-iters", "2", "--save", str(tmp_path)], part_record)
    second = _losses(base + ["--train-iters", "4", "--load", str(tmp_path)], part_record)
    assert first.losses + second.losses == full          # exact, not approximately
    assert part_record == full_record                    # the same samples, in the same order
    reader = CheckpointReader(tmp_path)
    assert reader.metadata["train_state"]["consumed_train_samples"] == 2 * 8
    assert reader.metadata["config"] == second.cfg.to_dict() | {
        "checkpoint": reader.metadata["config"]["checkpoint"],
        "training": reader.metadata["config"]["training"]}
    assert reader.metadata["config"]["optimizer"]["bf16"] == (precision == "bf16")


def test_sigterm_saves_and_resume_continues(tmp_path):
    base = tiny_args(extra=FIXED_SCHEDULE + ["--train-iters", "4"])
    full = _losses(base).losses
    record: list = []

    class Killer(list):          # sends SIGTERM to this process while micro-batch 5 is consumed
        def append(self, item):
            super().append(item)
            if len(self) == 5:
                os.kill(os.getpid(), signal.SIGTERM)

    killer = Killer()
    stopped = _losses(base + ["--save", str(tmp_path)], killer)
    assert stopped.ts.iteration == 2 and len(stopped.losses) == 2    # finished the step it was in
    resumed = _losses(base + ["--load", str(tmp_path)], record)
    assert stopped.losses + resumed.losses == full
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL        # handler removed again


def test_exit_duration_saves_after_first_step(tmp_path):
    trainer = _losses(tiny_args(extra=["--exit-duration-in-mins", "1e-9", "--save", str(tmp_path)]))
    assert trainer.ts.iteration == 1
    assert CheckpointReader(tmp_path).metadata["train_state"]["iteration"] == 1
