"""Megatron-LM's flags with Megatron's meaning (pretrain/megatron_flags.py): the docs table is the
catalogue; every catalogue flag does what the table says (native: sets its field; mapped: sets the
documented field; no-op: changes nothing; refused: the documented message); unknown flags get only
typo or prefix suggestions; --help shows every default; and Megatron's GPT-3 175B example flag set,
scaled to a tiny model, trains here on 2 CPU ranks and resumes."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
from pathlib import Path

import pytest

from pretrain import megatron_flags as mf
from pretrain.arguments import build_parser, parse_args
from pretrain.config import TrainConfig, TrainConfigError
from pretrain.lr_schedule import LRSchedule
from pretrain.sections import SECTIONS

REPO = Path(__file__).resolve().parents[2]

# value(s) each non-native catalogue flag is tried with; a conditional no-op also with a value it
# refuses. Each mapped flag: the argv it needs besides its own and the fields it must set.
SAMPLE = {int: "1", float: "1.0", str: "auto"}
NOOP_VALUES = {"--rotary-percent": ("1.0", "0.5"), "--expert-model-parallel-size": ("1", "2"),
               "--context-parallel-size": ("1", "2"), "--optimizer": ("adam", "sgd"),
               "--lr-warmup-init": ("0.0", "1e-5"), "--dataloader-type": ("single", "cyclic"),
               "--moe-token-drop-policy": ("probs", "position")}
NOOP_CONTEXT = {"--grad-reduce-in-bf16": (["--bf16"], []),
                "--calculate-per-token-loss": ([], ["--eod-mask-loss"])}
MAPPED = {
    "--use-distributed-optimizer": ([], [], {"parallel.zero_stage": 1}),
    "--recompute-activations": ([], [], {"training.recompute": "selective"}),
    "--recompute-granularity": (["selective"], [], {"training.recompute": "selective"}),
    "--distribute-saved-activations": (
        ["--recompute-granularity", "full", "--recompute-method", "uniform",
         "--recompute-num-layers", "1"], [], {"training.recompute": "full-pa"}),
    "--override-opt_param-scheduler": ([], [], {"optimizer.override_opt_param_scheduler": True}),
    "--use-checkpoint-opt_param-scheduler": (
        [], [], {"optimizer.use_checkpoint_opt_param_scheduler": True}),
    "--use-rotary-position-embeddings": ([], [], {"model.position_embedding_type": "rope"}),
    "--layernorm-epsilon": (["1e-6"], [], {"model.norm_epsilon": 1e-6}),
    "--data-cache-path": (["somewhere"], [], {"data.data_cache_dir": "somewhere"}),
    "--mock-data": ([], [], {"data.data_path": []}),
    "--virtual-pipeline-model-parallel-size": (
        ["2"], ["--num-layers", "8", "--pipeline-model-parallel-size", "2"],
        {"parallel.num_layers_per_virtual_pipeline_stage": 2}),
    "--kv-channels": (["16"], [], {"model.num_attention_heads": 4}),   # 64 / 4: checked only
}


def _value(cfg: TrainConfig, key: str):
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name)


def _by_kind(kind):
    return [f.name for f in mf.CATALOGUE if f.kind == kind]


def test_docs_page_is_the_catalogue():
    page = (REPO / "docs" / "megatron-flags.md").read_text()
    assert page == mf.markdown(), ("docs/megatron-flags.md is stale: regenerate it with "
                                   "python -m pretrain.megatron_flags > docs/megatron-flags.md")
    for f in mf.CATALOGUE:
        assert f"| `{f.name}` | {f.kind} |" in page


@pytest.mark.parametrize("name", _by_kind(mf.NATIVE))
def test_native_flags_set_the_field_of_their_name(name):
    flag = mf.BY_NAME[name]
    field = flag.here.strip("`")
    actions = {s: a for a in build_parser()._actions for s in a.option_strings}
    assert actions[name].dest == field, f"{name} sets {actions[name].dest}, the table says {field}"
    section, key = field.split(".")
    assert key in {f.name for f in dataclasses.fields(SECTIONS[section])}


def test_native_values_reach_the_config():
    cfg, _ = parse_args(["--train-samples", "64", "--lr-warmup-fraction", "0.25", "--fp16",
                         "--loss-scale", "512", "--exit-interval", "3", "--no-load-optim",
                         "--no-load-rng", "--recompute", "full", "--recompute-method", "block",
                         "--recompute-num-layers", "1", "--override-opt-param-scheduler"])
    assert (cfg.training.train_samples, cfg.optimizer.lr_warmup_fraction) == (64, 0.25)
    assert (cfg.optimizer.loss_scale, cfg.training.exit_interval) == (512.0, 3)
    assert (cfg.checkpoint.load_optim, cfg.checkpoint.load_rng) == (False, False)
    assert (cfg.training.recompute_method, cfg.training.recompute_num_layers) == ("block", 1)
    assert cfg.optimizer.override_opt_param_scheduler
    assert cfg.train_iterations(cfg.layout(2)) == 64 // (4 * 2)   # samples / (micro 4 x DP 2)


@pytest.mark.parametrize("name", _by_kind(mf.NOOP))
def test_noop_flags_change_nothing(name, caplog):
    flag = mf.BY_NAME[name]
    accepted, refused = NOOP_VALUES.get(name, (None, None))
    own = [] if flag.value == mf.SWITCH else [accepted or SAMPLE[flag.value]]
    context, refusing_context = NOOP_CONTEXT.get(name, ([], None))
    with caplog.at_level("INFO", logger="pretrain.megatron_flags"):
        cfg, _ = parse_args(context + [name, *own])
    assert cfg == parse_args(context)[0]
    assert f"{name}: accepted, nothing to change ({flag.here})" in caplog.text
    for argv in ([name, refused] if refused else None,
                 refusing_context + [name, *own] if refusing_context else None):
        if argv is not None:
            refusal = "not supported here .*" + re.escape(flag.meaning)
            with pytest.raises(TrainConfigError, match=refusal):
                parse_args(argv)


@pytest.mark.parametrize("name", _by_kind(mf.REFUSED))
def test_refused_flags_say_meaning_and_nearest_equivalent(name):
    flag = mf.BY_NAME[name]
    with pytest.raises(TrainConfigError) as err:
        parse_args([name, "1"])
    message = str(err.value)
    assert message.startswith(f"{name} 1 is not supported here")
    assert flag.meaning in message and flag.here in message
    assert "did you mean" not in message


@pytest.mark.parametrize("name", _by_kind(mf.MAPPED))
def test_mapped_flags_set_what_the_table_says(name, caplog):
    own, context, expected = MAPPED[name]
    with caplog.at_level("INFO", logger="pretrain.megatron_flags"):
        cfg, _ = parse_args(context + [name, *own])
    for key, value in expected.items():
        assert _value(cfg, key) == value
    logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith(f"{name}: ")]
    assert len(logged) == 1                      # one start-up line with the resolved values
    for key, value in expected.items():
        assert f"{key} = {value!r}" in logged[0] or name in ("--kv-channels", "--mock-data")


def test_mapped_flags_refuse_contradictions():
    cases = [(["--use-distributed-optimizer", "--zero-stage", "0"], "--zero-stage 0 was given"),
             (["--recompute-granularity", "full"], "needs --recompute-method"),
             (["--recompute-activations", "--recompute", "full"], "--recompute full was given too"),
             (["--kv-channels", "32"], "--kv-channels 32: the head size here is always"),
             (["--mock-data", "--data-path", "x"], "drop one of them"),
             (["--distribute-saved-activations"], "add --recompute-granularity full")]
    for argv, message in cases:
        with pytest.raises(TrainConfigError, match=message):
            parse_args(argv)
    stage3, _ = parse_args(["--use-distributed-optimizer", "--zero-stage", "3"])
    assert stage3.parallel.zero_stage == 3          # a stage given wins


@pytest.mark.parametrize("typed,suggested", [
    ("--distributed-optimizer", None), ("--use-distributed-adam", None), ("--finetuning", None),
    ("--vocab-filename", None), ("--loss-scaling", None), ("--context-parallel-degree", None),
    ("--use-distributed-optimiser", "--use-distributed-optimizer"),
    ("--tensor-model-paralel-size", "--tensor-model-parallel-size"), ("--vocab-files", "--vocab-file"),
    ("--context-parallel", "--context-parallel-size"), ("--seq-len", "--seq-length"),
    ("--lr-warmup-fractions", "--lr-warmup-fraction")])
def test_unknown_flags_suggest_only_typos_and_prefixes(typed, suggested):
    with pytest.raises(TrainConfigError) as err:
        parse_args([typed])
    message = str(err.value)
    if suggested is None:
        assert "did you mean" not in message, message
    else:
        assert f"did you mean {suggested}?" in message


def test_help_prints_every_default():
    helps: dict[str, str] = {}   # dest -> help texts of its flags (--x and Megatron's --disable-x)
    for a in build_parser()._actions:
        helps[a.dest] = helps.get(a.dest, "") + (a.help or "")
    for section, section_cls in SECTIONS.items():
        for f in dataclasses.fields(section_cls):
            assert "default" in helps[f"{section}.{f.name}"], f"{section}.{f.name} shows no default"
    text = build_parser().format_help()
    assert "--adam-beta2 FLOAT" in text and "(default: 0.95)" in text


def test_documented_defaults_differ_from_megatrons():
    for key, (theirs, why) in mf.DIFFERENT_DEFAULTS.items():
        assert mf.default_of(key) != theirs, f"{key}: same default as Megatron, drop the row"
        assert why


def test_keep_all_checkpoints_and_detected_peak_by_default():
    from pretrain.device_peaks import device_peak_tflops, peak_tflops_of
    cfg, _ = parse_args([])
    assert cfg.checkpoint.keep_last_checkpoints is None and cfg.logging.peak_tflops is None
    assert peak_tflops_of("NVIDIA H100 80GB HBM3") == 989.0
    assert peak_tflops_of("NVIDIA H100 PCIe") == 756.0
    assert peak_tflops_of("Tesla V100-SXM2-32GB") == 125.0
    assert peak_tflops_of("NVIDIA A100-SXM4-80GB") == 312.0
    peak, why = device_peak_tflops(__import__("torch").device("cpu"))
    assert peak is None and "MFU is not reported" in why


# ---- Megatron's GPT-3 175B example (examples/gpt3/train_gpt3_175b_distributed.sh) ---------------
# Its flag set, each value scaled to a tiny model where it is a size, everything else as written;
# --data-path points at a tiny corpus and --tokenizer-model stands for --vocab-file/--merge-file.
# Its batch ramp, scaled: 2 samples per step until 32 tokens (2 samples of 16) are consumed, then 4.
def gpt3_175b_flags(data: dict, ckpt: Path, runs: Path) -> list[str]:
    model = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
             "--seq-length", "16", "--max-position-embeddings", "16", "--attention-backend", "auto"]
    training = ["--micro-batch-size", "1", "--global-batch-size", "4",
                "--step-batch-size-schedule", "0:2 32:4", "--train-iters", "3",
                "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95",
                "--init-method-std", "0.006", "--clip-grad", "1.0", "--fp16", "--lr", "6.0e-5",
                "--lr-decay-style", "cosine", "--min-lr", "6.0e-6", "--lr-warmup-fraction", ".001",
                "--lr-decay-iters", "3"]
    model_parallel = ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "2"]
    data_args = ["--data-path", data["prefix"], "--tokenizer-model", data["tokenizer"],
                 "--split", "949,50,1"]
    eval_and_logging = ["--log-interval", "1", "--save-interval", "2", "--eval-interval", "2",
                        "--save", str(ckpt), "--load", str(ckpt), "--eval-iters", "1",
                        "--tensorboard-dir", str(runs)]
    return model + training + model_parallel + data_args + eval_and_logging


def test_gpt3_175b_example_runs(tmp_path):
    """Two CPU ranks (PP 2), fp16, the example's schedules: the batch ramp (2 samples, then 4:
    the pipeline runs 2 then 4 micro-batches, the ZeRO engine counts them), Megatron's learning
    rate at the samples consumed before each step in units of the final batch (warm-up of .001 x 3
    iterations, cosine to --min-lr at --lr-decay-iters) and a checkpoint that stores both.
    Resume semantics: tests/pretrain/test_megatron_resume.py."""
    from hybrid.testing.corpus import build_corpus
    from hybrid.testing.subprocesses import child_env
    from tests.reliability_helpers import torchrun
    data = build_corpus(tmp_path / "data")
    ckpt, runs = tmp_path / "ckpt", tmp_path / "runs"
    argv = gpt3_175b_flags(data, ckpt, runs) + ["--data-cache-dir", str(tmp_path / "cache")]
    run = subprocess.run(torchrun(2, argv), cwd=REPO, env=child_env(), capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    assert "done: 3 iterations" in run.stderr
    schedule = LRSchedule(6.0e-5, 6.0e-6, 0.001 * 3, 3, "cosine")
    logged = [float(x) for x in re.findall(r"\| lr ([0-9.e+-]+) \|", run.stderr)]
    consumed_before = [0, 2, 6]   # batches 2, 4, 4
    assert logged == pytest.approx([schedule(c / 4) for c in consumed_before], rel=1e-3)
    assert "iteration 2: global batch 4 (4 micro-batches per DP rank), batch ramp" in run.stderr
    meta = json.loads((ckpt / "iter_0000003" / "metadata.json").read_text())
    assert meta["train_state"]["consumed_train_samples"] == 10
    cfg = meta["config"]
    assert (cfg["parallel"]["pipeline_model_parallel_size"], cfg["optimizer"]["fp16"]) == (2, True)
    assert meta["train_state"]["lr_schedule"] == pytest.approx(schedule.record(4))
