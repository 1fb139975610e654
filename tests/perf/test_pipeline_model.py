"""The pipeline terms of the performance model (hybrid/perf/pipeline.py) and the layout-ranking tool."""

from __future__ import annotations

from pathlib import Path

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


@pytest.mark.parametrize("name", sorted(rank_layouts.PRESETS))
def test_rank_layouts_tool_ranks_the_papers_layouts(name, capsys):
    preset = rank_layouts.PRESETS[name]
    assert rank_layouts.main(["--preset", name, "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert f"published layout {preset.published.describe()}" in out
    found = rank_layouts.rank(preset)
    assert f"{len(found)} layouts fit" in out
    assert all(e.memory_bytes <= preset.cluster.memory_bytes for e in found)
    assert [e.time_s for e in found] == sorted(e.time_s for e in found)
    assert found[0].layout.describe() in out.splitlines()[2]
    est = estimate_layout(preset.published, **preset.model())
    over = est.memory_bytes - preset.cluster.memory_bytes
    if over > 0:   # the verdict says so and by how much, and ranks nothing
        assert f"does NOT fit {preset.cluster.memory_bytes / 1e9:.0f} GB" in out
        assert f"{over / 1e9:.1f} GB over" in out and "would rank" not in out
    else:
        faster = sum(e.time_s < est.time_s for e in found)
        assert f"would rank #{faster + 1} of {len(found) + 1}" in out


def test_rank_layouts_verdicts_of_the_three_runs(capsys):
    """ZeRO's 100B run is the model's first choice; its 170B run (Pa+cpu: checkpoints in host
    memory, which layouts do not model) misses 32 GB by the checkpoints; GPT-3's fits 80 GB."""
    text = rank_layouts.render_presets()
    assert "it fits 32 GB and would rank #1 of" in text.split("== zero-170b")[0]
    zero170 = text.split("== zero-170b")[1].split("== gpt3-175b")[0]
    assert "it does NOT fit 32 GB under this memory model: 0.5 GB over" in zero170
    assert "it fits 80 GB" in text.split("== gpt3-175b")[1]


def test_the_rank_layouts_file_is_current():
    committed = Path(__file__).resolve().parents[2] / "docs" / "paper" / "rank_layouts.txt"
    assert committed.read_text() == rank_layouts.render_presets()


def test_rank_layouts_tool_refuses_bad_input(capsys, tmp_path):
    assert rank_layouts.main(["--layers", "48"]) == 2
    assert capsys.readouterr().err.startswith("error: give --preset or all of --hidden")
    assert rank_layouts.main(["--preset", "zero-100b", "--out", str(tmp_path / "r.txt")]) == 2
    assert capsys.readouterr().err.startswith("error: --out writes the --all-presets reports")
    existing = tmp_path / "r.txt"
    existing.write_text("keep")
    assert rank_layouts.main(["--all-presets", "--out", str(existing)]) == 2
    assert "already exists" in capsys.readouterr().err and existing.read_text() == "keep"


def test_rank_layouts_working_memory_and_offload_lines_by_hand():
    """ZeRO-Infinity §3 / §4 lines of the layout chooser for ZeRO's 100B (TP 16 + SP, DP 25, b 32):
    the largest parameter of a TP rank is the word embedding, 51200 / 16 x 8192 elements, 4 bytes
    each with its gradient; one recomputed layer keeps s b h / t (34 + 5 a s / h) bytes; offloading
    the optimizer states (1/25 per GPU) at ait 25 x 32 x 1024 / 4 needs 0.9 x 125e12 / (0.1 ait) B/s
    for 90% at the V100's peak, against the DGX-2's 1.75 GB/s per GPU of NVMe; ZeRO 0 offloads none."""
    from hybrid.perf.pipeline import Layout, LayoutEstimate
    preset = rank_layouts.PRESETS["zero-100b"]
    line = rank_layouts.working_memory_line(preset, preset.published, "x")
    assert f"(word embedding, {51200 // 16 * 8192 / 1e6:.1f}M elements" in line
    assert f"gradient {4 * 3200 * 8192 / 1e9:.2f} GB" in line
    assert f"one layer recomputed) {1024 * 32 * 8192 / 16 * (34 + 5 * 64 * 1024 / 8192) / 1e9:.2f} GB" in line

    def est(layout):
        return LayoutEstimate(layout, 1, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 1.0)
    zero0 = Layout(16, 1, 25, 1, 0, "full", 32, True)
    lines = rank_layouts.offload_lines(preset, [est(preset.published), est(zero0)], 2, "nvme", 0.9)
    need = 0.9 * 125e12 / (0.1 * 25 * 32 * 1024 / 4)
    assert f"needs {need / 1e9:9.2f} GB/s: NOT enough" in lines[1] and "1.75 GB/s" in lines[0]
    assert "ZeRO 0 offloads nothing" in lines[2]
    assert rank_layouts.main(["--preset", "zero-100b", "--target-efficiency", "1"]) == 2
