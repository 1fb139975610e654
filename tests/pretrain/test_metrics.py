"""Metrics that tell the truth, read back from the TensorBoard event files with tensorboard's
EventAccumulator after short real runs: every documented scalar is written, DP traffic per step
equals ZeRO's 2Ψ(n-1)/n for stage 2 (docs/design.md §Paper), evaluation and checkpoint saves are
timed on their own and left out of the iteration time and of the per-step TP/DP bytes, the peak
RSS never reads below the current RSS, the model-state bytes are logged at every log step, each run
gets its own run directory, and the resolved config is in the HParams and text tabs."""

import re
import time
from pathlib import Path

import pytest
import yaml
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams import plugin_data_pb2

from hybrid.testing.multirank import run_on_ranks
from pretrain.arguments import parse_args
from pretrain.config import TrainConfigError
from pretrain.metrics import (CUDA_MEMORY_NAMES, HOST_MEMORY_NAMES, SCALAR_NAMES,
                                     VALIDATION_NAMES, claim_run_dir, console_line,
                                     cuda_memory_bytes, format_duration, host_memory_bytes)
from tests.training_helpers import SEQ, make_trainer, tiny_args

CATEGORIES = ("param16", "grad16", "master32", "adam_moments", "buffers")


def _train(rank, world_size, tb_dir):
    args = tiny_args(zero=2, precision="bf16", iters=2,
                     extra=["--global-batch-size", "4", "--log-interval", "1", "--eval-interval", "2",
                            "--eval-iters", "1", "--tensorboard-dir", tb_dir,
                            "--peak-tflops", "125"])   # a CPU has no table peak: MFU needs one
    trainer = make_trainer(args)
    trainer.train()
    trainer.metrics.close()
    report = trainer.optimizer.comm_report()
    return {"expected_dp": report.expected_dp_bytes, "is_writer": trainer.metrics.is_writer}


def _events(run_dir) -> EventAccumulator:
    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def _only_run_dir(tb_dir: Path) -> Path:
    runs = [p for p in tb_dir.iterdir() if p.is_dir()]
    assert len(runs) == 1, runs
    return runs[0]


def test_tensorboard_scalars_and_dp_traffic(tmp_path):
    tb_dir = tmp_path / "tb"
    results = run_on_ranks(_train, 2, args=(str(tb_dir),), timeout=300)
    assert [r["is_writer"] for r in results] == [True, False]
    run_dir = _only_run_dir(tb_dir)
    assert len(list(run_dir.glob("events.out.tfevents.*"))) == 1   # one writer rank
    acc = _events(run_dir)
    tags = set(acc.Tags()["scalars"])
    missing = set(SCALAR_NAMES) | set(HOST_MEMORY_NAMES) | set(VALIDATION_NAMES) | {
        "eval-time", "comm/dp-bytes-per-step", "comm/tp-bytes-per-step",
        "comm/dp-cross-host-bytes-per-step", "comm/tp-cross-host-bytes-per-step",
        "perf/gemm-bound-fraction", "perf/gemm-bound-time"} | {
        f"model-state/{c}-bytes" for c in ("param16", "grad16", "master32", "adam_moments")}
    missing -= tags
    assert not missing, f"scalars not written: {sorted(missing)}"
    assert not tags & set(CUDA_MEMORY_NAMES)                 # a CPU run
    assert [e.step for e in acc.Scalars("lm loss")] == [1, 2]
    assert acc.Scalars("batch-size")[0].value == 4
    dp_bytes = acc.Scalars("comm/dp-bytes-per-step")[-1].value
    expected = results[0]["expected_dp"]            # 2 psi (n-1)/n bytes of bf16, ZeRO §7
    assert abs(dp_bytes - expected) <= 0.02 * expected, (dp_bytes, expected)
    assert acc.Scalars("comm/dp-cross-host-bytes-per-step")[-1].value == 0   # one host
    for fraction, bound, seconds in zip(*(acc.Scalars(t) for t in (
            "perf/gemm-bound-fraction", "perf/gemm-bound-time", "iteration-time"))):
        assert 0 < bound.value < seconds.value               # a step does more than its GEMMs
        assert fraction.value == pytest.approx(bound.value / seconds.value, rel=1e-5)
    ppl = acc.Scalars("lm loss validation ppl")[0].value
    loss = acc.Scalars("lm loss validation")[0].value
    assert abs(ppl - 2.718281828 ** loss) < 1e-3 * ppl


