"""Metrics: the TensorBoard event files hold every Megatron-named scalar (read back with
tensorboard's EventAccumulator), the model-state bytes per category, and a DP traffic per step
equal to ZeRO's 2Ψ(n-1)/n for stage 2 (docs/design.md §Paper); only the writer rank writes."""

from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from hybrid.training.metrics import SCALAR_NAMES, VALIDATION_NAMES, console_line, format_duration
from tests.multirank import run_on_ranks
from tests.training_helpers import make_trainer, tiny_args

CPU_SCALARS = [n for n in SCALAR_NAMES if n != "mem-max-allocated-bytes"]   # RSS on CPU


def _train(rank, world_size, tb_dir):
    args = tiny_args(zero=2, precision="bf16", iters=2,
                     extra=["--global-batch-size", "4", "--log-interval", "1", "--eval-interval", "2",
                            "--eval-iters", "1", "--tensorboard-dir", tb_dir])
    trainer = make_trainer(args)
    trainer.train()
    trainer.metrics.close()
    report = trainer.optimizer.comm_report()
    return {"expected_dp": report.expected_dp_bytes, "is_writer": trainer.metrics.is_writer}


def _scalars(tb_dir: str) -> EventAccumulator:
    acc = EventAccumulator(tb_dir, size_guidance={"scalars": 0})
    acc.Reload()
    return acc


def test_tensorboard_scalars_and_dp_traffic(tmp_path):
    tb_dir = str(tmp_path / "tb")
    results = run_on_ranks(_train, 2, args=(tb_dir,), timeout=300)
    assert [r["is_writer"] for r in results] == [True, False]
    assert len(list(Path(tb_dir).glob("events.out.tfevents.*"))) == 1   # one writer rank
    acc = _scalars(tb_dir)
    tags = set(acc.Tags()["scalars"])
    missing = set(CPU_SCALARS) | set(VALIDATION_NAMES) | {
        "comm/dp-bytes-per-step", "comm/tp-bytes-per-step"} | {
        f"model-state/{c}-bytes" for c in ("param16", "grad16", "master32", "adam_moments")}
    missing -= tags
    assert not missing, f"scalars not written: {sorted(missing)}"
    assert [e.step for e in acc.Scalars("lm loss")] == [1, 2]
    assert acc.Scalars("batch-size")[0].value == 4
    dp_bytes = acc.Scalars("comm/dp-bytes-per-step")[-1].value
    expected = results[0]["expected_dp"]            # 2 psi (n-1)/n bytes of bf16, ZeRO §7
    assert abs(dp_bytes - expected) <= 0.02 * expected, (dp_bytes, expected)
    ppl = acc.Scalars("lm loss validation ppl")[0].value
    loss = acc.Scalars("lm loss validation")[0].value
    assert abs(ppl - 2.718281828 ** loss) < 1e-3 * ppl


def test_console_line_has_every_field():
    m = {"consumed-samples": 64, "iteration-time": 0.25, "tokens-per-second": 4096, "throughput": 0.5,
         "mfu": 0.004, "learning-rate": 1e-3, "lm loss": 5.5, "loss-scale": 65536, "grad-norm": 1.25,
         "skipped-iterations": 1, "mem-rss-bytes": 300 * 2**20}
    line = console_line(m, 8, 100, 3725)
    for part in ("iteration      8/100", "consumed samples 64", "ms/iter 250.0", "tokens/s 4096",
                 "TFLOP/s/rank 0.5000", "MFU 0.400%", "lr 1.000e-03", "lm loss 5.5000",
                 "loss scale 65536", "grad norm 1.250", "skipped 1", "mem 300 MB", "ETA 1:02:05"):
        assert part in line, part
    assert format_duration(59) == "0:00:59"
