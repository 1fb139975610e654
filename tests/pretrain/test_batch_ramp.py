"""Batch ramps (hybrid/batch_schedule.py; Megatron's --step-batch-size-schedule and
--rampup-batch-size): the schedule's arithmetic against Megatron's definitions written out here, the
config errors, and a ramped run equal to the same steps run as separate constant-batch runs joined
by a checkpoint (the GPT-3 example's run with PP 2: tests/pretrain/test_megatron_flags.py)."""

from __future__ import annotations

import math

import pytest

from hybrid.batch_schedule import BatchSchedule, BatchScheduleError
from pretrain.arguments import parse_args
from pretrain.config import TrainConfigError


def test_step_schedule_counts_tokens_with_megatron_suffixes():
    ramp = BatchSchedule.parse("0:16 2.4B:320 4.8B:624 7.2B:928 9.6B:1232 12B:1536", 2048, 1536)
    assert ramp.entries[1] == (2_400_000_000 // 2048, 320)
    assert ramp.nominal == 1536
    assert [ramp.batch_at(s) for s in (0, 1_171_874, 1_171_875, 10 ** 9)] == [16, 16, 320, 1536]
    assert BatchSchedule.parse("0:8,1.5K:16", 1).entries == ((0, 8), (1500, 16))


def _megatron_linear_ramp(start, increment, samples, final, consumed):
    """Megatron's former RampupBatchsizeNumMicroBatchesCalculator.update, as documented."""
    if consumed > samples:
        return final
    per_increment = samples / ((final - start) // increment)
    return min(final, start + int(consumed / per_increment) * increment)


@pytest.mark.parametrize("start,increment,samples,final", [(16, 16, 5000, 256), (2, 2, 8, 8),
                                                           (4, 4, 3, 16)])
def test_rampup_is_megatrons_linear_ramp(start, increment, samples, final):
    ramp = BatchSchedule.rampup(start, increment, samples, final)
    for consumed in range(0, samples + 3 * final):
        assert ramp.batch_at(consumed) == _megatron_linear_ramp(start, increment, samples, final,
                                                               consumed), consumed


def test_iterations_and_samples_walk_the_schedule():
    ramp = BatchSchedule.parse("0:2 3:4 9:8", 1)
    # consumed 0 ->2 ->4 ->8 ->12 ->20 ->28 (batch 2 below sample 3, 4 below 9, then 8)
    assert ramp.iterations_for(20) == 5 and ramp.samples_after(5) == 20
    assert ramp.iterations_for(21) == 6                # the last step passes the samples
    assert ramp.samples_after(2, consumed=4) == 12
    assert ramp.position(6) == 6 / 8


@pytest.mark.parametrize("text,message", [
    ("16:2 32:4", "must start at threshold 0"), ("0:2 0:4", "thresholds must increase"),
    ("0:0", "must be positive"), ("0-2", "is not THRESHOLD:BATCH_SIZE"),
    ("0:2 x:4", "'x' is not a number")])
def test_bad_step_schedules(text, message):
    with pytest.raises(BatchScheduleError, match=message):
        BatchSchedule.parse(text, 16)


@pytest.mark.parametrize("argv,message", [
    (["--step-batch-size-schedule", "0:2 32:4", "--global-batch-size", "8"],
     "--global-batch-size 8 differs from the last batch of --step-batch-size-schedule \\(4\\)"),
    (["--rampup-batch-size", "2", "2"], "takes three numbers"),
    (["--rampup-batch-size", "2", "2", "100"], "ramps up to --global-batch-size; set it"),
    (["--rampup-batch-size", "2", "4", "100", "--global-batch-size", "8"],
     "start plus a whole number of increments"),
    (["--rampup-batch-size", "2", "2", "8", "--global-batch-size", "8",
      "--step-batch-size-schedule", "0:8"], "give one of"),
])
def test_bad_ramp_flags(argv, message):
    with pytest.raises(TrainConfigError, match=message):
        cfg, _ = parse_args(["--seq-length", "16", "--micro-batch-size", "1", *argv])
        cfg.validate_for_world(2)


def test_every_batch_of_the_ramp_must_fill_the_dp_ranks():
    cfg, _ = parse_args(["--seq-length", "16", "--micro-batch-size", "2",
                         "--step-batch-size-schedule", "0:4 64:6 128:8"])
    with pytest.raises(TrainConfigError, match="global batch 6 \\(from sample 4\\) is not a multiple "
                                               "of micro batch 2 x data-parallel size 2 = 4"):
        cfg.validate_for_world(2)
    cfg.validate_for_world(1)


def test_sample_based_run_walks_the_ramp():
    cfg, _ = parse_args(["--micro-batch-size", "1", "--global-batch-size", "8",
                         "--rampup-batch-size", "2", "2", "8", "--train-samples", "40"])
    assert cfg.train_iterations(cfg.validate_for_world(2)) == 7     # 2, 2, 4, 8, 8, 8, 8


# ---- a ramped run equals constant-batch runs joined by a checkpoint -----------------------------
def _run(args):
    from tests.training_helpers import make_trainer
    record: list = []
    trainer = make_trainer(args, record)
    trainer.train()
    return trainer.losses, [i for batch in record for i in batch]


def _ramped_and_joined(rank, world_size, ckpt):
    from tests.training_helpers import tiny_args
    constant = ["--lr-decay-style", "constant", "--lr-warmup-iters", "0"]
    ramped = _run(tiny_args(iters=3, extra=[*constant, "--step-batch-size-schedule", "0:4 64:8"]))
    first = _run(tiny_args(iters=1, extra=[*constant, "--global-batch-size", "4", "--save", ckpt]))
    rest = _run(tiny_args(iters=3, extra=[*constant, "--load", ckpt,
                                          "--override-opt_param-scheduler"]))
    return ramped, first, rest


@pytest.mark.slow
def test_ramped_run_equals_constant_runs_joined(tmp_path):
    """DP 2, ZeRO 1, fp32: a step of 4 samples then two of 8 (the ramp) equals one step at
    --global-batch-size 4, saved, then two at 8 from that checkpoint: the same samples in the same
    order and the same losses, so the engine's accumulation count and the loss averaging follow the
    ramp exactly."""
    from hybrid.testing.multirank import run_on_ranks
    for ramped, first, rest in run_on_ranks(_ramped_and_joined, 2, args=(str(tmp_path / "c"),),
                                            timeout=300):
        assert ramped[1] == first[1] + rest[1]                     # the data stream
        assert len(ramped[1]) == (4 + 8 + 8) // 2                  # this rank's half of 20
        assert ramped[0] == pytest.approx(first[0] + rest[0], rel=1e-6)
        assert all(math.isfinite(x) for x in ramped[0])
