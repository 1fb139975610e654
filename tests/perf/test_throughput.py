"""Throughput model against the ZeRO paper's stated figures (tools/paper_claims.py), an independent
anchor (Megatron-LM 2019, one V100) and its own topology logic; the paper-tables tool end to end."""

import json
from pathlib import Path

import pytest

from hybrid.perf.hardware import Cluster, dgx2_v100_cluster
from hybrid.perf.throughput import (ThroughputAssumptions, estimate_iteration, sustained_efficiency,
                                    tp_ring_bytes_per_microbatch)
from hybrid.testing.multirank import run_on_ranks
from tools import paper_claims, paper_tables

RUN_100B = dict(layers=125, hidden=8192, seq=1024, vocab=50257, micro_batch=32, tp=16, dp=25, stage=2)


def test_every_claim_has_its_documented_status():
    claims = paper_claims.claims()
    assert len(claims) >= 12
    for c in claims:
        assert c.status == c.documented_status, (c.key, c.predicted, c.paper, c.status)
    assert set(paper_claims.KNOWN_MISSES) <= {c.key for c in claims}


def test_headline_zero_100B_within_20_percent():
    e = estimate_iteration(**RUN_100B, partition_activations=True)
    assert e.tflops_per_gpu() == pytest.approx(38, rel=0.2)
    assert e.pflops_aggregate() == pytest.approx(15, rel=0.2)
    assert not e.details["tp_crosses_nodes"]


def test_efficiency_anchor_megatron_1_2B_on_one_v100():
    # Megatron-LM (2019): 1.2B (40 layers, hidden 1536) sustains 39 TFLOP/s on one V100.
    e = estimate_iteration(layers=40, hidden=1536, seq=1024, vocab=50257, micro_batch=8, tp=1, dp=1,
                           stage=0)
    assert e.tflops_per_gpu() == pytest.approx(39, rel=0.1)
    assert e.tp_comm_s == 0 and e.dp_comm_s == 0


def _gpt_tp_traffic(rank, world_size, dims):
    """TP ring bytes and all-reduce count the real GPTModel records for one forward + backward."""
    import torch

    from hybrid.parallel_state import ParallelState
    from hybrid.tensor_parallel import RNGTracker
    from hybrid.topology import Topology
    from models.gpt.config import GPTConfig
    from models.gpt.model import GPTModel
    state = ParallelState.initialize(Topology(world_size, world_size, gpus_per_node=world_size))
    config = GPTConfig(num_layers=dims["layers"], hidden_size=dims["hidden"], num_attention_heads=4,
                       vocab_size=256, seq_length=dims["seq"], make_vocab_size_divisible_by=64,
                       hidden_dropout=0.0, attention_dropout=0.0)
    model = GPTModel(config, state, rng=RNGTracker(1, state.tp_rank, state.device))
    tokens = torch.randint(0, 256, (dims["micro_batch"], dims["seq"]))
    state.ledger.reset()
    model(tokens, tokens).mean().backward()
    return state.ledger.bytes("tp"), state.ledger.count("tp")


def test_tp_traffic_model_equals_the_real_gpt_ledger():
    dims = dict(layers=3, hidden=64, seq=16, micro_batch=3)
    measured_bytes, measured_calls = run_on_ranks(_gpt_tp_traffic, 2, args=(dims,))[0]
    ring, calls = tp_ring_bytes_per_microbatch(dims["layers"], dims["hidden"], dims["seq"],
                                               dims["micro_batch"], 2, full_recompute=False,
                                               activation_bytes=4)
    assert measured_bytes == pytest.approx(ring)
    assert measured_calls == calls   # 4 per layer, embedding, output layer, 2 for the loss


def test_tp_across_nodes_uses_infiniband_share():
    cluster = dgx2_v100_cluster()
    assert cluster.inter_node_ring_bandwidth == pytest.approx(6.25e9)
    assert cluster.intra_node_ring_bandwidth == pytest.approx(150e9)
    dims = dict(layers=8, hidden=8192, seq=1024, vocab=50257, micro_batch=2, dp=1, stage=0)
    inside = estimate_iteration(**dims, tp=16)
    across = estimate_iteration(**dims, tp=32)
    assert not inside.details["tp_crosses_nodes"] and across.details["tp_crosses_nodes"]
    assert across.tp_comm_s > 10 * inside.tp_comm_s


