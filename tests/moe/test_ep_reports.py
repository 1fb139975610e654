"""Expert parallelism in the reports (issue 32 item 6): the dry run's expert bytes and token
dispatch bytes per rank and step, tools/rank_layouts.py's expert lines, and the even-routing
formula of hybrid.perf.moe_comm (docs/moe.md, "Communication")."""

import pytest

from hybrid.perf.moe_comm import alltoall_exact, dispatch_bytes
from pretrain.arguments import parse_args
from pretrain.dry_run import dry_run_report, format_report

MOE = ["--world-size", "16", "--gpus-per-node", "8", "--num-layers", "4", "--hidden-size", "256",
       "--num-attention-heads", "4", "--seq-length", "128", "--swiglu", "--num-experts", "8",
       "--moe-ffn-hidden-size", "512", "--expert-model-parallel-size", "4",
       "--tensor-model-parallel-size", "2", "--micro-batch-size", "2", "--global-batch-size", "32",
       "--bf16", "--train-iters", "10", "--vocab-size", "1000", "--dry-run-rank", "3"]


def test_even_routing_formula():
    tokens, k, h, ep, e = 1024, 2, 64, 4, 8
    a2a = dispatch_bytes("alltoall", tokens, k, h, ep, e, 2)
    crossing = tokens * k * 3 / 4                                      # S = R
    assert a2a.forward == a2a.backward == 2 * crossing * h * 2
    assert a2a.metadata == 8 * e * 3 / 4
    assert a2a == alltoall_exact(crossing, crossing, h, 2, e, ep)
    ag = dispatch_bytes("allgather", tokens, k, h, ep, e, 2)
    assert ag.forward + ag.backward == 4 * tokens * (ep - 1) * h * 2   # ep / k times the a2a's
    assert (ag.forward + ag.backward) / (a2a.forward + a2a.backward) == pytest.approx(ep / k)
    assert dispatch_bytes("alltoall", tokens, k, h, 1, e, 2).total == 0


def test_dry_run_reports_experts_and_dispatch_bytes():
    r = dry_run_report(parse_args(MOE)[0], rank=3)
    moe = r["moe"]
    assert (moe["ep"], moe["ep_group"], moe["expert_dp_group"]) == (4, [1, 3, 5, 7], [3, 11])
    # 4 layers x 2 local experts x (fc1 2f h + fc2 h f) / TP 2
    assert moe["expert_params_per_rank"] == 4 * 2 * 3 * 512 * 256 // 2
    micro_batches = 32 // (2 * 8)
    per_layer = dispatch_bytes("alltoall", 2 * 128, 2, 256, 4, 8, 2)
    assert moe["a2a_bytes_per_step"] == 4 * micro_batches * per_layer.total
    assert "alltoall token dispatch" in format_report(r)


def test_dry_run_with_context_parallelism():
    """EP x CP: EP 4 spans the CP pairs (16 ranks, TP 2 x CP 2 x DP 4: DP x CP = 8), and each rank
    routes its CP half of the micro-batch's tokens."""
    r = dry_run_report(parse_args(MOE + ["--context-parallel-size", "2"])[0], rank=3)
    moe = r["moe"]
    # rank 3 = (dp 0, cp 1, tp 1): DP x CP ranks of TP rank 1 are 1, 3, 5, ... in DP x CP order
    assert (moe["ep"], moe["ep_group"], moe["expert_dp_group"]) == (4, [1, 3, 5, 7], [3, 11])
    micro_batches = 32 // (2 * 4)
    per_layer = dispatch_bytes("alltoall", 2 * 128 // 2, 2, 256, 4, 8, 2)
    assert moe["a2a_bytes_per_step"] == 4 * micro_batches * per_layer.total


def test_rank_layouts_expert_lines(capsys):
    from tools.rank_layouts import main
    assert main(["--layers", "8", "--hidden", "1024", "--heads", "16", "--gpus", "32",
                 "--global-batch", "64", "--top", "3", "--num-experts", "8",
                 "--expert-model-parallel-size", "4"]) == 0
    out = capsys.readouterr().out
    assert "experts: 8 per layer" in out and "all-to-all" in out
