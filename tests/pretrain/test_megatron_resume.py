"""Megatron-LM's schedule and resume semantics: a changed learning-rate schedule on resume is refused
unless --override-opt_param-scheduler / --use-checkpoint-opt_param-scheduler picks one (each then
trains with exactly that schedule); --no-load-optim, --finetune, --exit-interval, sample-based
schedules, --recompute-method, a static --loss-scale and keeping every checkpoint by default. The
oracle is LRSchedule's closed form (tests/pretrain/test_config.py) and the first run's weights."""

from types import SimpleNamespace

import pytest
import torch

from pretrain.arguments import parse_args
from pretrain.config import TrainConfigError
from pretrain.lr_schedule import LRSchedule
from hybrid.recompute import RecomputePlan
from pretrain.recompute_method import apply_recompute_method
from pretrain.build import recompute_plan
from tests.training_helpers import make_trainer, tiny_args

# tiny_args: --lr 1e-3 --min-lr 1e-4 --lr-warmup-iters 1, global batch 8, decay = --train-iters


def _train(args):
    """Train; returns the trainer and the learning rate each step used."""
    trainer = make_trainer(args)
    used, step = [], trainer._optimizer_step
    trainer._optimizer_step = lambda lr: (used.append(lr), step(lr))[1]
    trainer.train()
    return trainer, used


def _weights(trainer) -> list[torch.Tensor]:
    return [p.detach().clone() for p in trainer.model.parameters()]


def test_longer_train_iters_refused_then_continued_with_either_schedule(tmp_path):
    _train(tiny_args(iters=2, extra=["--save", str(tmp_path)]))
    resume = tiny_args(iters=4, extra=["--load", str(tmp_path)])
    with pytest.raises(TrainConfigError, match=r"decay iterations .*: checkpoint 2\.0, this run 4; "
                                               r"pass --override-opt_param-scheduler"):
        make_trainer(resume)
    flags = LRSchedule(1e-3, 1e-4, 1, 4)          # this command line's: decay over 4 iterations
    saved = LRSchedule(1e-3, 1e-4, 1, 2)          # the checkpoint's: decay over 2
    for extra, expected in ((["--override-opt_param-scheduler"], flags),
                            (["--use-checkpoint-opt_param-scheduler"], saved)):
        trainer, used = _train(resume + extra)
        assert trainer.ts.iteration == 4 and trainer.ts.consumed_train_samples == 4 * 8
        assert used == pytest.approx([expected(2), expected(3)])
    assert flags(2) != saved(2)                    # the two really differ


def test_unchanged_schedule_resumes_without_a_choice(tmp_path):
    fixed = ["--lr-decay-iters", "4"]              # Megatron: the decay end, not --train-iters
    _train(tiny_args(iters=2, extra=fixed + ["--save", str(tmp_path)]))
    trainer, used = _train(tiny_args(iters=3, extra=fixed + ["--load", str(tmp_path)]))
    assert used == pytest.approx([LRSchedule(1e-3, 1e-4, 1, 4)(2)])
    with pytest.raises(TrainConfigError, match=r"peak learning rate \(--lr\): checkpoint 0\.001, "
                                               r"this run 0\.002"):
        make_trainer(tiny_args(iters=3, extra=fixed + ["--load", str(tmp_path), "--lr", "2e-3"]))


def test_no_load_optim_and_finetune_load_weights_only(tmp_path):
    first, _ = _train(tiny_args(iters=2, extra=["--save", str(tmp_path)]))
    fresh = LRSchedule(1e-3, 1e-4, 1, 5)   # another --train-iters: no schedule is loaded to differ
    for extra, iteration in ((["--no-load-optim"], 2), (["--finetune", "--no-load-rng"], 0)):
        trainer = make_trainer(tiny_args(iters=5, extra=["--load", str(tmp_path), *extra]))
        assert all(torch.equal(a, b) for a, b in zip(_weights(trainer), _weights(first)))
        assert trainer.optimizer.step_count == 0
        moments = [f.tensor for f in trainer.optimizer.checkpoint_pieces() if f.kind == "exp_avg"]
        assert moments and all(not m.any() for m in moments)
        assert trainer.ts.iteration == iteration
        # the schedule starts over at the loaded iteration (Megatron: a fresh scheduler)
        assert [trainer.schedule(iteration + i) for i in range(3)] == [fresh(i) for i in range(3)]
    loaded = make_trainer(tiny_args(iters=2, extra=["--load", str(tmp_path)]))
    assert loaded.optimizer.step_count == 2        # a plain --load restores the optimizer


def test_exit_interval_saves_and_stops_and_all_checkpoints_are_kept(tmp_path):
    trainer, _ = _train(tiny_args(iters=8, extra=["--exit-interval", "3", "--save", str(tmp_path),
                                                  "--save-interval", "2"]))
    assert trainer.ts.iteration == 3                # stopped after iteration 3, saved first
    assert sorted(p.name for p in tmp_path.glob("iter_*")) == ["iter_0000002", "iter_0000003"]


def _without(args: list[str], *flags: str) -> list[str]:
    """``args`` less each of ``flags`` and its value."""
    drop = {i + k for i, a in enumerate(args) if a in flags for k in (0, 1)}
    return [a for i, a in enumerate(args) if i not in drop]


def test_sample_based_schedule_is_megatrons_in_iterations():
    args = _without(tiny_args(), "--train-iters", "--lr-warmup-iters")
    trainer, used = _train(args + ["--train-samples", "40", "--lr-decay-samples", "36",
                                   "--lr-warmup-samples", "12"])
    expected = LRSchedule(1e-3, 1e-4, 12 / 8, 36 / 8)      # samples / global batch 8
    assert trainer.ts.iteration == 40 // 8
    assert used == pytest.approx([expected(i) for i in range(40 // 8)])


def test_recompute_method_shapes_the_plan():
    state = SimpleNamespace(world_size=1, tp_size=1, rank=1, device=torch.device("cpu"))
    for extra, modes, granularity in (
            (["--recompute-method", "block", "--recompute-num-layers", "1"], ("full", "none"), 1),
            (["--recompute-method", "uniform", "--recompute-num-layers", "2"], ("full", "full"), 2)):
        cfg, _ = parse_args(["--recompute-granularity", "full", *extra])
        plan = recompute_plan(cfg, cfg.model, state)
        assert (plan.modes, plan.granularity) == (modes, granularity)
    cfg, _ = parse_args(["--recompute", "full"])
    assert recompute_plan(cfg, cfg.model, state).modes == ("full", "full")
    # block with 2 pipeline stages: the first layer of each stage
    cfg, _ = parse_args(["--pipeline-model-parallel-size", "2", "--num-layers", "4",
                         "--global-batch-size", "8", "--recompute-granularity", "full",
                         "--recompute-method", "block", "--recompute-num-layers", "1"])
    plan = apply_recompute_method(RecomputePlan.uniform("full", 4), cfg,
                                  cfg.pipeline_config(cfg.layout(2)))
    assert plan.modes == ("full", "none", "full", "none")


def test_static_loss_scale_stays():
    trainer, _ = _train(tiny_args(precision="fp16", extra=["--loss-scale", "1024"]))
    assert trainer.optimizer.scaler.scale == 1024.0
    dynamic, _ = _train(tiny_args(precision="fp16", extra=["--initial-loss-scale", "1024",
                                                           "--loss-scale-window", "1"]))
    assert dynamic.optimizer.scaler.scale > 1024.0   # the dynamic scaler grows where static stays
