"""The throughput model's shaped-link terms (hybrid.perf.hardware.Cluster.link, throughput.
link_overlap), used by benchmarks/figure2_mini.py: each crossing collective costs its algorithm's
latency + volume / bandwidth; a token bucket hides up to one burst of work per crossing call; a
V100 cluster (no burst, no direct line) is unchanged."""

import pytest

from hybrid.perf.hardware import Cluster, dgx2_v100_cluster
from hybrid.perf.throughput import (ThroughputAssumptions, estimate_iteration, link_overlap,
                                    tp_ring_bytes_per_microbatch)

SHAPED = Cluster(name="shaped", gpus_per_node=2, peak_flops=5e10, intra_node_bandwidth=1e9,
                 intra_node_efficiency=1.0, ib_link_bandwidth=2 * 3e6, ib_links_per_node=1,
                 collective_latency=3e-4, inter_node_latency=0.01,
                 inter_node_direct_bandwidth=1.5e6, inter_node_direct_latency=0.05)
FP32 = ThroughputAssumptions(max_efficiency=1.0, half_efficiency_tokens=0.0,
                             half_efficiency_hidden=0.0, activation_bytes=4, grad_bytes=4,
                             zero_dp_overlap=0.0, elementwise_in_efficiency=False)
DIMS = dict(layers=2, hidden=128, seq=64, vocab=400, micro_batch=4, recompute="none")


def test_link_picks_the_algorithms_line_and_falls_back_to_the_ring():
    assert SHAPED.link(False, "direct") == (1e9, 3e-4)
    assert SHAPED.link(True, "ring") == (pytest.approx(3e6), 0.01)
    assert SHAPED.link(True, "direct") == (1.5e6, 0.05)
    v100 = dgx2_v100_cluster()
    assert v100.link(True, "direct") == v100.link(True, "ring") == (6.25e9, v100.collective_latency)
    with pytest.raises(ValueError, match="ring or direct"):
        SHAPED.link(True, "tree")
    with pytest.raises(ValueError, match="dp_algorithm"):
        ThroughputAssumptions(dp_algorithm="tree")


def test_tp_and_dp_across_hosts_pay_their_lines_per_call():
    megatron = estimate_iteration(**DIMS, tp=4, dp=1, stage=0, cluster=SHAPED, assumptions=FP32)
    ring, calls = tp_ring_bytes_per_microbatch(2, 128, 64, 4, 4, full_recompute=False,
                                               activation_bytes=4)
    assert megatron.tp_comm_s == pytest.approx(ring / 3e6 + calls * 0.01)
    direct = FP32.__class__(**{**FP32.__dict__, "dp_algorithm": "direct"})
    zero = estimate_iteration(**DIMS, tp=2, dp=2, stage=1, cluster=SHAPED, assumptions=direct)
    psi = zero.details["params_per_rank"]
    assert zero.dp_comm_s == pytest.approx(2 * psi * 4 / 2 / 1.5e6 + 2 * 0.05)


def test_a_token_bucket_hides_at_most_one_burst_per_crossing_call():
    assert link_overlap(0.5, 48, 10.0, 0.01) == pytest.approx(0.48)   # burst-limited
    assert link_overlap(0.3, 48, 10.0, 0.01) == pytest.approx(0.3)    # all the work hides
    assert link_overlap(0.3, 2, 10.0, 0.01) == pytest.approx(0.02)
    assert link_overlap(0.3, 48, 0.1, 0.01) == pytest.approx(0.1)     # not more than the calls
    assert link_overlap(0.3, 0, 1.0, 0.01) == link_overlap(0.3, 48, 1.0, 0.0) == 0.0
    plain = estimate_iteration(**DIMS, tp=4, dp=1, stage=0, cluster=SHAPED, assumptions=FP32)
    bucket = estimate_iteration(**DIMS, tp=4, dp=1, stage=0, assumptions=FP32,
                                cluster=SHAPED.with_changes(link_burst_s=0.01, step_overhead_s=0.2))
    assert bucket.link_overlap_s == pytest.approx(
        min(plain.compute_s + plain.memory_s + plain.overhead_s + plain.optimizer_s + 0.2,
            (2 * 4 + 4) * 0.01, plain.tp_comm_s))             # 12 calls a micro-batch
    assert bucket.time_s == pytest.approx(plain.time_s + 0.2 - bucket.link_overlap_s)
    inside = estimate_iteration(**DIMS, tp=2, dp=1, stage=0, assumptions=FP32,
                                cluster=SHAPED.with_changes(link_burst_s=0.01))
    assert inside.link_overlap_s == 0.0                                 # nothing crosses


def test_figure2_mini_predictions_split_into_their_parts_and_the_page_is_current():
    """docs/paper/figure2_mini.md splits each prediction into the measured step overhead, the
    modelled compute and the modelled communication: they add up to the prediction of
    docs/paper/figure2_mini.json, and the page is the benchmark's rendering of that file."""
    import json
    from pathlib import Path

    from benchmarks import figure2_mini as fig
    paper = Path(__file__).resolve().parents[2] / "docs" / "paper"
    result = json.loads((paper / "figure2_mini.json").read_text())
    for run in result["runs"]:
        split = fig.parts(result, run)
        assert sum(split.values()) == pytest.approx(run["predicted_s"], rel=1e-9)
        assert split["measured step overhead"] == run["step_overhead_s"] > 0
    assert (paper / "figure2_mini.md").read_text() == fig.markdown(result)