def test_faster_network_and_more_overlap_never_slow_down():
    base = estimate_iteration(**RUN_100B)
    fast = estimate_iteration(**RUN_100B, cluster=dgx2_v100_cluster().with_changes(ib_links_per_node=16))
    hidden = estimate_iteration(**RUN_100B, assumptions=ThroughputAssumptions(zero_dp_overlap=1.0))
    assert fast.time_s < base.time_s and hidden.time_s <= base.time_s
    stage3 = estimate_iteration(**(RUN_100B | {"stage": 3}))
    assert stage3.details["dp_total_s"] == pytest.approx(1.5 * base.details["dp_total_s"])


def test_efficiency_saturates_and_rejects_bad_input():
    small, large = sustained_efficiency(1024, 128), sustained_efficiency(65536, 4096)
    assert 0 < small < large < ThroughputAssumptions().max_efficiency
    with pytest.raises(ValueError, match="positive"):
        sustained_efficiency(0, 128)
    with pytest.raises(ValueError, match="ib_efficiency"):
        Cluster("bad", ib_efficiency=1.5)


def test_paper_tables_tool_writes_every_output(tmp_path, capsys):
    assert paper_tables.main(["--out", str(tmp_path)]) == 0
    for name in ("tables.md", "predictions.md", "figure1.png", "figure2.png", "figure3.png",
                 "table1.csv", "table2.csv", "table3.csv", "table5.csv", "table6.csv", "table10.csv",
                 "assumptions.csv", "predictions.csv"):
        assert (tmp_path / name).stat().st_size > 100, name
    committed = Path(__file__).resolve().parents[2] / "docs" / "paper"
    stale = [p.name for p in sorted(tmp_path.glob("*")) if p.suffix in (".md", ".csv")
             and p.read_text() != (committed / p.name).read_text()]
    assert not stale, f"docs/paper is stale: {stale}; regenerate with python -m tools.paper_tables"
    text = (tmp_path / "predictions.md").read_text()
    assert "known miss" in text and "up to 10x" in text
    capsys.readouterr()
    assert paper_tables.main(["--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert {"assumptions", "figure1", "table1", "table2", "table3", "table5", "table6", "table10",
            "predictions"} <= set(data)
    assert len(data["table5"]) == 18 and all(r["fits_32gb"] for r in data["table5"])


def test_gradient_accumulation_multiplies_per_microbatch_dp_traffic():
    dims = dict(layers=4, hidden=1024, seq=1024, vocab=50257, micro_batch=4, tp=1, dp=64)

    def dp_seconds(stage, accumulation):
        return estimate_iteration(**dims, stage=stage, grad_accumulation=accumulation).details["dp_total_s"]

    assert dp_seconds(0, 4) == pytest.approx(dp_seconds(0, 1))      # one all-reduce per step
    assert dp_seconds(2, 2) == pytest.approx(1.5 * dp_seconds(2, 1))  # reduce-scatter per micro-batch
    assert dp_seconds(3, 2) == pytest.approx(2 * dp_seconds(3, 1))    # everything per micro-batch


def test_perf_estimate_cli_agrees_with_the_table5_row(capsys):
    from tools import perf_estimate
    argv = ["--num-layers", "125", "--hidden-size", "8192", "--num-attention-heads", "64",
            "--micro-batch-size", "32", "--tensor-model-parallel-size", "16",
            "--data-parallel-size", "25", "--zero-stage", "2", "--partition-activations", "--json"]
    assert perf_estimate.main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    row = next(r for r in paper_tables.collect()["table5"] if r["name"] == "table5-zero-100B")
    assert out["memory_gb"]["total"] == pytest.approx(row["total_gb"])
    assert out["iteration"]["tflops_per_gpu"] == pytest.approx(row["tflops_per_gpu"])
    with pytest.raises(ValueError, match="not divisible"):
        perf_estimate.main(argv[:6] + ["--micro-batch-size", "1", "--tensor-model-parallel-size", "3"])
