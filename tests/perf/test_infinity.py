"""The ZeRO-Infinity paper's memory and bandwidth formulas (hybrid.perf.infinity; issue 35 part 2):
hand-computed values of each formula, the efficiency curve and its inverse, Table 1 and the
bandwidth statements against the paper's values (docs/paper/zero-infinity.md lists the sources and
what could not be checked), and the generated page kept current."""

from pathlib import Path

import pytest

from hybrid.perf import infinity as inf
from tools import infinity_tables as tables

DOCS = Path(__file__).resolve().parents[2] / "docs" / "paper"


def test_memory_formulas_by_hand():
    # 1T row of Table 1: 128 layers, hd 25K = 25600
    assert inf.transformer_params(128, 25600) == 12 * 128 * 25600 ** 2
    assert inf.model_state_bytes(1e12) == 20e12
    assert inf.model_state_bytes(1e12, bytes_per_param=16) == 16e12
    assert inf.checkpoint_bytes(2, 1024, 25600, 128, ci=4) == 2 * 2 * 1024 * 25600 * 128 / 4
    assert inf.paper_working_memory_bytes(65536) == 64 * 2 ** 30          # Table 1's 64 GB at 10T
    assert inf.paper_working_memory_bytes(65536, tile_factor=16) == 4 * 2 ** 30
    assert inf.working_memory_bytes(1000, tile_factor=4, bytes_per_element=2) == 500
    assert inf.activation_working_bytes(1, 1024, 2048, 16, ci=2) == 1024 * 2 * (16 * 2048 + 2 * 16 * 1024)
    assert inf.activation_bytes(1, 8, 4, 2, 3) == 3 * 8 * (16 * 4 + 2 * 2 * 8)
    assert inf.flops_per_iteration(2, 1024, 1e9) == 8 * 2 * 1024 * 1e9


def test_efficiency_and_its_inverse():
    ait = inf.arithmetic_intensity("params_grads", batch=2, seq=1024)
    assert ait == 2048
    assert inf.arithmetic_intensity("optimizer_states", batch=2, seq=1024) == 512
    assert inf.arithmetic_intensity("activation_checkpoints", batch=9, seq=9, hidden=8192, ci=2) == 24 * 8192 * 2
    # efficiency = ait bw / (ait bw + peak): at bw = peak / ait it is one half
    assert inf.efficiency(ait, 70e12 / ait) == pytest.approx(0.5)
    for target in (0.3, 0.9, 0.99):
        bw = inf.required_bandwidth(ait, target)
        assert inf.efficiency(ait, bw) == pytest.approx(target)
    assert inf.partitioned_param_bandwidth(4e9, 64, 70e9) == 70e9     # the GPU link bounds it
    assert inf.partitioned_param_bandwidth(4e9, 4, 70e9) == 16e9


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="kind must be one of"):
        inf.arithmetic_intensity("weights", batch=1, seq=1)
    with pytest.raises(ValueError, match="strictly between 0 and 1"):
        inf.required_bandwidth(10.0, 1.0)
    with pytest.raises(ValueError, match="tile_factor must be a positive integer"):
        inf.working_memory_bytes(10, tile_factor=0)


def test_offload_needs_scale_the_optimizer_by_the_partition():
    needs = inf.offload_needs(micro_batch=2, seq=1024, hidden=8192, dp=16, peak_flops=70e12,
                              target=0.9, optimizer_bandwidth=4e9, param_bandwidth=None,
                              checkpoint_bandwidth=4e9)
    opt, ckpt = needs
    assert (opt.kind, ckpt.kind) == ("optimizer_states", "activation_checkpoints")
    # each GPU moves 32 bytes x params / 16 for 8 x 2 x 1024 x params FLOPs: ait = 16 x 512
    assert opt.ait == 16 * 512
    assert opt.required == pytest.approx(9 * 70e12 / (16 * 512))
    assert not opt.sufficient and ckpt.sufficient
    assert ckpt.efficiency == pytest.approx(24 * 8192 * 4e9 / (24 * 8192 * 4e9 + 70e12))


def test_table1_within_1_percent_or_at_the_printed_precision():
    cells = [c for c in tables.table1_comparisons() if c["paper"] is not None]
    assert len(cells) == 27
    bad = [c for c in cells if not c["agrees"]]
    assert not bad, bad


def test_bandwidth_statements_hold_or_are_explained():
    for claim in tables.claims():
        assert abs(claim.diff) <= 0.01 or claim.explained, claim
    assert tables.claims()[1].ours == pytest.approx(4.0)
    assert tables.claims()[2].ours == pytest.approx(9 * 70e12 / 512)   # 1.23 TB/s, not "nearly 1.5"


def test_the_page_is_current():
    assert (DOCS / tables.PAGE).read_text() == tables.render()
    assert (DOCS / tables.PLOT).stat().st_size > 10_000


def test_tool_refuses_to_overwrite(tmp_path, capsys):
    from tools._cli import run_cli
    (tmp_path / tables.PAGE).write_text("keep")
    assert run_cli(tables.main, ["--out", str(tmp_path)]) == 2
    assert "already exists" in capsys.readouterr().err
    assert (tmp_path / tables.PAGE).read_text() == "keep"


def test_largest_parameter_and_tiling():
    from hybrid.perf.architecture import Architecture
    assert inf.gpt_largest_parameter(768, 50304) == ("word embedding", 50304 * 768)
    assert inf.gpt_largest_parameter(16384, 1024, tp=2) == ("MLP input", 16384 * 65536 / 2)
    swiglu = Architecture(ffn_hidden=1000, swiglu=True)
    assert inf.gpt_largest_parameter(512, 128, arch=swiglu) == ("MLP input", 512 * 2000)
    sizes = [("embedding", 100, False), ("fc1", 400, True), ("qkv", 300, True)]
    assert inf.largest_gather(sizes) == ("fc1", 400)
    assert inf.largest_gather(sizes, tile_factor=4) == ("embedding", 100)   # 400 / 4 = 100 ties
    assert inf.largest_gather(sizes, tile_factor=2) == ("fc1", 200)
