"""--dry-run with context parallelism (issue 31): Llama-3 8B at seq 131072 on 1024 ranks (TP 8 x CP 16
x DP 8) laid out on one CPU process, its activations per rank against the CP-1 run, its CP bytes per
step against the closed form of hybrid.perf.context_parallel, and --recompute auto no longer pushed
into recompute by the [s, s] scores SDPA never keeps."""

import pytest

from hybrid.perf.context_parallel import cp_bytes_per_layer
from pretrain.arguments import parse_args
from pretrain.dry_run import dry_run_report, format_report

LONG = ["--config", "llama3-8B", "--dry-run", "--seq-length", "131072",
        "--max-position-embeddings", "131072", "--world-size", "1024",
        "--tensor-model-parallel-size", "8", "--global-batch-size", "128", "--recompute", "none"]


def _run(cp: int) -> dict:
    return dry_run_report(parse_args(LONG + ["--context-parallel-size", str(cp)])[0], 0)


def test_llama3_8b_128k_on_1024_ranks_with_cp16():
    r = _run(16)
    assert (r["cp_size"], r["local_seq"], len(r["cp_group"]), len(r["dp_group"])) == (16, 8192, 16, 8)
    assert r["cp_group"][:2] == [0, 8]                               # TP fastest, then CP
    assert r["activations_per_rank"] < 20e9
    # ring: K and V of 8 / 8 = 1 KV head per TP rank, 32 layers, 16 micro-batches, bf16, fp32 dK/dV
    layer = cp_bytes_per_layer(comm_type="p2p", cp=16, micro_batch=1, seq=131072, hidden=4096,
                               heads=32, query_groups=8, tp=8)
    kv = 8192 * 128                                                  # one of K, V per rank
    assert layer.forward == 2 * 15 * kv * 2 + 15 * 8 * 8192
    assert layer.backward == 2 * 15 * kv * (2 + 4)
    assert r["cp_bytes_per_step"] == pytest.approx(32 * 16 * layer.total)
    text = format_report(r)
    assert "context parallel 16 (p2p): 8,192 of each sample's tokens per rank" in text
    assert "CP rank 0 in [0, 8, ..., 120]" in text


def test_cp_divides_activations_and_keeps_flops_of_the_same_world():
    """The same 1024 ranks at CP 1 (DP 128) and CP 16 (DP 8): activations per rank / 16 (every
    term is per token, the micro-batches in flight the same), FLOPs per rank unchanged."""
    one, r = _run(1), _run(16)
    assert r["activations_per_rank"] == pytest.approx(one["activations_per_rank"] / 16)
    assert r["flops_per_rank"] == pytest.approx(one["flops_per_rank"])
    assert one["cp_bytes_per_step"] == 0


def test_auto_recompute_is_not_forced_by_scores_sdpa_never_keeps():
    """Llama-3 8B at seq 8192, budget 60 GB of activations per rank: every layer's activations
    (about 53 GB with SDPA) fit, so the plan recomputes nothing; with the paper's s^2 term (about
    397 GB) it had to recompute."""
    cfg, _ = parse_args(["--config", "llama3-8B", "--dry-run", "--recompute", "auto",
                         "--memory-budget", "60GB"])
    assert dry_run_report(cfg, 0)["recompute"] == "none"
