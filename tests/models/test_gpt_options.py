"""The Llama-family options of GPTConfig on one rank: validation messages, parameter counts tensor by
tensor, and TP-1 parity with the independent single-device oracle (logits, loss, every gradient) for
each option alone and all together. Multi-rank parity: tests/models/test_gpt_options_parity.py."""

import pytest
import torch

from hybrid.parallel_state import ParallelState
from models.gpt import sharding
from models.gpt.config import ConfigError, GPTConfig
from models.gpt.model import GPTModel
from models.gpt.reference import ReferenceGPT, rotary_frequencies
from models.gpt.rotary import inverse_frequencies
from tests.models.test_gpt_parity import SEED, _check_against_reference, _run

NO_DROPOUT = dict(hidden_dropout=0.0, attention_dropout=0.0, make_vocab_size_divisible_by=1)
ROPE_SCALED = dict(position_embedding_type="rope", use_rope_scaling=True, rope_scaling_factor=8.0,
                   rope_original_max_position_embeddings=64)   # scales the slow half of d=8's waves
OPTIONS = {
    "rope": dict(position_embedding_type="rope"),
    "rope-scaled": ROPE_SCALED,
    "rmsnorm": dict(normalization="RMSNorm", norm_epsilon=1e-6),
    "swiglu": dict(swiglu=True),
    "gqa": dict(group_query_attention=True, num_query_groups=4),
    "mqa": dict(group_query_attention=True, num_query_groups=1),
    "no-bias": dict(add_bias_linear=False),
    "untied": dict(untie_embeddings_and_output_weights=True),
}
LLAMA = {**ROPE_SCALED, **OPTIONS["rmsnorm"], **OPTIONS["swiglu"], **OPTIONS["gqa"],
         **OPTIONS["no-bias"], **OPTIONS["untied"]}
OPTIONS["llama"] = LLAMA


def options_config(options: dict, vocab_size: int = 251) -> GPTConfig:
    """2 layers, h 64, 8 heads of 8 channels (4 query groups split over TP 4), seq 16."""
    return GPTConfig(2, 64, 8, vocab_size=vocab_size, seq_length=16, ffn_hidden_size=96,
                     **NO_DROPOUT, **options)


@pytest.mark.parametrize("name", OPTIONS)
def test_tp1_option_matches_reference(name):
    config = options_config(OPTIONS[name])
    model = GPTModel(config, ParallelState.single_process(), device="meta")
    model.init_weights(SEED)
    assert sum(p.numel() for p in model.parameters()) == config.num_parameters(1)
    loss, logits, grads = _run(model, config)
    _check_against_reference(config, 1, loss, [logits], [grads], f"{name} tp1")


def test_options_change_the_function():
    """Each option alone gives different logits from GPT-2 and rope scaling from plain rope, so the
    parity tests would notice an option being ignored on one side (biases start at zero, so
    dropping them shows in the parameter set instead)."""
    tokens = torch.arange(32).view(2, 16) % 251
    outputs = {}
    for name, options in {"gpt2": {}, **OPTIONS}.items():
        model = ReferenceGPT(options_config(options))
        model.init_weights(SEED)
        outputs[name] = model(tokens)
    for name in set(OPTIONS) - {"no-bias"}:
        assert not torch.allclose(outputs[name], outputs["gpt2"], rtol=1e-4, atol=1e-6), name
    no_bias = ReferenceGPT(options_config(OPTIONS["no-bias"])).state_dict()
    assert {k for k in no_bias if k.endswith("bias")} == {f"layers.{i}.{n}.bias" for i in (0, 1)
                                                         for n in ("ln1", "ln2")} | {"final_norm.bias"}
    assert not torch.allclose(outputs["rope-scaled"], outputs["rope"], rtol=1e-4, atol=1e-6)


def test_llama3_frequency_scaling_matches_between_implementations():
    config = GPTConfig(1, 1024, 8, position_embedding_type="rope", rotary_base=500000.0,
                       use_rope_scaling=True)   # Llama-3.1's d = 128, factor 8, 1 / 4, 8192
    ours, oracle = inverse_frequencies(config), rotary_frequencies(config)
    torch.testing.assert_close(ours.double(), oracle, rtol=1e-6, atol=0)
    plain = inverse_frequencies(config.replace(use_rope_scaling=False)).double()
    assert ours[0] == plain[0] and ours[-1] == pytest.approx(plain[-1].item() / 8, rel=1e-6)


