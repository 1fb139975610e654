"""The trainer with pipeline parallelism (pretrain.pipeline_stage) against the same config
at PP 1 in one process, fp32: per-iteration losses, gradient norms (clipped at 1.0: the norm spans
every stage) and the validation loss within rtol 1e-5 for PP 2 x DP 2 (1F1B, ZeRO 1, full
recompute) and PP 2 x TP 2 + SP (interleaved, 2 chunks per stage, ZeRO 2); fp16 loss-scale
overflows skip the same steps on every rank as at PP 1; a run saved at PP 2 resumes at PP 1 on the
uninterrupted PP 1 curve; the log line carries the measured bubble and the PP bytes.

PP bytes per step (hybrid.pipeline.runner): each of the p v - 1 boundaries of the (virtual)
pipeline carries one activation forward and one gradient back per micro-batch, b s h elements each
(b s h / t with sequence parallelism), so a PP column sends 2 m (p v - 1) b s h x bytes per step; the
ledger counts a message at its sender. With p = 2, v = 1 stage 0 sends m activations and stage 1
m gradients: m b s h x 4 bytes (fp32) each, 2 m (p - 1) b s h x 4 together.
"""

from __future__ import annotations

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from hybrid.testing.multirank import run_on_ranks
from tests.training_helpers import SEQ, make_trainer, tiny_args

LAYERS = ["--num-layers", "4", "--lr-decay-iters", "4"]
EVAL = ["--eval-interval", "1000", "--eval-iters", "2"]
MICRO, GLOBAL, HIDDEN = 2, 8, 32          # tiny_args: --micro-batch-size 2, --global-batch-size 8


def _train(args):
    trainer = make_trainer(args)
    trainer.train()
    return trainer


def _run(rank, world_size, args):
    """Train, then evaluate once; every rank's losses, validation loss, logged metrics of each
    iteration (--log-interval 1), skipped steps and final loss scale."""
    trainer = make_trainer(args)
    logged = []
    write = trainer.metrics.log
    trainer.metrics.log = lambda m, step: (logged.append(dict(m)), write(m, step))
    trainer.train()
    valid = trainer.evaluate()
    trainer.metrics.close()
    steps = [m for m in logged if "iteration-time" in m]
    return {"losses": trainer.losses, "valid": valid, "stage": trainer.state.pp_rank,
            "dp": trainer.state.dp_rank, "tp": trainer.state.tp_rank, "log": steps[0],
            "grad_norms": [m["grad-norm"] for m in steps], "skipped": trainer.ts.skipped_iterations,
            "scale": trainer.optimizer.scaler.scale}


LAYOUTS = {"pp2-dp2-1f1b": (1, ["--zero-stage", "1", "--recompute", "full"]),
           "pp2-tp2-sp-interleaved": (2, ["--zero-stage", "2", "--sequence-parallel",
                                          "--num-layers-per-virtual-pipeline-stage", "1"])}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_pipeline_trainer_matches_pp1(tmp_path, layout):
    tb = tmp_path / "tb"
    tp, options = LAYOUTS[layout]
    logging = ["--log-interval", "1"]
    ref = _run(0, 1, tiny_args(iters=3, extra=LAYERS + EVAL + logging))
    pp = ["--pipeline-model-parallel-size", "2", "--tensorboard-dir", str(tb)] + options
    results = run_on_ranks(_run, 4, args=(tiny_args(tp=tp, iters=3, extra=LAYERS + EVAL + logging
                                                    + pp),), timeout=400)
    ref_losses = ref["losses"]
    for r in results:   # every rank reports the last stage's loss and the whole model's norm
        assert r["losses"] == pytest.approx(ref_losses, rel=1e-5), (layout, r)
        assert r["valid"] == pytest.approx(ref["valid"], rel=1e-5), (layout, r)
        assert r["grad_norms"] == pytest.approx(ref["grad_norms"], rel=1e-5), (layout, r)
    assert min(ref["grad_norms"]) > 1.0      # --clip-grad 1.0 clipped every step
    for r in results:
        assert 0.0 < r["log"]["pipeline/bubble-fraction"] < 1.0, r["log"]
    dp = 4 // (2 * tp)
    m, v = GLOBAL // (MICRO * dp), (2 if tp == 2 else 1)
    message = MICRO * SEQ * HIDDEN * 4 / tp                   # b s h fp32 bytes (/ t with SP)
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
    # the roofline of rank 0's stage (its layers, no output layer): a step is slower than its GEMMs
    assert all(0.0 < e.value < 1.0 for e in acc.Scalars("perf/gemm-bound-fraction"))