# --- bytes per group and op on two hosts (4 gloo ranks, 2 a "host") ----------------------------------
def _train_two_hosts(rank, world_size, tb_dir):
    """ZeRO stage 3 with qgZ, DP 4 over hosts {0, 1} and {2, 3}: DP all-gathers over both hosts,
    the reduce-scatter as an all-to-all inside each host and one across them."""
    import logging
    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    for name in ("pretrain.trainer", "pretrain.setup"):
        logging.getLogger(name).addHandler(handler)
        logging.getLogger(name).setLevel(logging.INFO)
    args = tiny_args(zero=3, precision="bf16", iters=2,
                     extra=["--gpus-per-node", "2", "--dp-transport", "gloo",
                            "--zero-quantized-gradients", "--global-batch-size", "8",
                            "--log-interval", "1", "--tensorboard-dir", tb_dir])
    trainer = make_trainer(args)
    trainer.train()
    trainer.metrics.close()
    return {"measured": [m for m in seen if m.startswith("bytes per rank per step, measured")],
            "expected": [m for m in seen if m.startswith("DP bytes per rank per step, expected")]}


def test_bytes_per_group_and_op_split_by_host(tmp_path):
    """Per (group, op): the scalars add up to the group's, and each op's cross-host share is what
    the hosts of its group make it (hybrid.perf.links): gloo's direct all-gather over hosts 0,0,1,1
    sends 2 of its 3 peer messages away, qgZ's hop inside a host none, its hop across hosts all;
    the first logged step's split is in the log, and the volumes are those the start-up report
    expects from the formulas."""
    tb_dir = tmp_path / "tb"
    results = run_on_ranks(_train_two_hosts, 4, args=(str(tb_dir),), timeout=600)
    acc = _events(_only_run_dir(tb_dir))
    last = {t: acc.Scalars(t)[-1].value for t in acc.Tags()["scalars"] if t.startswith("comm/")}
    ops = {("dp", "all_gather"), ("dp_intra_host", "all_to_all"), ("dp_inter_host", "all_to_all")}
    per_op = {(g, op): (last[f"comm/{g}-{op}-bytes-per-step"],
                        last[f"comm/{g}-{op}-cross-host-bytes-per-step"]) for g, op in ops}
    assert not [t for t in last if t.startswith("comm/dp-reduce_scatter")]   # qgZ replaced it
    for part in ("", "cross-host-"):
        op_tag = re.compile(rf"comm/dp[a-z_]*-[a-z_]+-{part}bytes-per-step")
        dp_ops = [v for t, v in last.items() if op_tag.fullmatch(t)]
        assert len(dp_ops) == 3
        assert sum(dp_ops) == pytest.approx(last[f"comm/dp-{part}bytes-per-step"], rel=1e-6)
    gather, intra, inter = (per_op[k] for k in (("dp", "all_gather"), ("dp_intra_host", "all_to_all"),
                                                ("dp_inter_host", "all_to_all")))
    assert gather[0] > 0 and gather[1] == pytest.approx(gather[0] * 2 / 3)
    assert intra[0] > 0 and intra[1] == 0
    assert inter[0] > 0 and inter[1] == inter[0]
    # the volumes the start-up report expects (the dry run's formulas; unpadded, hence 1%)
    [report] = results[0]["expected"]
    expected = {tuple(line.split(":")[0].split()): float(line.split(": ")[1].split(" B")[0]
                                                         .replace(",", ""))
                for line in report.splitlines()[1:]}
    assert set(expected) == ops
    for key, (volume, _) in per_op.items():
        assert volume == pytest.approx(expected[key], rel=0.01), key
    [text] = results[0]["measured"]
    assert f"dp_inter_host all_to_all: {inter[0]:,.0f} B per step, 0 B inside hosts, " \
           f"{inter[1]:,.0f} B across hosts" in text


