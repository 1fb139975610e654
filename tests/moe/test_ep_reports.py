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
    assert "experts: 8 per MoE layer" in out and "all-to-all" in out
    ranked = [line for line in out.splitlines() if line[:3].strip() in ("1", "2", "3")]
    assert ranked and all("(EP 4)" in line for line in ranked)   # the fixed EP, nothing else
    assert main(["--layers", "8", "--hidden", "1024", "--heads", "16", "--gpus", "32",
                 "--global-batch", "64", "--expert-model-parallel-size", "4"]) == 2
    assert "needs a MoE model" in capsys.readouterr().err


def test_rank_layouts_ranks_the_moe_model():
    """Mixtral 8x7B on 64 A100 80GB: the ranking models the MoE model (experts' states over
    expert-DP, active FLOPs, the all-to-all), searches EP, and its #1 fits; the dense model of the
    same shape (what the ranking used before) would pick a layout that does not fit."""
    import dataclasses
    from hybrid.perf.flops import gpt_param_count, pad_vocab
    from hybrid.perf.model_states import moe_model_state_bytes
    from hybrid.perf.pipeline import estimate_layout
    from tools.rank_layouts import MOE_PRESETS, rank
    moe = MOE_PRESETS["mixtral-8x7b"]
    limit, arch, h = moe.cluster.memory_bytes, moe.arch, moe.hidden
    found = rank(moe)
    assert found and all(e.memory_bytes <= limit for e in found)
    assert [e.time_s for e in found] == sorted(e.time_s for e in found)
    top = found[:20]
    assert {e.layout.ep for e in top} > {1}        # EP searched, EP > 1 layouts in the lead
    for e in top:
        lay = e.layout
        assert (lay.dp * lay.cp) % lay.ep == 0 and 8 % lay.ep == 0
        assert e.time_s == pytest.approx(e.compute_s + e.p2p_s + e.cp_s + e.ep_s + e.dp_s
                                         + e.optimizer_s)
        # model states: dense over DP x CP, the rank's experts over DP x CP / EP (oracle below)
        layers = moe.layers // lay.pp
        experts = layers * 8 * 3 * h * 14336 / lay.tp                      # all 8, one TP rank
        psi = gpt_param_count(layers, h, pad_vocab(moe.vocab, lay.tp), moe.seq, tp=lay.tp,
                              heads=moe.heads, arch=arch)
        states = moe_model_state_bytes(psi - experts, experts, lay.stage, lay.dp * lay.cp, lay.ep,
                                       optimizer_bytes_per_param=12).total.total
        assert e.model_state_bytes == pytest.approx(states)
        if lay.ep > 1:   # 4 T k h b (ep-1)/ep bytes a MoE layer and micro-batch (+ recompute)
            one = 4 * lay.micro_batch * moe.seq * 2 * h * 2 * (lay.ep - 1) / lay.ep
            assert e.ep_s > one * layers * e.micro_batches / moe.cluster.intra_node_ring_bandwidth
        else:
            assert e.ep_s == 0
    # ignoring the experts' bytes (the dense model of the same shape) picks a layout that does
    # not fit once the experts are counted
    dense = dataclasses.replace(moe, arch=dataclasses.replace(arch, num_experts=None,
                                                              moe_pattern=None))
    dense_pick = rank(dense)[0].layout
    assert estimate_layout(dense_pick, **moe.model()).memory_bytes > limit