def _count_by_hand(c: GPTConfig, tp: int) -> int:
    """Parameters of one TP rank, tensor by tensor, as the model lays them out."""
    h, f, d, g, a = c.hidden_size, c.ffn_hidden_size, c.head_dim, c.query_groups, c.num_attention_heads
    vp = c.padded_vocab_size(tp) // tp
    norm = 2 * h if c.normalization == "LayerNorm" else h
    mlp_in = 2 * f if c.swiglu else f
    layer = [norm, h * (a + 2 * g) * d // tp, h * h // tp, norm, mlp_in * h // tp, f * h // tp]
    if c.add_bias_linear:
        layer += [(a + 2 * g) * d // tp, h, mlp_in // tp, h]
    total = vp * h + c.num_layers * sum(layer) + norm
    if c.position_embedding_type == "learned_absolute":
        total += c.max_position_embeddings * h
    if c.untie_embeddings_and_output_weights:
        total += vp * h
    return total


@pytest.mark.parametrize("name", OPTIONS)
def test_parameter_counts_by_hand(name):
    config = options_config(OPTIONS[name])
    for tp in (1, 2, 4):
        if config.query_groups % tp:
            continue
        assert config.num_parameters_per_rank(tp) == _count_by_hand(config, tp)
    assert config.num_parameters(1) == _count_by_hand(config, 1)
    shapes = sharding.canonical_shapes(config)
    assert sum(torch.Size(s).numel() for s in shapes.values()) == config.num_parameters(1)


def test_swiglu_default_ffn_is_megatrons():
    assert GPTConfig(1, 4096, 32, swiglu=True).ffn_hidden_size == 10880   # int(4h 2/3) // 64 * 64
    c = GPTConfig(1, 64, 4)
    assert c.replace(swiglu=True).ffn_hidden_size == 128 and c.ffn_hidden_size == 256


@pytest.mark.parametrize("kwargs, message", [
    (dict(position_embedding_type="alibi"), "position_embedding_type must be one of learned_absolute, "
                                            "rope.*--position-embedding-type"),
    (dict(normalization="rms"), "normalization must be one of LayerNorm, RMSNorm"),
    (dict(group_query_attention=True), "needs --num-query-groups"),
    (dict(num_query_groups=2), "add --group-query-attention"),
    (dict(group_query_attention=True, num_query_groups=3), "4 attention heads cannot be shared evenly "
                                                           "by 3 query groups.*e.g. 4"),
    (dict(use_rope_scaling=True), "add --position-embedding-type rope"),
    (dict(position_embedding_type="rope", hidden_size=60), "head size 15.*is odd"),
    (dict(position_embedding_type="rope", rotary_base=1.0), "--rotary-base"),
    (dict(position_embedding_type="rope", use_rope_scaling=True, rope_low_freq_factor=4.0),
     "low_freq_factor < high_freq_factor"),
    (dict(swiglu="yes"), "swiglu must be true or false"),
    (dict(norm_epsilon=0.0), "--norm-epsilon"),
])
def test_invalid_options_say_what_to_fix(kwargs, message):
    base = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=64)
    with pytest.raises(ConfigError, match=message):
        GPTConfig(**{**base, **kwargs})


def test_query_groups_must_split_across_tp():
    c = GPTConfig(2, 64, 8, group_query_attention=True, num_query_groups=2)
    c.validate_for_tp(2)
    with pytest.raises(ConfigError, match="2 query groups cannot be split across tensor-model-parallel "
                                          "size 4.*--num-query-groups to a multiple of 4"):
        c.validate_for_tp(4)


def test_old_checkpoint_config_with_layernorm_epsilon_loads():
    config = GPTConfig(2, 64, 4, norm_epsilon=1e-6)
    old = {("layernorm_epsilon" if k == "norm_epsilon" else k): v for k, v in config.to_dict().items()}
    assert GPTConfig.from_dict(old) == config


def test_greedy_generation_matches_the_oracle():
    """hybrid.generation on the Llama-style TP model continues a prompt as greedy decoding with the
    oracle does (the model's logits feed the sampler unchanged, whatever the options)."""
    from hybrid.generation import SamplingParams, generate
    config = options_config(LLAMA)
    model = GPTModel(config, ParallelState.single_process(), device="meta")
    model.init_weights(SEED)
    oracle = ReferenceGPT(config)
    oracle.init_weights(SEED)
    prompt = torch.tensor([[5, 17, 99], [42, 0, 250]])
    ours = generate(model, prompt, 8, SamplingParams(temperature=0.0))
    tokens = prompt
    with torch.no_grad():
        for _ in range(8):
            tokens = torch.cat([tokens, oracle(tokens)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(ours, tokens)
