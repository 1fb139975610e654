"""--context-parallel-size and --cp-comm-type (issue 31): Megatron's names, the batch arithmetic
(DP = world / (TP x CP x PP)), and one clear error for each layout the CP attention cannot run."""

import pytest

from hybrid.layout import LayoutError, RunLayout
from pretrain.arguments import parse_args
from pretrain.config import TrainConfigError
from pretrain.preflight import check_layout

BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
        "--micro-batch-size", "1"]


def test_flags_set_the_parallel_section_and_the_layout():
    cfg, _ = parse_args(BASE + ["--context-parallel-size", "2", "--cp-comm-type", "a2a",
                                "--tensor-model-parallel-size", "2", "--global-batch-size", "4"])
    assert (cfg.parallel.context_parallel_size, cfg.parallel.cp_comm_type) == (2, "a2a")
    layout = cfg.validate_for_world(16)
    assert (layout.tensor_parallel, layout.context_parallel, layout.data_parallel) == (2, 2, 4)
    assert layout.world_size == 16 and layout.micro_batches == 1 and layout.global_batch == 4
    defaults, _ = parse_args(BASE)
    assert (defaults.parallel.context_parallel_size, defaults.parallel.cp_comm_type) == (1, "p2p")


@pytest.mark.parametrize("extra, message", [
    (["--context-parallel-size", "3"], "sequence length 64 is not divisible by 2 x context-parallel size = 6"),
    (["--context-parallel-size", "2", "--cp-comm-type", "ring"], "--cp-comm-type must be one of p2p, a2a, allgather"),
    (["--context-parallel-size", "2", "--cp-comm-type", "a2a+p2p"], "hierarchical CP"),
    (["--context-parallel-size", "8", "--cp-comm-type", "a2a"], "4 attention heads per TP rank"),
    (["--context-parallel-size", "2", "--cp-comm-type", "a2a", "--group-query-attention",
      "--num-query-groups", "1"], "1 query groups per TP rank"),
    (["--context-parallel-size", "2", "--attention-dropout", "0.1"], "set --attention-dropout 0"),
    (["--context-parallel-size", "2", "--zero-stage", "3", "--zero-hpz"], "--zero-hpz with --context-parallel-size 2"),
    (["--context-parallel-size", "0"], "--context-parallel-size must be a positive integer"),
    (["--context-parallel-size", "2", "--enable-cuda-graph"], "use --context-parallel-size 1 with --enable-cuda-graph"),
    (["--context-parallel-size", "4", "--tensor-model-parallel-size", "4", "--sequence-parallel",
      "--seq-length", "72", "--max-position-embeddings", "72"], "each CP rank's 18 tokens"),
])
def test_bad_cp_layouts_are_one_clear_error(extra, message):
    with pytest.raises(TrainConfigError, match=message.replace("(", r"\(").replace("+", r"\+")):
        parse_args(BASE + extra)


def test_world_not_divisible_names_the_flag():
    cfg, _ = parse_args(BASE + ["--context-parallel-size", "4", "--tensor-model-parallel-size", "2"])
    with pytest.raises(TrainConfigError, match="TP 2 x CP 4 x PP 1 = 8 ranks"):
        cfg.validate_for_world(12)
    with pytest.raises(TrainConfigError, match="TP 2 x CP 4 x PP 1 = 8"):
        check_layout(cfg, 4, 4)
    with pytest.raises(LayoutError, match="--context-parallel-size"):
        RunLayout.for_world(6, context_parallel=4, micro_batch_size=1, seq_length=8)


def test_megatron_catalogue_has_cp_flags_native():
    from pretrain.megatron_flags import CATALOGUE
    kinds = {f.name: f.kind for f in CATALOGUE}
    assert kinds["--context-parallel-size"] == "native" and kinds["--cp-comm-type"] == "native"
    assert kinds["--hierarchical-context-parallel-sizes"] == "refused"


def test_kv_cache_generation_refuses_a_cp_layout():
    """Decoding one token at a time has no sequence to split: a CP layout with a KV cache is one
    clear error (generation runs without a layout, every CP rank on the whole context)."""
    import torch

    from hybrid.comm import CommLedger, Group
    from hybrid.parallel_state import ParallelState
    from models.gpt.config import GPTConfig
    from models.gpt.model import GPTModel
    from models.gpt.token_layout import TokenLayout
    model = GPTModel(GPTConfig(1, 16, 2, vocab_size=32, seq_length=8), ParallelState.single_process())
    layout = TokenLayout(token_index=torch.arange(4), cp_group=Group("cp", [0, 1], 0, CommLedger()))
    with pytest.raises(ValueError, match="KV-cache decoding takes no TokenLayout"):
        model(torch.zeros(1, 4, dtype=torch.long), cache=model.new_kv_cache(), layout=layout)



def test_experts_across_context_parallel_ranks_are_accepted():
    """EP x CP (issue 32 with 31): EP groups are carved out of DP x CP, so EP may exceed DP; an EP
    that does not divide DP x CP is one clear error naming both."""
    moe = BASE + ["--swiglu", "--num-experts", "8", "--context-parallel-size", "2",
                  "--global-batch-size", "2"]
    cfg, _ = parse_args(moe + ["--expert-model-parallel-size", "4"])
    layout = cfg.validate_for_world(4)                 # TP 1 x CP 2 x DP 2: EP 4 spans CP and DP
    assert (layout.context_parallel, layout.data_parallel) == (2, 2)
    cfg, _ = parse_args(moe + ["--expert-model-parallel-size", "8"])
    with pytest.raises(TrainConfigError, match="--expert-model-parallel-size 8 does not divide the "
                                               "data-parallel x context-parallel size 4"):
        cfg.validate_for_world(4)
