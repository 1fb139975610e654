"""The trainer with pipeline parallelism (hybrid.training.pipeline_stage) against the same config
at PP 1 in one process, fp32: per-iteration losses and the validation loss within rtol 1e-5 for
PP 2 x DP 2 (1F1B) and PP 2 x TP 2 (interleaved, 2 chunks per stage); a run saved at PP 2 resumes
at PP 1 on the uninterrupted PP 1 curve; the log line carries the measured bubble and the PP bytes.

PP bytes per step (hybrid.pipeline.runner): each of the p v - 1 boundaries of the (virtual)
pipeline carries one activation forward and one gradient back per micro-batch, b s h elements each
(no sequence parallelism here), so a PP column sends 2 m (p v - 1) b s h x bytes per step; the
ledger counts a message at its sender. With p = 2, v = 1 stage 0 sends m activations and stage 1
m gradients: m b s h x 4 bytes (fp32) each, 2 m (p - 1) b s h x 4 together.
"""

from __future__ import annotations

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.multirank import run_on_ranks
from tests.training_helpers import SEQ, make_trainer, tiny_args

LAYERS = ["--num-layers", "4", "--lr-decay-iters", "4"]
EVAL = ["--eval-interval", "1000", "--eval-iters", "2"]
MICRO, GLOBAL, HIDDEN = 2, 8, 32          # tiny_args: --micro-batch-size 2, --global-batch-size 8


def _train(args):
    trainer = make_trainer(args)
    trainer.train()
    return trainer


def _run(rank, world_size, args):
    """Train, then evaluate once; every rank's losses, validation loss and logged metrics."""
    trainer = make_trainer(args)
    logged = []
    write = trainer.metrics.log
    trainer.metrics.log = lambda m, step: (logged.append(dict(m)), write(m, step))
    trainer.train()
    valid = trainer.evaluate()
    trainer.metrics.close()
    pp = next(m for m in logged if "iteration-time" in m) if trainer.pipeline else None
    return {"losses": trainer.losses, "valid": valid, "stage": trainer.state.pp_rank,
            "dp": trainer.state.dp_rank, "tp": trainer.state.tp_rank, "log": pp}


def _reference(extra):
    trainer = _train(tiny_args(iters=3, extra=LAYERS + EVAL + extra))
    return trainer.losses, trainer.evaluate()


@pytest.mark.parametrize("layout", ["pp2-dp2-1f1b", "pp2-tp2-interleaved"])
def test_pipeline_trainer_matches_pp1(tmp_path, layout):
    tb = tmp_path / "tb"
    pp = ["--pipeline-model-parallel-size", "2", "--log-interval", "1", "--tensorboard-dir", str(tb)]
    tp = 1
    if layout == "pp2-tp2-interleaved":
        tp, pp = 2, pp + ["--num-layers-per-virtual-pipeline-stage", "1"]
    ref_losses, ref_valid = _reference([])
    results = run_on_ranks(_run, 4, args=(tiny_args(tp=tp, iters=3, extra=LAYERS + EVAL + pp),),
                           timeout=400)
    for r in results:   # every rank reports the last stage's loss
        assert r["losses"] == pytest.approx(ref_losses, rel=1e-5), (layout, r)
        assert r["valid"] == pytest.approx(ref_valid, rel=1e-5), (layout, r)
    for r in results:
        assert 0.0 < r["log"]["pipeline/bubble-fraction"] < 1.0, r["log"]
    dp = 4 // (2 * tp)
    m, v = GLOBAL // (MICRO * dp), (2 if tp == 2 else 1)
    message = MICRO * SEQ * HIDDEN * 4                                    # b s h fp32 bytes
    for dp_rank in range(dp):
        for tp_rank in range(tp):
            column = [r for r in results if (r["dp"], r["tp"]) == (dp_rank, tp_rank)]
            sent = sum(r["log"]["comm/pp-bytes-per-step"] for r in column)
            assert sent == 2 * m * (2 * v - 1) * message, (layout, column)
    if v == 1:   # p = 2: each stage sends one message per micro-batch
        assert all(r["log"]["comm/pp-bytes-per-step"] == m * message for r in results)
    acc = EventAccumulator(str(next(p for p in tb.iterdir() if p.is_dir())),
                           size_guidance={"scalars": 0})
    acc.Reload()
    bubbles = [e.value for e in acc.Scalars("pipeline/bubble-fraction")]
    assert len(bubbles) == 3 and all(0.0 < b < 1.0 for b in bubbles)
    assert acc.Scalars("comm/pp-bytes-per-step")[-1].value == results[0]["log"]["comm/pp-bytes-per-step"]
    assert [e.value for e in acc.Scalars("lm loss")] == pytest.approx(ref_losses, rel=1e-5)


def _save_at_pp2(rank, world_size, args):
    return _train(args).losses


def test_saved_at_pp2_resumes_at_pp1(tmp_path):
    base = tiny_args(extra=LAYERS)
    full = _train(base + ["--train-iters", "4"]).losses
    first = run_on_ranks(_save_at_pp2, 2, args=(base + ["--train-iters", "2", "--save", str(tmp_path),
                                                         "--pipeline-model-parallel-size", "2"],),
                         timeout=300)
    assert first[0] == pytest.approx(full[:2], rel=1e-5)
    second = _train(base + ["--train-iters", "4", "--load", str(tmp_path)]).losses
    assert second == pytest.approx(full[2:], rel=1e-5)
