"""Megatron-LM's WSD (warmup-stable-decay) and inverse-square-root learning-rate schedules: the lr
at every iteration equals the formulas of Megatron's OptimizerParamScheduler, written out here
independently (iterations for its sample counts; our warm-up is one step ahead, docs/megatron-
flags.md); a run resumed inside the WSD decay continues bit-identically; a changed WSD decay on
resume is refused unless --override-opt_param-scheduler; bad WSD flags get one clear error."""

import math

import pytest

from pretrain.arguments import parse_args
from pretrain.config import TrainConfigError
from pretrain.lr_schedule import LRSchedule
from pretrain.resume_schedule import run_schedule
from tests.training_helpers import make_trainer, tiny_args

PEAK, FLOOR = 1.0, 0.1


def _warmup(n: int, warmup: float) -> float:
    """One step ahead of Megatron's, capped at the peak (a fractional warm-up's last step)."""
    return PEAK * min(1.0, (n + 1) / warmup)


def _wsd_expected(n: int, warmup: float, decay: float, anneal: float, shape: str) -> float:
    """Warm-up, PEAK until decay - anneal, then the shape from PEAK to FLOOR at ``decay``."""
    if n < warmup:
        return _warmup(n, warmup)
    if n > decay:
        return FLOOR
    if n <= decay - anneal:
        return PEAK
    r = (n - (decay - anneal)) / anneal
    fraction = {"linear": 1 - r, "cosine": (1 + math.cos(math.pi * r)) / 2,
                "exponential": 2 * 0.5 ** r - 1, "minus_sqrt": 1 - math.sqrt(r)}[shape]
    return FLOOR + fraction * (PEAK - FLOOR)


@pytest.mark.parametrize("shape", ["linear", "cosine", "exponential", "minus_sqrt"])
def test_wsd_lr_is_megatrons_at_every_iteration(shape):
    cfg, _ = parse_args(tiny_args(iters=24, extra=[
        "--lr", str(PEAK), "--min-lr", str(FLOOR), "--lr-warmup-iters", "4", "--lr-decay-iters",
        "20", "--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "8", "--lr-wsd-decay-style",
        shape]))
    schedule = run_schedule(cfg, cfg.layout(1))
    got = [schedule(n) for n in range(24)]
    assert got == pytest.approx([_wsd_expected(n, 4, 20, 8, shape) for n in range(24)],
                                rel=1e-12, abs=1e-15)
    assert got[4:13] == [PEAK] * 9                     # the stable phase: exactly the peak
    assert all(a > b for a, b in zip(got[12:21], got[13:21]))   # the decay falls ...
    assert got[20:] == pytest.approx([FLOOR] * 4, abs=1e-15)    # ... to --min-lr at the end


def test_sample_based_wsd_in_fractional_iterations():
    args = tiny_args(extra=["--lr", str(PEAK), "--min-lr", str(FLOOR)])
    drop = {i + k for i, a in enumerate(args) if a in ("--train-iters", "--lr-warmup-iters")
            for k in (0, 1)}
    args = [a for i, a in enumerate(args) if i not in drop]
    cfg, _ = parse_args(args + ["--train-samples", "96", "--lr-warmup-samples", "12",
                                "--lr-decay-samples", "80", "--lr-decay-style", "WSD",
                                "--lr-wsd-decay-samples", "36", "--lr-wsd-decay-style", "linear"])
    schedule = run_schedule(cfg, cfg.layout(1))   # global batch 8: W 1.5, D 10, anneal 4.5
    assert [schedule(n) for n in range(12)] == pytest.approx(
        [_wsd_expected(n, 1.5, 10, 4.5, "linear") for n in range(12)], rel=1e-12, abs=1e-15)


def test_inverse_square_root_is_megatrons_at_every_iteration():
    floor = 0.3   # lr * sqrt(4 / n) falls below it after n = 44: the max() takes over
    cfg, _ = parse_args(tiny_args(iters=110, extra=[
        "--lr", str(PEAK), "--min-lr", str(floor), "--lr-warmup-iters", "4", "--lr-decay-iters",
        "100", "--lr-decay-style", "inverse-square-root"]))
    schedule = run_schedule(cfg, cfg.layout(1))
    expected = [_warmup(n, 4) if n < 4 else floor if n > 100 else max(floor, PEAK * (4 / n) ** 0.5)
                for n in range(110)]
    got = [schedule(n) for n in range(110)]
    assert got == pytest.approx(expected, rel=1e-12)
    assert got[16] == pytest.approx(PEAK / 2) and got[44] > floor and got[45] == floor


