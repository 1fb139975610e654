"""GPT config validation and the paper's presets (ZeRO Tables 5, 6, 10) checked against docs/design.md §Paper."""

import pytest

from models.gpt.config import ConfigError, GPTConfig
from models.gpt.presets import PAPER_RUNS, PRESETS, get_config, get_paper_run, paper_run_names, table5


def test_defaults_and_derived_sizes():
    c = GPTConfig(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=1000, seq_length=32)
    assert (c.ffn_hidden_size, c.max_position_embeddings, c.head_dim) == (256, 32, 16)
    assert c.padded_vocab_size(1) == 1024 and c.padded_vocab_size(4) == 1024
    assert c.padded_vocab_size(16) == 2048          # multiple of 128 * 16
    assert GPTConfig(1, 8, 2, vocab_size=50257).padded_vocab_size(8) == 51200  # Megatron's GPT-2 value


@pytest.mark.parametrize("kwargs, message", [
    (dict(hidden_size=1000, num_attention_heads=16), "hidden size 1000 is not divisible by 16 attention heads"),
    (dict(seq_length=2048, max_position_embeddings=1024), "exceeds max position embeddings 1024"),
    (dict(num_layers=0), "num_layers must be a positive integer.*--num-layers"),
    (dict(hidden_dropout=1.0), "hidden_dropout must be in"),
    (dict(vocab_size=2.5), "vocab_size must be a positive integer"),
])
def test_invalid_configs_say_what_to_fix(kwargs, message):
    base = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=64)
    with pytest.raises(ConfigError, match=message):
        GPTConfig(**{**base, **kwargs})


def test_validate_for_tp_messages():
    c = GPTConfig(num_layers=2, hidden_size=96, num_attention_heads=6)
    c.validate_for_tp(3)
    with pytest.raises(ConfigError, match="6 attention heads cannot be split across tensor-model-parallel size 4"):
        c.validate_for_tp(4)
    with pytest.raises(ConfigError, match="ffn hidden size 100 is not divisible by tensor-model-parallel size 3"):
        c.replace(ffn_hidden_size=100).validate_for_tp(3)
    with pytest.raises(ConfigError, match="tensor-model-parallel size must be a positive integer"):
        c.validate_for_tp(0)


def _count_by_hand(c: GPTConfig, tp: int) -> int:
    """Count parameters the long way, tensor by tensor, as the model lays them out."""
    h, f, vp = c.hidden_size, c.ffn_hidden_size, c.padded_vocab_size(tp)
    layer = [2 * h, 3 * h * h + 3 * h, h * h + h, 2 * h, h * f + f, f * h + h]
    return vp * h + c.max_position_embeddings * h + c.num_layers * sum(layer) + 2 * h


def test_parameter_counts_exact():
    c = PRESETS["small"]
    for tp in (1, 2, 4):
        assert c.num_parameters(tp) == _count_by_hand(c, tp)
    h, f, l = c.hidden_size, c.ffn_hidden_size, c.num_layers
    per_rank = (c.padded_vocab_size(2) * h // 2 + c.max_position_embeddings * h + 2 * h
                + l * (4 * h + (4 * h * h + 3 * h) // 2 + h + (2 * h * f + f) // 2 + h))
    assert c.num_parameters_per_rank(2) == per_rank
    assert c.num_parameters_per_rank(1) == c.num_parameters(1)


def test_every_paper_row_is_present_and_consistent():
    assert len(paper_run_names("table5")) == 18 and len(paper_run_names("table6")) == 4
    assert len(paper_run_names("table10")) == 9
    for run in PAPER_RUNS.values():
        c = run.config
        c.validate_for_tp(run.tp)
        assert (c.seq_length, c.vocab_size) == (1024, 50257)
        assert run.gpus % run.tp == 0 and run.global_batch == run.micro_batch * run.dp, run.name
        # Paper formula Psi ~ 12 l h^2 (1 + 13/(12h) + (V + s)/(12 l h)) is the exact count up to
        # vocab padding; and the size label is within 10% of the real count.
        l, h = c.num_layers, c.hidden_size
        formula = 12 * l * h * h * (1 + 13 / (12 * h) + (c.vocab_size + c.seq_length) / (12 * l * h))
        assert c.num_parameters(1) == pytest.approx(formula, rel=1e-3), run.name
        assert c.num_parameters(1) == pytest.approx(run.label_parameters, rel=0.10), run.name
        assert c.num_parameters(1) == pytest.approx(12 * l * h * h, rel=0.10), run.name


def test_table_rows_copied_exactly():
    def row(r):
        c = r.config
        return (r.gpus, r.tp, c.num_layers, c.hidden_size, c.num_attention_heads, r.micro_batch,
                r.global_batch)
    assert row(table5("1.5B")) == (400, 1, 48, 1600, 16, 24, 9600)
    assert row(table5("40B", zero=False)) == (384, 32, 88, 6144, 64, 4, 48)
    assert row(table5("100B")) == (400, 16, 125, 8192, 64, 32, 800)
    assert row(table5("170B", zero=False)) == (256, 256, 212, 8192, 256, 2, 2)
    assert row(get_paper_run("table6-60B-128gpus")) == (128, 16, 75, 8192, 32, 48, 384)
    assert row(get_paper_run("table10-13B")) == (128, 1, 62, 4096, 32, 2, 256)
    assert get_config("zero-100B").num_parameters() == pytest.approx(100e9, rel=0.02)


def test_unknown_names_list_choices():
    with pytest.raises(ConfigError, match="unknown GPT preset 'huge'.*tiny"):
        get_config("huge")
    with pytest.raises(ConfigError, match="table5-zero-100B"):
        get_paper_run("table5-zero-99B")


def test_cpu_presets_fit_small_tp_and_roundtrip():
    for name in ("tiny", "small"):
        c = PRESETS[name]
        for tp in (1, 2, 4):
            c.validate_for_tp(tp)
        assert GPTConfig.from_dict(c.to_dict()) == c
    with pytest.raises(ConfigError, match="unknown GPT config fields \\['bogus'\\]"):
        GPTConfig.from_dict({**PRESETS["tiny"].to_dict(), "bogus": 1})
