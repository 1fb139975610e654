"""Dry run of every Table 5 row at full size on the meta device: the real TP GPT's parameter count
per rank equals the exact formula (and Megatron's up to vocab padding, replicated norms/biases and the
final LayerNorm), and every ZeRO row fits a 32 GB V100."""

from pathlib import Path

import pytest

pytest.importorskip("models.gpt.model")

from hybrid.perf.flops import megatron_param_count  # noqa: E402
from models.gpt.presets import PAPER_RUNS  # noqa: E402
from tools import dry_run  # noqa: E402


@pytest.fixture(scope="module")
def rows():
    return {r["name"]: r for r in dry_run.rows()}


def test_every_table5_row_counts_exactly_the_formula(rows):
    table5 = [r for r in PAPER_RUNS.values() if r.table == "table5"]
    assert len(rows) == len(table5) == 18
    for run in table5:
        row, c = rows[run.name], run.config
        assert row["params_per_rank"] == row["formula_exact"] == c.num_parameters_per_rank(run.tp)
        # Whole model vs Megatron's formula: equal once the vocab is padded, but for the final norm.
        padded = megatron_param_count(c.num_layers, c.hidden_size, c.padded_vocab_size(run.tp),
                                      c.seq_length)
        assert c.num_parameters(run.tp) == pytest.approx(padded + 2 * c.hidden_size, rel=1e-12)
        assert abs(row["megatron_rel_diff"]) < 0.03, run.name


def test_zero_rows_fit_32gb_and_use_the_stated_layout(rows):
    for name, row in rows.items():
        assert row["fits_32gb"], name
        if "zero" in name:
            assert row["stage"] == 2 and row["total_gb"] <= 32
    assert rows["table5-zero-100B"]["config"] == "C4"     # Pos+g + Pa
    assert rows["table5-zero-170B"]["config"] == "C5"     # needs Pa+cpu, as ZeRO Table 3 says


def test_layouts_report_tp_groups_crossing_nodes():
    summary = {(t["gpus"], t["tp"]): t for t in dry_run.layouts()}
    assert summary[(400, 16)]["tp_groups_inside_a_node"] == 25
    assert summary[(384, 32)]["nodes_per_tp_group"] == 2
    assert summary[(384, 128)]["tp_groups_inside_a_node"] == 0
    assert summary[(256, 256)]["nodes_per_tp_group"] == 16


def test_the_dry_run_file_is_current(rows):
    """docs/paper/dry_run.txt is the tool's output now (regenerate: python -m tools.dry_run >
    docs/paper/dry_run.txt); a change to the presets, the estimates or the link split shows here."""
    committed = Path(__file__).resolve().parents[2] / "docs" / "paper" / "dry_run.txt"
    assert committed.read_text() == dry_run.render(list(rows.values()), dry_run.layouts())