# --- evaluation and checkpoints off the clock, memory, config (one 4-rank run: TP 2 x DP 2) -------
ITERS, EVAL_AT, SAVE_AT = 5, (2, 4, 5), (3, 5)   # 5: the end of training (not a multiple of 2)


def _train_heavy_eval(rank, world_size, tb_dir, save_dir):
    """ZeRO stage 3 at TP 2 x DP 2: evaluation moves TP (f/g all-reduces) and DP (parameter
    all-gathers) traffic. 30 validation batches per evaluation make it far longer than a step."""
    args = tiny_args(tp=2, zero=3, iters=ITERS,
                     extra=["--log-interval", "1", "--eval-interval", "2", "--eval-iters", "30",
                            "--save", save_dir, "--save-interval", "3", "--tensorboard-dir", tb_dir,
                            "--peak-tflops", "125"])   # a CPU has no table peak: MFU needs one
    trainer = make_trainer(args)
    trainer.train()
    trainer.metrics.close()
    return {"config": trainer.cfg.to_dict(), "tokens_per_iteration": trainer.layout.global_batch * SEQ,
            "run_dir": str(trainer.metrics.run_dir)}


@pytest.fixture(scope="module")
def heavy_eval_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("heavy_eval")
    results = run_on_ranks(_train_heavy_eval, 4, args=(str(tmp / "tb"), str(tmp / "ckpt")),
                           timeout=600)
    return results[0], _events(_only_run_dir(tmp / "tb"))


def _series(acc: EventAccumulator, tag: str) -> dict[int, object]:
    return {e.step: e for e in acc.Scalars(tag)}


def test_iteration_time_excludes_evaluation_and_checkpoints(heavy_eval_run):
    result, acc = heavy_eval_run
    it, ev, ck = (_series(acc, t) for t in ("iteration-time", "eval-time", "checkpoint-save-time"))
    assert sorted(it) == list(range(1, ITERS + 1))
    assert sorted(ev) == list(EVAL_AT) and sorted(ck) == list(SAVE_AT)
    # step 2 follows no evaluation or save: a plain step, which the evaluation must dwarf
    assert ev[2].value > 2 * it[2].value, "the evaluation is not heavy: the test would be blind"
    for step in range(2, ITERS + 1):
        # the wall clock between two log points holds the step, the logging and whatever ran
        # after the previous log point: an evaluation and a save must not be in iteration-time
        between = it[step].wall_time - it[step - 1].wall_time
        aside = sum(s[step - 1].value for s in (ev, ck) if step - 1 in s)
        assert it[step].value <= between - aside + 1e-3, (step, it[step].value, between, aside)
    assert it[3].value < ev[2].value           # the step after the evaluation: not inflated by it
    tokens = _series(acc, "tokens-per-second")
    tflops, mfu = _series(acc, "throughput"), _series(acc, "mfu")
    for step, e in it.items():                  # all derived from the same (training) time
        assert tokens[step].value == pytest.approx(result["tokens_per_iteration"] / e.value, rel=1e-4)
        assert tflops[step].value * e.value == pytest.approx(tflops[3].value * it[3].value, rel=1e-4)
        assert mfu[step].value == pytest.approx(tflops[step].value / 125.0, rel=1e-4)


def test_bytes_per_step_exclude_evaluation_and_checkpoints(heavy_eval_run):
    _, acc = heavy_eval_run
    for group in ("dp", "tp"):
        per_step = [e.value for e in acc.Scalars(f"comm/{group}-bytes-per-step")]
        assert len(per_step) == ITERS and per_step[0] > 0
        assert per_step == [per_step[0]] * ITERS, (group, per_step)   # eval steps like the others


