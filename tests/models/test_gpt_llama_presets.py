"""Llama presets: parameter counts equal the published ones exactly, and each full-size model builds
on the meta device for one TP rank of its usual layout with that rank's share of the count."""

import pytest

from hybrid.parallel_state import ParallelState
from hybrid.topology import Topology
from models.gpt.model import GPTModel
from models.gpt.presets import LLAMA_PRESETS, get_config

PUBLISHED = {"llama2-7B": 6_738_415_616, "llama2-13B": 13_015_864_320, "llama2-70B": 68_976_648_192,
             "llama3-8B": 8_030_261_248, "llama3-70B": 70_553_706_496}
TP = {"llama2-7B": 1, "llama2-13B": 2, "llama2-70B": 8, "llama3-8B": 4, "llama3-70B": 8}


@pytest.mark.parametrize("name", PUBLISHED)
def test_published_parameter_counts(name):
    config = get_config(name)
    assert config.padded_vocab_size(1) == config.vocab_size   # 32000 and 128256: no padding at TP 1
    assert config.num_parameters(1) == PUBLISHED[name]


@pytest.mark.parametrize("name", PUBLISHED)
def test_full_size_builds_on_meta_for_one_tp_rank(name):
    config, tp = get_config(name), TP[name]
    state = ParallelState.dry_run(Topology(tp, tp, gpus_per_node=8), rank=tp - 1)
    model = GPTModel(config, state, device="meta")
    local = sum(p.numel() for p in model.parameters())
    assert all(p.is_meta for p in model.parameters())
    assert local == config.num_parameters_per_rank(tp)
    if tp == 1:
        assert local == PUBLISHED[name]


def test_tiny_llama_uses_every_option():
    c = LLAMA_PRESETS["tiny-llama"]
    assert (c.position_embedding_type, c.normalization, c.swiglu, c.query_groups, c.add_bias_linear,
            c.untie_embeddings_and_output_weights) == ("rope", "RMSNorm", True, 2, False, True)
    c.validate_for_tp(2)
