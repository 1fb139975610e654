"""Config and command line: Megatron flag names, file + override precedence, actionable messages,
and the learning-rate schedule against its closed form."""

import math

import pytest

from pretrain.arguments import PRESET_DIR, build_parser, parse_args
from pretrain.config import TrainConfig, TrainConfigError
from pretrain.lr_schedule import LRSchedule

MEGATRON_FLAGS = ["--tensor-model-parallel-size", "--micro-batch-size", "--global-batch-size",
                  "--num-layers", "--hidden-size", "--num-attention-heads", "--seq-length",
                  "--max-position-embeddings", "--train-iters", "--lr", "--min-lr", "--lr-warmup-iters",
                  "--lr-decay-style", "--weight-decay", "--clip-grad", "--bf16", "--fp16",
                  "--zero-stage", "--data-path", "--split", "--tokenizer-model", "--save", "--load",
                  "--save-interval", "--eval-interval", "--eval-iters", "--log-interval",
                  "--tensorboard-dir", "--exit-duration-in-mins", "--seed", "--sequence-parallel"]


def test_every_megatron_flag_exists():
    known = {s for a in build_parser()._actions for s in a.option_strings}
    assert set(MEGATRON_FLAGS) <= known


def test_file_then_flags_precedence(tmp_path):
    yaml_file = tmp_path / "run.yaml"
    yaml_file.write_text("model: {num_layers: 6, hidden_size: 96, num_attention_heads: 6}\n"
                         "optimizer: {lr: 0.002, bf16: true}\n")
    toml_file = tmp_path / "run.toml"
    toml_file.write_text("[model]\nnum_layers = 6\nhidden_size = 96\nnum_attention_heads = 6\n")
    cfg, _ = parse_args(["--config", str(yaml_file), "--num-layers", "3", "--no-bf16",
                         "--data-path", "0.3", "a", "0.7", "b"])
    assert (cfg.model.num_layers, cfg.model.hidden_size, cfg.optimizer.lr) == (3, 96, 0.002)
    assert cfg.optimizer.precision == "fp32"
    assert cfg.data.weighted_data_paths() == [(0.3, "a"), (0.7, "b")]
    cfg2, _ = parse_args(["--config", str(toml_file)])
    assert cfg2.model.hidden_size == 96
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg       # what checkpoints store round-trips


@pytest.mark.parametrize("argv,message", [
    (["--tensor-model-paralel-size", "2"], "did you mean --tensor-model-parallel-size"),
    (["--hidden-size", "100", "--num-attention-heads", "16"], "hidden size 100 is not divisible by 16"),
    (["--bf16", "--fp16"], "--bf16 and --fp16 are exclusive"),
    (["--zero-stage", "4"], "--zero-stage must be 0, 1, 2 or 3"),
    (["--lr-decay-style", "step"], "--lr-decay-style must be cosine, linear or constant"),
    (["--min-lr", "1", "--lr", "0.1"], "--min-lr 1.0 is above --lr 0.1"),
    (["--data-path", "0.5", "a", "b"], "must be one prefix or pairs"),
    (["--split", "a,b"], "--split 'a,b' must be comma-separated numbers"),
    (["--sequence-parallel"], "--sequence-parallel needs --tensor-model-parallel-size > 1"),
    (["--micro-batch-size", "0"], "--micro-batch-size must be a positive integer"),
    (["--config", "no-such-preset"], "does not exist; presets in"),
    (["--offload-optimizer", "cpu", "--zero-stage", "0"], "--offload-optimizer needs --zero-stage 1, 2"),
    (["--offload-optimizer", "nvme"], "--offload-optimizer nvme needs --offload-nvme-path"),
    (["--recompute", "fulll"], "--recompute must be one of none, selective, full"),
])
def test_bad_input_is_explained(argv, message):
    with pytest.raises(TrainConfigError, match=message.replace("(", r"\(")):
        parse_args(argv)


