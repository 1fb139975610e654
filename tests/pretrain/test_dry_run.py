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
