"""The topology-aware ZeRO options' traffic and memory formulas (hybrid.perf.zeropp): ZeRO++'s ~4x
cut of cross-node bytes with hpZ + qwZ + qgZ, each option's share against stage 3's 3Ψ, the split
by link against hybrid.perf.links (the ledger's own rule), hpZ's and hybrid sharding's model
states, and the throughput model's stage-3 DP term reproduced; the Table 5 tool's file is current."""

from pathlib import Path

import pytest

from hybrid.perf.hardware import dgx2_v100_cluster
from hybrid.perf.links import split_bytes
from hybrid.perf.throughput import estimate_iteration
from hybrid.perf.zeropp import (ZeroOptions, dp_ranks_per_node, dp_traffic, estimate_step,
                                model_state_bytes_per_gpu)
from tools import zeropp_table

PSI = 1e9
ALL_THREE = dict(hpz=True, quantized_weights=True, quantized_gradients=True)
Q8 = 1 + 4 / 256          # int8 + one fp32 scale per 256 elements
Q4 = 0.5 + 4 / 256


def test_zeropp_cuts_cross_node_bytes_about_4x():
    """ZeRO++'s setting: pure DP on 384 GPUs of 16 per node, int8 weights, int4 gradients."""
    n, d = 384, 16
    assert dp_ranks_per_node(1, n, 16) == d
    plain = dp_traffic(PSI, n, d).cross_node
    assert plain == pytest.approx(3 * PSI * 2 * (n - 1) / n / d)
    zeropp = dp_traffic(PSI, n, d, ZeroOptions(**ALL_THREE, gradient_bits=4)).cross_node
    k = n // d
    assert zeropp == pytest.approx((Q8 * (n - 1) / n + Q4 * (k - 1) / k) * PSI / d)
    assert 3.8 < plain / zeropp < 4.0                          # "3M -> 0.75M" plus the scales
    int8 = dp_traffic(PSI, n, d, ZeroOptions(**ALL_THREE)).cross_node
    assert 2.9 < plain / int8 < 3.1


@pytest.mark.parametrize("d", [1, 4, 16])
def test_each_option_against_stage_3(d):
    n = 400 if d != 16 else 384
    plain = dp_traffic(PSI, n, d)
    share = {name: dp_traffic(PSI, n, d, ZeroOptions(**{name: True})).cross_node / plain.cross_node
             for name in ("hpz", "quantized_weights", "quantized_gradients")}
    k = n // d
    assert share["hpz"] == pytest.approx(2 / 3)                          # no backward gather across
    assert share["quantized_weights"] == pytest.approx((2 * Q8 + 2) / 6)  # both gathers int8
    assert share["quantized_gradients"] == pytest.approx(
        (4 + Q8 * (k - 1) / k * n / (n - 1)) / 6)                         # reduce-scatter int8
    hpz = dp_traffic(PSI, n, d, ZeroOptions(hpz=True))
    assert hpz.intra_node == pytest.approx(plain.intra_node * 2 / 3 + PSI * 2 * (d - 1) / d)
    hybrid = dp_traffic(PSI, n, d, ZeroOptions(hybrid_shard=True))
    assert hybrid.cross_node == pytest.approx(2 * PSI / d * 2 * (k - 1) / k)
    assert hybrid.intra_node == pytest.approx(3 * PSI * 2 * (d - 1) / d)


def test_the_split_by_link_is_the_ledgers():
    """A DP group of 8 on 2 nodes of 4: the ring split of hybrid.perf.links, the rule the link-aware
    ledger applies to every collective."""
    n, d = 8, 4
    nodes = tuple(i // d for i in range(n))
    for name, intra, cross in dp_traffic(PSI, n, d).phases:
        assert (intra, cross) == pytest.approx(split_bytes(PSI * 2 * (n - 1) / n, "all_gather",
                                                           "ring", nodes)), name


def test_model_states_with_hpz_and_hybrid_sharding():
    n, d = 400, 4
    plain = model_state_bytes_per_gpu(PSI, n, d)
    assert plain["total"] == pytest.approx(16 * PSI / n)
    hpz = model_state_bytes_per_gpu(PSI, n, d, ZeroOptions(hpz=True))
    assert hpz["hpz_secondary"] == pytest.approx(2 * PSI / d)
    assert hpz["total"] == pytest.approx(16 * PSI / n + 2 * PSI / d)
    assert model_state_bytes_per_gpu(PSI, n, d, ZeroOptions(hybrid_shard=True))["total"] == \
        pytest.approx(16 * PSI / d)
    assert model_state_bytes_per_gpu(PSI, n, d, ZeroOptions(quantized_weights=True,
                                                            quantized_gradients=True)) == plain


def test_stage3_step_matches_the_throughput_model():
    dims = dict(layers=125, hidden=8192, seq=1024, vocab=50257, micro_batch=32, tp=16, dp=25,
                partition_activations=True)
    est, traffic, d = estimate_step(**dims)
    reference = estimate_iteration(**dims, stage=3)
    assert d == 1 and est.time_s == pytest.approx(reference.time_s)
    assert traffic.seconds(dgx2_v100_cluster()) == pytest.approx(reference.details["dp_total_s"])
    faster, _, _ = estimate_step(**dims, options=ZeroOptions(**ALL_THREE))
    assert faster.dp_comm_s < est.dp_comm_s and faster.time_s < est.time_s


def test_bad_options_are_refused():
    with pytest.raises(ValueError, match="hybrid sharding is modelled on its own"):
        ZeroOptions(hybrid_shard=True, hpz=True)
    with pytest.raises(ValueError, match="gradient_bits must be 4 or 8"):
        ZeroOptions(gradient_bits=2)
    with pytest.raises(ValueError, match="multiple of its ranks per node"):
        dp_traffic(PSI, 10, 4)


def test_the_table_file_is_current():
    committed = Path(__file__).resolve().parents[2] / "docs" / "paper" / "zeropp_table.txt"
    assert committed.read_text() == zeropp_table.render()
