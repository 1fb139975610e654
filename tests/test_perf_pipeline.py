"""The pipeline terms of the performance model (hybrid/perf/pipeline.py) and the layout-ranking tool."""

from __future__ import annotations

import pytest

from hybrid.perf.memory import device_memory
from hybrid.perf.pipeline import (Layout, bubble_fraction, estimate_layout, micro_batches_in_flight,
                                  p2p_bytes_per_step)
from hybrid.perf.throughput import estimate_iteration
from hybrid.pipeline import PipelineConfig, bubble_formula
from tools import rank_layouts

MODEL = dict(layers=48, hidden=1600, heads=16, seq=1024, vocab=50257)


def test_one_stage_is_the_tp_zero_model():
    layout = Layout(tp=2, pp=1, dp=8, virtual=1, stage=2, recompute="full", micro_batch=4)
    est = estimate_layout(layout, global_batch=64, **MODEL)
    it = estimate_iteration(micro_batch=4, tp=2, dp=8, stage=2, grad_accumulation=2,
                            recompute="full", **{k: MODEL[k] for k in ("layers", "hidden", "seq",
                                                                          "vocab")})
    assert est.time_s == pytest.approx(it.time_s, rel=1e-12)
    assert est.bubble_s == 0 and est.p2p_s == 0
    mem = device_memory(micro_batch=4, tp=2, dp=8, stage=2, recompute="full", **MODEL)
    assert est.memory_bytes == pytest.approx(mem.total, rel=1e-12)


@pytest.mark.parametrize("p,m,v", [(2, 4, 1), (4, 8, 1), (4, 8, 2), (8, 16, 2)])
def test_bubble_share_of_the_pipelined_work_is_the_schedules(p, m, v):
    assert bubble_fraction(p, m, v) == bubble_formula(
        PipelineConfig(p, m, p * v, "interleaved" if v > 1 else "1f1b", v))
    layout = Layout(tp=1, pp=p, dp=1, virtual=v, stage=1, recompute="full", micro_batch=1)
    est = estimate_layout(layout, global_batch=m, **MODEL)
    assert est.micro_batches == m
    assert est.bubble_s / est.compute_s == pytest.approx(bubble_fraction(p, m, v), rel=1e-12)


def test_p2p_volume_and_activations_in_flight():
    # a middle stage sends m v activations and m v gradients of b s h (/t with SP)
    assert p2p_bytes_per_step(pp=4, virtual=2, micro_batches=8, micro_batch=2, seq=1024, hidden=1600,
                              tp=4, sequence_parallel=True) == 2 * 8 * 2 * 2 * 1024 * 1600 * 2 / 4
    assert p2p_bytes_per_step(pp=1, virtual=1, micro_batches=8, micro_batch=2, seq=1024,
                              hidden=1600) == 0
    assert micro_batches_in_flight(4) == 4
    assert micro_batches_in_flight(4, 2) == pytest.approx(4 * (1 + 3 / 8))


def test_rank_layouts_tool_ranks_the_papers_layouts(capsys):
    assert rank_layouts.main(["--preset", "zero-100b", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "layouts fit" in out and "published layout TP 16+SP x PP 1 x DP 25" in out
    assert rank_layouts.main(["--layers", "48"]) == 2
    assert capsys.readouterr().err.startswith("error: give --preset or all of --hidden")
