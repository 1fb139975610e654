"""Figure 2 in miniature on the shaped test bed (benchmarks/figure2_mini.py, ZeRO §10.2): at the
lowest inter-host bandwidth, ZeRO with TP inside a host and DP across must train the same GPT faster
than Megatron's TP spanning hosts; the ledger's cross-host bytes per step must equal their formulas
(hybrid.perf.links: the TP 4 ring over hosts 0,0,1,1 sends half its bytes across; every DP byte of
(b) crosses, none of its TP bytes); both layouts reach the same loss; the model's prediction for each
layout is within the 25% target and ranks the layouts as measured. Skips where network
namespaces cannot be made."""

from __future__ import annotations

import pytest

from benchmarks import figure2_mini as fig
from hybrid.perf.throughput import tp_ring_bytes_per_microbatch
from tools.netns_cluster import NetnsUnavailable

pytestmark = pytest.mark.slow


def test_zero_beats_megatron_across_a_slow_link_and_the_ledger_counts_the_crossing_bytes(tmp_path):
    try:
        result = fig.run([25.0], iters=4, work=tmp_path)
    except NetnsUnavailable as err:
        pytest.skip(str(err))
    megatron, zero = result["runs"]
    assert (megatron["tp"], zero["tp"], zero["dp"]) == (4, 2, 2)
    assert zero["measured_s"] < 0.7 * megatron["measured_s"], (zero, megatron)
    m = fig.MODEL
    micro_batches = fig.GLOBAL_BATCH // fig.MICRO_BATCH
    tp_bytes = micro_batches * tp_ring_bytes_per_microbatch(
        m["num_layers"], m["hidden_size"], m["seq_length"], fig.MICRO_BATCH, 4,
        full_recompute=False, activation_bytes=4)[0]
    assert megatron["tp_bytes"] == pytest.approx(tp_bytes, rel=1e-6)
    assert megatron["tp_cross_host_bytes"] == pytest.approx(tp_bytes / 2, rel=1e-6)
    assert zero["tp_cross_host_bytes"] == 0 and zero["tp_bytes"] > 0
    assert zero["dp_cross_host_bytes"] == pytest.approx(zero["dp_bytes"]) and zero["dp_bytes"] > 0
    assert zero["final_loss"] == pytest.approx(megatron["final_loss"], rel=1e-3)
    assert abs(megatron["relative_error"]) <= fig.TOLERANCE, megatron
    assert abs(zero["relative_error"]) <= fig.TOLERANCE, zero
    assert zero["predicted_s"] < megatron["predicted_s"]


def test_stage3_moves_three_halves_of_stage1_and_all_of_it_across_hosts(tmp_path):
    """ZeRO §7 on the shaped test bed, from the ledger: TP 2 inside each host, DP 2 across, one
    micro-batch per step. Stage 3 (Pos+g+p) moves 3Ψ(n-1)/n, stage 1 (Pos) 2Ψ(n-1)/n; every DP
    byte crosses hosts, no TP byte does."""
    from hybrid.testing.corpus import build_corpus
    from tools.netns_cluster import NetnsCluster
    corpus = build_corpus(tmp_path / "corpus")
    try:
        with NetnsCluster(2, 2, rate_mbit=200) as cluster:
            runs = {stage: fig.measure(cluster, corpus, tmp_path, 2, stage, 3, f"s{stage}",
                                       global_batch=2 * fig.MICRO_BATCH) for stage in (1, 3)}
    except NetnsUnavailable as err:
        pytest.skip(str(err))
    for run in runs.values():
        assert run["dp_cross_host_bytes"] == pytest.approx(run["dp_bytes"]) and run["dp_bytes"] > 0
        assert run["tp_cross_host_bytes"] == 0 and run["tp_bytes"] > 0
    assert runs[3]["dp_bytes"] == pytest.approx(1.5 * runs[1]["dp_bytes"], rel=1e-3)
