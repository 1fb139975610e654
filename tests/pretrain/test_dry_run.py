"""--dry-run: the 400-GPU ZeRO-100B preset checked on one CPU process (no process group), compared
with the ZeRO §5 formula for Pos+g and with the paper's ~100B size and 32 GB V100s."""

import importlib.util
from pathlib import Path

import pytest

from pretrain.arguments import parse_args
from pretrain.config import TrainConfigError
from pretrain.dry_run import dry_run_report, format_report, total_bytes


def _entry():
    path = Path(__file__).resolve().parents[2] / "launch" / "pretrain_gpt.py"
    spec = importlib.util.spec_from_file_location("pretrain_gpt", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_zero_100b_dry_run_matches_the_paper():
    cfg, options = parse_args(["--config", "table5-zero-100B", "--dry-run", "--dry-run-rank", "399"])
    r = dry_run_report(cfg, options.dry_run_rank)
    assert (r["tp_rank"], r["dp_rank"], r["tp_group"][0], r["dp_group"][:2]) == (15, 24, 384, [15, 31])
    assert not r["tp_crosses_nodes"]
    assert 99e9 < r["params_total"] < 103e9                       # "100B"
    psi, nd = r["params_per_rank"], 25
    assert psi == pytest.approx(r["params_total"] / 16, rel=0.01)
    s = r["model_states_per_rank"]
    assert s["total"] == pytest.approx(2 * psi + (2 + 12) * psi / nd)   # Pos+g, ZeRO §5
    assert s["total"] < 32e9                                      # fits a 32 GB V100
    assert r["dp_bytes_per_step"] == pytest.approx(2 * psi * 2 * (nd - 1) / nd)
    assert "400 ranks = 25 node(s) x 16" in format_report(r)


def test_dry_run_needs_a_world_size():
    cfg, _ = parse_args([])
    with pytest.raises(TrainConfigError, match="--dry-run needs the GPU count"):
        dry_run_report(cfg)


def test_entry_point_exit_codes(capsys):
    main = _entry().main
    assert main(["--config", "table5-megatron-170B", "--dry-run"]) == 0
    assert "TP groups cross nodes" in capsys.readouterr().out
    assert main(["--num-layer", "3"]) == 2


def test_every_table5_preset_fits_a_32gb_v100():
    """The paper ran every Table 5 row on 32 GB V100s: model states + activations (with the preset's
    recompute) + buffers + reserve must fit by hybrid.perf's estimate."""
    from models.gpt.presets import paper_run_names
    for name in paper_run_names("table5"):
        r = dry_run_report(parse_args(["--config", name])[0])
        assert total_bytes(r) < 32e9, (name, total_bytes(r) / 1e9)


def test_launch_scripts_are_valid_shell():
    import subprocess
    launch = Path(__file__).resolve().parents[2] / "launch"
    for name in ("main_job.sh", "local.sh", "multinode.sh", "slurm_dgx2.sbatch"):
        subprocess.run(["bash", "-n", str(launch / name)], check=True)


def test_offloaded_optimizer_state_leaves_the_device():
    base = dry_run_report(parse_args(["--config", "table5-zero-170B"])[0])
    off = dry_run_report(parse_args(["--config", "table5-zero-170B", "--offload-optimizer", "cpu"])[0])
    s = base["model_states_per_rank"]
    assert off["offloaded_per_rank"] == s["master_fp32"] + s["adam_moments"]
    assert total_bytes(base) - total_bytes(off) == pytest.approx(off["offloaded_per_rank"])


def test_pipeline_dry_run_counts_each_stage():
    """--dry-run at PP 4 x TP 2 x DP 2 (16 ranks, 1F1B): the stages' parameters add up to the model's
    (the last stage's copy of the tied embedding is not a parameter of its own), stage s holds the
    activations of p - s micro-batches, and a middle stage sends an activation and a gradient of
    b s h 16-bit elements per micro-batch (2 m b s h x 2 bytes), the first and last stage half."""
    args = ["--world-size", "16", "--gpus-per-node", "8", "--tensor-model-parallel-size", "2",
            "--pipeline-model-parallel-size", "4", "--num-layers", "8", "--hidden-size", "64",
            "--num-attention-heads", "4", "--seq-length", "32", "--vocab-size", "1000",
            "--micro-batch-size", "2", "--global-batch-size", "16", "--bf16"]
    cfg, _ = parse_args(args)
    stage_ranks = [0, 4, 8, 12]          # TP rank 0, DP rank 0 of each stage (grid pp x dp x tp)
    reports = [dry_run_report(cfg, rank) for rank in stage_ranks]
    assert [r["pp_rank"] for r in reports] == [0, 1, 2, 3]
    whole, _ = parse_args(args + ["--pipeline-model-parallel-size", "1", "--world-size", "4"])
    assert sum(r["params_per_rank"] for r in reports) == dry_run_report(whole)["params_per_rank"]
    assert [r["micro_batches_held"] for r in reports] == [4, 3, 2, 1]
    m, message = 16 // (2 * 2), 2 * 32 * 64 * 2
    assert [r["pp_bytes_per_step"] for r in reports] == [m * message, 2 * m * message,
                                                        2 * m * message, m * message]
    assert reports[1]["pp_cross_host_bytes_per_step"] == m * message    # to stage 2, on node 1
    assert "pipeline: 1f1b, PP 4 stages" in format_report(reports[0])


_SMALL = ["--world-size", "4", "--gpus-per-node", "4", "--tensor-model-parallel-size", "2",
          "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
          "--seq-length", "128", "--micro-batch-size", "2", "--global-batch-size", "4",
          "--zero-stage", "3", "--peak-tflops", "70"]


def test_working_memory_is_the_largest_gathered_parameter():
    """ZeRO-Infinity §3 in the dry run: GPT-2's vocab is the largest parameter of this model; on TP
    rank 0 its shard is (50257 padded to 256) / 2 x 64 elements, gathered whole with its fp32
    gradient (8 bytes per element); with full recompute the activation working memory is the
    memory model's one-layer term."""
    r = dry_run_report(parse_args(_SMALL + ["--recompute", "full"])[0])
    name, elements = r["largest_gather"]
    assert name == "embedding.word.weight" and elements == 50432 // 2 * 64
    assert r["working_memory_per_rank"] == 8 * elements
    assert r["activation_working_per_rank"] > 0 and r["offload_needs"] == []
    assert "largest gathered parameter embedding.word.weight (1,613,824 elements) with its " \
           "gradient 12.91 MB; activation working memory (one layer's recompute)" in format_report(r)


def test_offload_bandwidth_against_the_declared_host():
    """ZeRO-Infinity §4 for an offloaded run, by hand: the optimizer states are the rank's 1/2
    partition, so their intensity is 2 x (2 x 128) / 4 = 128 FLOP/B and 90% of 70 TFLOP/s needs
    0.9 x 70e12 / (0.1 x 128) B/s; NVMe parameters are read half per rank and all-gathered
    (2 x 1.5 GB/s) at seq x bsz = 256 FLOP/B; Pa+cpu checkpoints at 24 hd = 1536 FLOP/B over the
    declared host link."""
    flags = ["--offload-optimizer", "nvme", "--offload-params", "nvme", "--offload-nvme-path", "/tmp/x",
             "--recompute", "full-pa-cpu", "--nvme-offload-bandwidth", "1.5",
             "--host-offload-bandwidth", "30"]
    r = dry_run_report(parse_args(_SMALL + flags)[0])
    needs = {n.kind: n for n in r["offload_needs"]}
    opt, par, ckpt = needs["optimizer_states"], needs["params_grads"], needs["activation_checkpoints"]
    assert opt.ait == 128 and opt.required == pytest.approx(0.9 * 70e12 / (0.1 * 128))
    assert opt.available == 1.5e9 and not opt.sufficient
    assert par.ait == 256 and par.available == 3e9
    assert ckpt.ait == 24 * 64 and ckpt.available == 30e9
    assert ckpt.required == pytest.approx(0.9 * 70e12 / (0.1 * 1536)) and not ckpt.sufficient
    text = format_report(r)
    assert "offloaded optimizer states: 4921.88 GB/s per GPU for 90% efficiency at 70 TFLOP/s " \
           "(ait 128 FLOP/B); the host gives 1.50 GB/s: NOT enough, 0.3% efficient" in text


def test_offload_bandwidth_flags_refuse_bad_values():
    with pytest.raises(TrainConfigError, match="--offload-target-efficiency must lie strictly"):
        parse_args(_SMALL + ["--offload-target-efficiency", "1"])
    with pytest.raises(TrainConfigError, match="--host-offload-bandwidth must be a positive"):
        parse_args(_SMALL + ["--host-offload-bandwidth", "0"])