def test_memory_at_every_log_step(heavy_eval_run):
    _, acc = heavy_eval_run
    rss, peak = _series(acc, "mem-rss-bytes"), _series(acc, "mem-max-rss-bytes")
    assert sorted(rss) == sorted(peak) == list(range(1, ITERS + 1))
    for step in rss:
        assert peak[step].value >= rss[step].value > 0, step
    for c in CATEGORIES:
        assert sorted(_series(acc, f"model-state/{c}-bytes")) == list(range(0, ITERS + 1)), c
    for c in CATEGORIES[:-1]:
        assert sorted(_series(acc, f"model-state/{c}-paper-bytes")) == list(range(0, ITERS + 1)), c


def test_resolved_config_in_hparams_and_text_tabs(heavy_eval_run):
    result, acc = heavy_eval_run
    text = acc.Tensors("config/text_summary")
    assert len(text) == 1
    body = text[0].tensor_proto.string_val[0].decode()
    assert yaml.safe_load(body.strip().strip("`")) == result["config"]   # loads back as a --config
    content = acc.PluginTagToContent("hparams")
    start = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"])
    hparams = start.session_start_info.hparams
    assert hparams["parallel.zero_stage"].number_value == 3
    assert hparams["parallel.tensor_model_parallel_size"].number_value == 2
    assert hparams["checkpoint.save"].string_value.endswith("ckpt")
    assert hparams["checkpoint.load"].string_value == "none"
    config_fields = sum(len(fields) for fields in result["config"].values())
    assert len(hparams) == config_fields
    experiment = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/experiment"])
    assert [m.name.tag for m in experiment.experiment.metric_infos] == ["lm loss", "lm loss validation"]


@pytest.mark.parametrize("iters, evaluated_at", [(3, [2, 3]), (4, [2, 4])])
def test_validation_at_the_end_of_training(iters, evaluated_at):
    """As Megatron-LM: the final model is validated when --train-iters is not a multiple of
    --eval-interval, and not twice when it is; each evaluation reads eval-iters global batches."""
    trainer = make_trainer(tiny_args(iters=iters, extra=["--eval-interval", "2", "--eval-iters", "1"]))
    at = []
    evaluate = trainer.evaluate
    trainer.evaluate = lambda: (at.append(trainer.ts.iteration), evaluate())[1]
    trainer.train()
    trainer.metrics.close()
    assert at == evaluated_at
    assert trainer.ts.consumed_valid_samples == len(evaluated_at) * trainer.layout.global_batch


# --- run directories ------------------------------------------------------------------------
def _single_rank_run(tb_dir: Path, *extra: str) -> Path:
    trainer = make_trainer(tiny_args(iters=1, extra=["--log-interval", "1",
                                                     "--tensorboard-dir", str(tb_dir), *extra]))
    trainer.train()
    trainer.metrics.close()
    return trainer.metrics.run_dir


def test_each_run_writes_its_own_run_directory(tmp_path):
    tb_dir = tmp_path / "tb"
    first, second = _single_rank_run(tb_dir), _single_rank_run(tb_dir)
    assert first != second and first.parent == second.parent == tb_dir
    for run in (first, second):
        assert [e.step for e in _events(run).Scalars("lm loss")] == [1]   # not overlaid
        assert time.strptime(run.name[:15], "%Y%m%d-%H%M%S")              # named by start time
    named = _single_rank_run(tb_dir, "--run-name", "baseline")
    assert named == tb_dir / "baseline"
    assert sorted(p.name for p in tb_dir.iterdir()) == sorted([first.name, second.name, "baseline"])