def test_fp16_overflows_skip_the_same_steps_on_every_stage():
    """A loss scale of 2^20 overflows the first fp16 steps: the overflow is found in some stage's
    gradients and both stages skip (the engine's norm spans the stages), as at PP 1 with the same
    DP degree (each rank then sums the same m fp16 micro-batch gradients; whether a sum overflows
    depends on how many are summed before the DP reduction)."""
    scaler = ["--initial-loss-scale", str(2.0 ** 20), "--hysteresis", "1", "--log-interval", "1"]
    ref = _run(0, 1, tiny_args(precision="fp16", iters=3, extra=LAYERS + EVAL + scaler))
    results = run_on_ranks(_run, 2, args=(tiny_args(precision="fp16", iters=3, extra=LAYERS + EVAL
                                                    + scaler + ["--pipeline-model-parallel-size",
                                                                "2"]),), timeout=400)
    assert ref["skipped"] > 0
    for r in results:
        assert (r["skipped"], r["scale"]) == (ref["skipped"], ref["scale"]), r
        assert r["losses"] == pytest.approx(ref["losses"], rel=1e-2, nan_ok=True), r


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


def test_start_up_report_names_the_pipeline_layout():
    from hybrid.parallel_state import ParallelState
    from hybrid.topology import Topology
    from pretrain.arguments import parse_args
    from pretrain.startup_report import link_report
    cfg, _ = parse_args(["--world-size", "8", "--gpus-per-node", "2", "--num-layers", "8",
                         "--pipeline-model-parallel-size", "4", "--num-layers-per-virtual-pipeline-stage",
                         "1", "--micro-batch-size", "1", "--global-batch-size", "8"])
    state = ParallelState.dry_run(Topology(8, 1, gpus_per_node=2, pipeline_parallel_size=4), rank=3)
    text = link_report(state, cfg.pipeline_config(cfg.layout(8)))
    assert "pp group [1, 3, 5, 7]: 3 of its 3 stage boundaries cross hosts" in text
    assert ("pipeline: interleaved, PP 4 stages x 2 model chunk(s) of 1 layers, m 4 micro-batches "
            "per step; stage 1 holds layers [1, 2), [5, 6); bubble (p-1)/(v m+p-1) = 0.273") in text


@pytest.mark.parametrize("schedule,v", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2)])
def test_forward_only_schedule_is_the_training_forwards(schedule, v):
    """Evaluation runs each stage's forwards in the training schedule's order and nothing else;
    simulated without backwards (every forward waits only on the previous virtual stage), it
    completes."""
    from hybrid.pipeline import PipelineConfig, build_schedule
    from hybrid.pipeline.schedules import forward_only
    config = PipelineConfig(4, 8, 16, schedule, v)
    for train, evaluation in zip(build_schedule(config), forward_only(config)):
        assert evaluation == [a for a in train if a.kind == "F"]
        assert len(evaluation) == 8 * v
    done, position = set(), [0] * 4
    lists = forward_only(config)
    while any(position[s] < len(lists[s]) for s in range(4)):
        progressed = False
        for s in range(4):
            if position[s] < len(lists[s]):
                a = lists[s][position[s]]
                k = a.chunk * 4 + s
                if k == 0 or (a.micro_batch, k - 1) in done:
                    done.add((a.micro_batch, k))
                    position[s] += 1
                    progressed = True
        assert progressed, "forward-only schedule deadlocks"


def _first_loss_from_hf(rank, world_size, hf_dir):
    record: list = []
    trainer = make_trainer(tiny_args(iters=1, extra=["--init-from-hf", hf_dir,
                                                     "--pipeline-model-parallel-size", "2"]), record)
    trainer.train()
    return trainer.losses[0], [i for batch in record for i in batch]


def test_init_from_hf_fills_every_stage(tmp_path):
    """--init-from-hf at PP 2: each stage's chunks take their layers, the first stage the word
    embedding and the last stage's tied copy follows it; the first loss is the reference GPT's with
    those weights."""
    from models.gpt.hf import save_hf_directory
    from tests.pretrain.test_init_from_hf import CONFIG, _random_weights, _reference_loss
    weights = _random_weights()
    hf_dir = str(save_hf_directory(tmp_path / "hf", CONFIG, weights))
    for loss, samples in run_on_ranks(_first_loss_from_hf, 2, args=(hf_dir,), timeout=300):
        assert len(samples) == 8
        assert loss == pytest.approx(_reference_loss(weights, samples), abs=1e-5)


def _losses_on_rank(rank, world_size, args):
    return _train(args).losses


def test_untied_output_layer_with_offloaded_optimizer():
    """PP 2 with its own output layer on the last stage (no tied copy) and ZeRO 2 with the
    optimizer state on the CPU (ZeRO-Offload) matches PP 1 with the same options."""
    args = tiny_args(iters=3, extra=LAYERS + ["--untie-embeddings-and-output-weights", "--zero-stage",
                                              "2", "--offload-optimizer", "cpu"])
    ref = _train(args).losses
    results = run_on_ranks(_losses_on_rank, 2, args=(args + ["--pipeline-model-parallel-size", "2"],),
                           timeout=300)
    for losses in results:
        assert losses == pytest.approx(ref, rel=1e-5)
