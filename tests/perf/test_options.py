"""The perf models (hybrid/perf) with the Llama-family options, against the real models: parameters
per TP rank equal GPTConfig's count and the built model's; FLOPs of one training step equal what
torch's FLOP counter measures on the oracle (GEMMs of forward and backward); SwiGLU's three
matrices and GQA's smaller K/V show in the activation model."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from hybrid.parallel_state import ParallelState
from hybrid.perf import (GPT2, Architecture, activation_bytes_per_layer, device_memory,
                         gpt_param_count)
from hybrid.perf.flops import model_flops_per_iteration, recompute_flops_per_iteration
from models.gpt.model import GPTModel
from models.gpt.reference import ReferenceGPT
from tests.models.test_gpt_options import OPTIONS, options_config


@pytest.mark.parametrize("name", OPTIONS)
def test_parameter_count_matches_config_and_model(name):
    config = options_config(OPTIONS[name])
    arch = config.perf_architecture()
    h, heads = config.hidden_size, config.num_attention_heads
    for tp in (1, 2, 4):
        if config.query_groups % tp:
            continue
        count = gpt_param_count(config.num_layers, h, config.padded_vocab_size(tp),
                                config.max_position_embeddings, tp=tp, heads=heads, arch=arch)
        assert count == config.num_parameters_per_rank(tp), (name, tp)
    model = GPTModel(config, ParallelState.single_process(), device="meta")
    assert sum(p.numel() for p in model.parameters()) == gpt_param_count(
        config.num_layers, h, config.padded_vocab_size(1), config.max_position_embeddings,
        heads=heads, arch=arch)


@pytest.mark.parametrize("name", ["gqa", "swiglu", "llama"])
def test_flops_match_torch_flop_counter(name):
    config = options_config(OPTIONS[name])
    model = ReferenceGPT(config)
    model.init_weights(0)
    batch = 2
    tokens = torch.randint(0, config.vocab_size, (batch, config.seq_length))
    with FlopCounterMode(display=False) as counter:
        model(tokens, tokens).mean().backward()
    expected = model_flops_per_iteration(batch, config.seq_length, config.num_layers,
                                         config.hidden_size, config.vocab_size,
                                         heads=config.num_attention_heads,
                                         arch=config.perf_architecture())
    assert counter.get_total_flops() == expected
    full = recompute_flops_per_iteration(batch, config.seq_length, config.num_layers,
                                         config.hidden_size, "full", heads=config.num_attention_heads,
                                         arch=config.perf_architecture())
    assert full == pytest.approx((expected - 6 * batch * config.seq_length * config.hidden_size
                                  * config.vocab_size) / 3)


def test_gpt2_defaults_unchanged_and_options_move_the_estimates():
    dims = dict(layers=4, hidden=1024, heads=16, seq=1024, vocab=50257, micro_batch=4, tp=2, dp=4,
                stage=2, recompute="none")
    base = device_memory(**dims)
    assert device_memory(**dims, arch=GPT2).total == base.total
    gqa = device_memory(**dims, arch=Architecture(query_groups=4))
    assert gqa.model_states.total < base.model_states.total and gqa.working < base.working
    s, b, h, a = 1024, 4, 1024, 16
    sbh = s * b * h
    swiglu = Architecture(swiglu=True, ffn_hidden=2816)
    plain = activation_bytes_per_layer(s, b, h, a, tp=2, recompute="selective")
    assert plain == sbh * (10 + 24 / 2)
    # SwiGLU keeps 8 f per token in the MLP instead of GELU's 4 f: 16 h -> 8 * 2816 / 1024 h
    assert activation_bytes_per_layer(s, b, h, a, tp=2, recompute="selective", arch=swiglu) == \
        pytest.approx(sbh * (10 + (8 + 8 * 2816 / h) / 2))


MEASURED = [("llama", "none"), ("llama", "selective"), ("rope", "none"), ("rope", "selective"),
            ("gqa", "none"), ("gqa", "selective"),
            ("swiglu", "none"), ("swiglu", "selective"), ("rmsnorm", "none"), ("rmsnorm", "selective")]


@pytest.mark.parametrize("name, mode", MEASURED)
def test_activation_model_equals_measured_bytes(name, mode):
    """Bytes a layer keeps for backward (saved_tensors_hooks, fp32 on CPU, dropout 0.1) equal the
    activation model through the recompute planner's element sizes, with the CPU attention core's
    accounting (``cpu_core``)."""
    from hybrid.recompute import ModelDims
    from hybrid.recompute.planner import mode_costs
    from tests.recompute.test_gpt import _per_layer, _step
    config = options_config(OPTIONS[name]).replace(hidden_dropout=0.1, attention_dropout=0.1,
                                                   seq_length=32, vocab_size=128)
    state = ParallelState.single_process()
    ref = _step(state, config, 2, False, "none")
    got = ref if mode == "none" else _step(state, config, 2, False, mode)
    measured = _per_layer(got, ref, config)["device"]
    d = ModelDims(config.num_layers, config.hidden_size, config.num_attention_heads, config.seq_length,
                  2, mask_bytes=4, cpu_core=True, arch=config.perf_architecture())
    expected = mode_costs(d)[mode].device_bytes
    cos_sin = 2 * config.seq_length * config.head_dim * 4 / config.num_layers   # shared rotary cache
    if config.position_embedding_type == "rope":
        expected += cos_sin
    assert measured == expected
