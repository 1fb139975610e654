"""The calibration benchmark's pure pieces: a CPU "cluster" plugged into the same throughput model
gives compute = FLOPs / measured GEMM rate, and gloo bandwidth sets the TP/DP communication time."""

import pytest

from benchmarks import calibrate_perf_model as cal
from hybrid.perf.flops import model_flops_per_iteration


def test_cpu_prediction_is_flops_over_gemm_rate_plus_communication():
    cluster = cal.cpu_cluster(peak=20e9, allreduce_bw=1e9, latency=0.0, mem_bw=10e9)
    m = cal.MODEL
    flops = model_flops_per_iteration(cal.MICRO_BATCH, m["seq_length"], m["num_layers"],
                                      m["hidden_size"], m["vocab_size"])
    tp2 = cal.predict(2, 1, 0, cluster, shape_rate=10e9)
    assert tp2.compute_s == pytest.approx(flops / 2 / 10e9)
    # 4 all-reduces of b s h fp32 per layer + embedding and output layer, 3 fp32 per token for the
    # loss; ring factor 2 (n-1)/n = 1 at n = 2; no recompute
    tokens = cal.MICRO_BATCH * m["seq_length"]
    tp_bytes = (m["num_layers"] * 4 + 2) * tokens * m["hidden_size"] * 4 + 3 * tokens * 4
    assert tp2.tp_comm_s == pytest.approx(tp_bytes / 1e9)
    dp2 = cal.predict(1, 2, 2, cluster, shape_rate=10e9)
    assert dp2.tp_comm_s == 0 and dp2.dp_comm_s > 0
    faster = cal.predict(1, 2, 2, cluster.with_changes(intra_node_bandwidth=2e9), shape_rate=10e9)
    assert faster.dp_comm_s == pytest.approx(dp2.dp_comm_s / 2)


def test_gemm_rate_is_positive_and_finite():
    rate = cal.gemm_rate(64, 64, 64, cal.torch.float32, repeats=3)
    assert 1e6 < rate < 1e14