def test_a_resumed_run_continues_its_run_directory(tmp_path):
    """The run directory is named by the run's id, which the checkpoint keeps: a resume (without
    --run-name) writes into the directory of the run it resumes; a fresh run gets its own."""
    tb_dir, ckpt = tmp_path / "tb", str(tmp_path / "ckpt")

    def run(iters: int, *extra: str) -> Path:
        trainer = make_trainer(tiny_args(iters=iters, extra=["--log-interval", "1", "--lr-decay-iters",
                                                             "4", "--tensorboard-dir", str(tb_dir),
                                                             "--save", ckpt, *extra]))
        trainer.train()
        trainer.metrics.close()
        return trainer.metrics.run_dir

    first = run(2)
    resumed = run(4, "--load", ckpt)
    assert resumed == first
    assert sorted(e.step for e in _events(first).Scalars("lm loss")) == [1, 2, 3, 4]
    fresh = run(1, "--overwrite")
    assert fresh != first and sorted(p.name for p in tb_dir.iterdir()) == sorted([first.name, fresh.name])


def test_runs_started_in_the_same_second_do_not_share_a_directory(tmp_path):
    now = time.time()
    runs = [claim_run_dir(tmp_path, None, now=now) for _ in range(3)]
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    assert [r.name for r in runs] == [stamp, f"{stamp}-2", f"{stamp}-3"]


def test_bad_run_directory_is_one_clear_error(tmp_path):
    for bad in ("../elsewhere", "/tmp/abs"):
        with pytest.raises(TrainConfigError, match="--run-name"):
            parse_args(tiny_args(extra=["--run-name", bad]))
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    with pytest.raises(ValueError, match="--tensorboard-dir .*file.*writable"):
        claim_run_dir(not_a_dir, None)
    assert not_a_dir.read_text() == ""


# --- memory probes --------------------------------------------------------------------------
def test_peak_rss_is_never_below_current_rss():
    held = []
    for i in range(300):                        # grow and shrink the heap between reads
        held.append(bytearray(64 * 1024 * (i % 7)))
        if i % 5 == 0:
            held.clear()
        m = host_memory_bytes()
        assert m["mem-max-rss-bytes"] >= m["mem-rss-bytes"] > 0, (i, m)
    status = "Name:\tpython\nVmHWM:\t  2048 kB\nVmRSS:\t  1536 kB\nThreads:\t1\n"
    assert host_memory_bytes(status) == {"mem-rss-bytes": 1536 * 1024.0,
                                         "mem-max-rss-bytes": 2048 * 1024.0}


def test_cuda_memory_scalars_from_allocator_stats():
    stats = {"allocated_bytes.all.current": 10, "allocated_bytes.all.peak": 30,
             "reserved_bytes.all.current": 64, "reserved_bytes.all.peak": 96, "num_alloc_retries": 2,
             "allocated_bytes.small_pool.current": 5}
    assert cuda_memory_bytes(stats) == {"mem-allocated-bytes": 10.0, "mem-max-allocated-bytes": 30.0,
                                        "mem-reserved-bytes": 64.0, "mem-max-reserved-bytes": 96.0,
                                        "mem-alloc-retries": 2.0}
    assert set(cuda_memory_bytes({})) == set(CUDA_MEMORY_NAMES)   # before the first allocation


def test_console_line_has_every_field():
    m = {"consumed-samples": 64, "iteration-time": 0.25, "tokens-per-second": 4096, "throughput": 0.5,
         "mfu": 0.004, "learning-rate": 1e-3, "lm loss": 5.5, "loss-scale": 65536, "grad-norm": 1.25,
         "skipped-iterations": 1, "mem-rss-bytes": 300 * 2**20}
    line = console_line(m, 8, 100, 3725)
    for part in ("iteration      8/100", "consumed samples 64", "ms/iter 250.0", "tokens/s 4096",
                 "TFLOP/s/rank 0.5000", "MFU 0.400%", "lr 1.000e-03", "lm loss 5.5000",
                 "loss scale 65536", "grad norm 1.250", "skipped 1", "mem 300 MiB", "ETA 1:02:05"):
        assert part in line, part
    assert "GEMM-bound" not in line                     # --no-roofline: no fraction
    assert "MFU 0.400% | GEMM-bound 62.5% | lr" in console_line(
        {**m, "perf/gemm-bound-fraction": 0.625}, 8, 100, 3725)
    assert format_duration(59) == "0:00:59"
