"""The calibration benchmark's pure pieces (issue 4 item 5): the CPU "cluster" plugged into the same
throughput model as the V100 - GEMMs at the measured GEMM rate, the attention core at its measured
rate, memory-bound passes at the measured elementwise bandwidth, a measured host overhead per layer,
gloo bandwidth + latency for TP/DP - and the documented status recomputed from the stored
docs/paper/calibration.json (nothing is re-measured here)."""

import json
import re
from pathlib import Path

import pytest

from benchmarks import calibrate_perf_model as cal
from hybrid.perf.flops import model_flops_per_iteration
from hybrid.perf.throughput import attention_core_flops_per_iteration

DOCS = Path(__file__).resolve().parents[2] / "docs" / "paper"
RATES = {"gemm_flops": 10e9, "attention_flops": 2e9, "elementwise_Bps": 5e9}


def test_cpu_prediction_adds_each_measured_term():
    cluster = cal.cpu_cluster(peak=20e9, allreduce_bw=1e9, latency=1e-4, adam_bw=10e9,
                              layer_overhead_s=1e-3)
    m, b = cal.MODEL, cal.MICRO_BATCH
    l, h, s, v = m["num_layers"], m["hidden_size"], m["seq_length"], m["vocab_size"]
    flops = model_flops_per_iteration(b, s, l, h, v)
    core = attention_core_flops_per_iteration(b, s, l, h, "none")
    tp2 = cal.predict(2, 1, 0, cluster, RATES)
    assert tp2.compute_s == pytest.approx((flops - core) / 2 / 10e9 + core / 2 / 2e9)
    # forward passes 10 b s h + 10 b s h / t, x (1 + 2) with backward, fp32; 6 passes over the
    # b s V/t logits
    tokens = b * s
    mem_bytes = l * 3 * 4 * (10 + 10 / 2) * tokens * h + 6 * 4 * tokens * v / 2
    assert tp2.memory_s == pytest.approx(mem_bytes / 5e9)
    assert tp2.overhead_s == pytest.approx(l * 1e-3)
    # 4 all-reduces of b s h fp32 per layer + embedding and output layer, 3 fp32 per token for the
    # loss; ring factor 2 (n-1)/n = 1 at n = 2; no recompute; 4 l + 4 calls at the latency
    tp_bytes = (l * 4 + 2) * tokens * h * 4 + 3 * tokens * 4
    assert tp2.tp_comm_s == pytest.approx(tp_bytes / 1e9 + (4 * l + 4) * 1e-4)
    dp2 = cal.predict(1, 2, 2, cluster, RATES)
    assert dp2.tp_comm_s == 0 and dp2.dp_comm_s > 0
    faster = cal.predict(1, 2, 2, cluster.with_changes(intra_node_bandwidth=2e9), RATES)
    latency = 2 * 1e-4   # stage 2, one micro-batch: a reduce-scatter and an all-gather
    assert faster.dp_comm_s - latency == pytest.approx((dp2.dp_comm_s - latency) / 2)
    stage3 = cal.predict(1, 2, 3, cluster.with_changes(intra_node_bandwidth=1e15), RATES)
    assert stage3.dp_comm_s == pytest.approx(3 * (l + 2) * 1e-4, rel=1e-3)   # gathers x2, RS, per unit
    assert tp2.time_s == pytest.approx(tp2.compute_s + tp2.memory_s + tp2.overhead_s + tp2.tp_comm_s
                                       + tp2.optimizer_s)


def test_stored_calibration_is_the_current_model_and_meets_the_documented_status():
    result = json.loads((DOCS / "calibration.json").read_text())
    mach = result["machine"]
    cluster = cal.cpu_cluster(mach["gemm_fp32_gflops"] * 1e9, mach["gloo_allreduce_GBps"] * 1e9,
                              mach["gloo_latency_us"] * 1e-6, mach["adam_GBps"] * 1e9,
                              mach["layer_overhead_ms"] * 1e-3)
    for run in result["runs"]:
        rates = {"gemm_flops": run["gemm_gflops_at_shape"] * 1e9,
                 "attention_flops": run["attention_gflops"] * 1e9,
                 "elementwise_Bps": run["elementwise_GBps"] * 1e9}
        est = cal.predict(run["tp"], run["dp"], run["stage"], cluster, rates)
        assert est.time_s == pytest.approx(run["predicted_s"], rel=1e-9), run["layout"]
        assert run["ratio"] == pytest.approx(run["measured_s"] / run["predicted_s"])
    status = cal.calibration_status(result)
    line = re.search(r"\*\*Status: (\d+) of (\d+) layouts .* \((PASS|FAIL)",
                     (DOCS / "calibration.md").read_text())
    assert line and (int(line[1]), int(line[2])) == (status["within"], status["total"])
    assert line[3] == ("PASS" if status["passed"] else "FAIL")
    assert status["passed"], f"only {status['layouts_within']} within {mach['tolerance']:.0%}"


def test_status_counts_relative_error_against_measured():
    runs = [{"layout": str(i), "predicted_s": p, "measured_s": 1.0}
            for i, p in enumerate([0.75, 1.25, 0.74, 1.3, 1.0])]
    status = cal.calibration_status({"machine": {"tolerance": 0.25}, "runs": runs})
    assert status["layouts_within"] == ["0", "1", "4"] and not status["passed"]


def test_micro_measurements_are_positive_and_finite():
    torch = cal.torch
    assert 1e6 < cal.gemm_rate(64, 64, 64, torch.float32, repeats=3) < 1e14
    assert 1e6 < cal.layer_gemm_rate(32, 16, 64, 2, repeats=1) < 1e14
    assert 1e6 < cal.elementwise_bandwidth(32, 16, 2, repeats=1) < 1e13
    assert 1e5 < cal.attention_core_rate(1, 2, 16, 8, repeats=1) < 1e14
    assert 1e-7 < cal.layer_overhead(repeats=3) < 1.0