@pytest.mark.parametrize("extra,message", [
    (["--lr-decay-style", "WSD"], "--lr-decay-style WSD needs the length of its decay"),
    (["--lr-wsd-decay-iters", "2"], "--lr-wsd-decay-iters is the decay length of --lr-decay-style "
                                    "WSD, not of cosine"),
    (["--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "2", "--lr-wsd-decay-style", "step"],
     "--lr-wsd-decay-style must be one of exponential, linear, cosine, minus_sqrt"),
    (["--lr-decay-style", "WSD", "--lr-wsd-decay-samples", "16"],
     "--lr-wsd-decay-samples count samples: they go with --train-samples"),
    (["--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "0"],
     "--lr-wsd-decay-iters must be a positive integer"),
])
def test_bad_wsd_flags_are_explained(extra, message):
    with pytest.raises(TrainConfigError, match=message):
        cfg, _ = parse_args(tiny_args(extra=extra))
        cfg.validate_for_world(1)


@pytest.mark.parametrize("extra,message", [
    # warm-up 1 + WSD decay 4 > decay length 4: the decay would start inside the warm-up
    (["--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "4"],
     r"the WSD decay of 4 iterations must be positive and fit in the 3 iterations between the "
     r"warm-up's end \(1\) and the decay's end \(4\); lower --lr-wsd-decay-iters"),
    (["--lr-decay-style", "inverse-square-root", "--lr-warmup-iters", "0"],
     "--lr-decay-style inverse-square-root decays as lr \\* sqrt\\(warm-up / iteration\\): give it "
     "a warm-up"),
])
def test_schedules_that_do_not_fit_are_refused_before_training(extra, message):
    cfg, _ = parse_args(tiny_args(iters=4, extra=extra))
    with pytest.raises(TrainConfigError, match=message):
        cfg.validate_for_world(1)


def _wsd(anneal: int = 4, shape: str = "cosine") -> list[str]:
    """With tiny_args' warm-up of 1: stable up to iteration 6 - anneal, the decay after it."""
    return ["--lr-decay-style", "WSD", "--lr-decay-iters", "6", "--lr-wsd-decay-iters",
            str(anneal), "--lr-wsd-decay-style", shape]


WSD = _wsd()   # warm-up 1, stable to iteration 2, decay over iterations 3..6


def _train(args):
    """Train; returns the trainer and the learning rate each step used."""
    trainer = make_trainer(args)
    used, step = [], trainer._optimizer_step
    trainer._optimizer_step = lambda lr: (used.append(lr), step(lr))[1]
    trainer.train()
    return trainer, used


def test_resume_inside_the_wsd_decay_is_bit_identical(tmp_path):
    full, full_lrs = _train(tiny_args(iters=6, extra=WSD))
    first, first_lrs = _train(tiny_args(iters=4, extra=WSD + ["--save", str(tmp_path)]))
    second, second_lrs = _train(tiny_args(iters=6, extra=WSD + ["--load", str(tmp_path)]))
    assert first.losses + second.losses == full.losses        # exact, not approximately
    assert first_lrs + second_lrs == full_lrs
    expected = [_wsd_expected(n, 1, 6, 4, "cosine") * 1e-3 / PEAK for n in range(6)]
    assert full_lrs == pytest.approx(expected, rel=1e-12)     # only valid with FLOOR = 0.1 x PEAK
    assert full_lrs[2] == 1e-3 > full_lrs[3] > full_lrs[4] > full_lrs[5]   # resumed at step 4


def test_changed_wsd_decay_on_resume_needs_a_choice(tmp_path):
    _train(tiny_args(iters=4, extra=WSD + ["--save", str(tmp_path)]))
    resume = tiny_args(iters=6, extra=_wsd(anneal=3) + ["--load", str(tmp_path)])
    with pytest.raises(TrainConfigError, match=r"WSD decay iterations \(--lr-wsd-decay-iters / "
                                               r"--lr-wsd-decay-samples\): checkpoint 4\.0, this "
                                               r"run 3; pass --override-opt_param-scheduler"):
        make_trainer(resume)
    restyled = tiny_args(iters=6, extra=_wsd(shape="linear") + ["--load", str(tmp_path)])
    with pytest.raises(TrainConfigError, match=r"WSD decay style \(--lr-wsd-decay-style\): "
                                               r"checkpoint 'cosine', this run 'linear'"):
        make_trainer(restyled)
    _, used = _train(resume + ["--override-opt_param-scheduler"])
    flags = LRSchedule(1e-3, 1e-4, 1, 6, "WSD", wsd_decay_iters=3, wsd_style="cosine")
    assert used == pytest.approx([flags(4), flags(5)], rel=1e-12)
    assert flags(4) != LRSchedule(1e-3, 1e-4, 1, 6, "WSD", wsd_decay_iters=4, wsd_style="cosine")(4)