def test_unknown_file_keys_are_named(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("model: {num_layyers: 3}\n")
    with pytest.raises(TrainConfigError,
                       match=r"unknown key\(s\) \['num_layyers'\] in config section 'model'"):
        parse_args(["--config", str(f)])
    f.write_text("modle: {}\n")
    with pytest.raises(TrainConfigError, match="unknown config section"):
        parse_args(["--config", str(f)])


def test_batch_arithmetic_against_the_world():
    cfg, _ = parse_args(["--micro-batch-size", "4", "--global-batch-size", "48",
                         "--tensor-model-parallel-size", "2"])
    assert cfg.layout(8).micro_batches == 3                # 48 = 4 x DP 4 x 3
    with pytest.raises(TrainConfigError, match=r"global batch 48 is not divisible by micro batch 4 x "
                                               r"data-parallel size 8 = 32; set --global-batch-size "
                                               r"to a multiple of 32"):
        cfg.layout(16)
    with pytest.raises(TrainConfigError, match="cannot be split into TP groups of 2"):
        cfg.validate_for_world(3)
    cfg.parallel.world_size = 16
    with pytest.raises(TrainConfigError, match="laid out for --world-size 16 but 8 ranks"):
        cfg.validate_for_world(8)
    cfg, _ = parse_args(["--lr-warmup-iters", "10", "--lr-decay-iters", "5"])
    with pytest.raises(TrainConfigError, match="--lr-decay-iters 5 is shorter than --lr-warmup-iters"):
        cfg.validate_for_world(1)


def test_presets_parse_and_name_a_world_size():
    presets = sorted(PRESET_DIR.glob("*.yaml"))
    assert len(presets) >= 19                                 # 18 Table 5 rows + the CPU preset
    for path in presets:
        cfg, _ = parse_args(["--config", str(path)])
        assert cfg.parallel.world_size, path
        cfg.validate_for_world(cfg.parallel.world_size)


def test_table5_presets_match_the_paper():
    from models.gpt.presets import paper_run_names, get_paper_run
    for name in paper_run_names("table5"):
        run = get_paper_run(name)
        cfg, _ = parse_args(["--config", name])
        m, p = cfg.model, cfg.parallel
        assert (m.num_layers, m.hidden_size, m.num_attention_heads) == (
            run.config.num_layers, run.config.hidden_size, run.config.num_attention_heads), name
        assert (p.world_size, p.tensor_model_parallel_size) == (run.gpus, run.tp), name
        assert cfg.data.micro_batch_size * cfg.layout(run.gpus).micro_batches == run.micro_batch
        assert cfg.layout(run.gpus).global_batch == run.global_batch, name
        assert (p.zero_stage > 0) == run.zero, name


def test_lr_schedule_closed_form():
    s = LRSchedule(lr=1.0, min_lr=0.1, warmup_iters=10, decay_iters=110, style="cosine")
    assert s(0) == pytest.approx(0.1) and s(9) == pytest.approx(1.0)
    assert s(60) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert s(110) == s(500) == pytest.approx(0.1)
    lin = LRSchedule(1.0, 0.0, 0, 100, "linear")
    assert lin(25) == pytest.approx(0.75)
    with pytest.raises(ValueError, match="fewer than the warm-up"):
        LRSchedule(1.0, 0.0, 10, 5)


LLAMA_CONFIGS = ["llama2-7B", "llama2-13B", "llama2-70B", "llama3-8B", "llama3-70B"]


@pytest.mark.parametrize("name", LLAMA_CONFIGS)
def test_llama_presets_are_the_architectures_laid_out_for_8_gpus(name):
    """Each Llama launch preset's model section is models/gpt/presets.py's architecture, and its
    layout passes the dry run at 8 ranks with an estimate that fits an 80 GB GPU."""
    from models.gpt.presets import LLAMA_PRESETS
    from pretrain.dry_run import dry_run_report, total_bytes
    cfg, _ = parse_args(["--config", name])
    assert cfg.model == LLAMA_PRESETS[name]
    assert (cfg.parallel.world_size, cfg.parallel.gpus_per_node) == (8, 8)
    report = dry_run_report(cfg)
    assert total_bytes(report) < 80e9, total_bytes(report)


@pytest.mark.parametrize("name,world", [("mixtral-8x7b", 64), ("qwen1.5-moe-a2.7b", 8)])
def test_moe_presets_are_the_architectures_and_fit(name, world):
    """Each MoE launch preset's model section is models/gpt/presets.py's architecture (issue 32); its
    EP layout passes the dry run, which reports the released total and active parameter counts, and
    fits an 80 GB GPU."""
    from models.gpt.presets import MOE_PRESETS
    from pretrain.dry_run import dry_run_report, format_report, total_bytes
    cfg, _ = parse_args(["--config", name])
    expected = MOE_PRESETS[name]
    assert cfg.model == expected.replace(moe_aux_loss_coeff=cfg.model.moe_aux_loss_coeff)
    assert cfg.parallel.world_size == world
    report = dry_run_report(cfg)
    assert (report["params_total"], report["params_active"]) == (expected.num_parameters(),
                                                                  expected.num_active_parameters())
    assert f"{expected.num_active_parameters():,} active per token" in format_report(report)
    assert total_bytes(report) < 80e9, total_bytes(report)
