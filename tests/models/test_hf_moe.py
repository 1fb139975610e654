"""Hugging Face Mixtral / Qwen2-MoE conversion on state dicts and configs (models/gpt/hf_moe.py, issue 32
item 5), without transformers: round trips of random canonical MoE weights through the exported
directory (bit-exact, the released per-expert key names checked), transformers 5's fused in-memory
expert layout imported to the same tensors, the config mapping both ways (router semantics:
Mixtral renormalises the top k, Qwen2-MoE's norm_topk_prob false keeps the softmax values), and
refusals of MoE options no HF class computes. Logits against transformers: test_hf_moe_transformers.py.
"""

import json

import pytest
import torch
from safetensors.torch import load_file

from models.gpt.config import GPTConfig
from models.gpt.hf import load_hf_directory, save_hf_directory
from models.gpt.hf_moe import (HFMoEError, from_hf_moe_state_dict, gpt_config_from_hf_moe,
                               hf_moe_config, hf_model_type, to_hf_moe_state_dict)
from models.gpt.presets import get_config
from models.gpt.sharding import canonical_shapes

_LLAMA_LAYERS = dict(hidden_dropout=0.0, attention_dropout=0.0, position_embedding_type="rope",
                     normalization="RMSNorm", norm_epsilon=1e-6, swiglu=True, add_bias_linear=False,
                     untie_embeddings_and_output_weights=True)
# 3 layers of h 32, 4 heads in 2 groups; 4 experts of width 48 top-2
MIXTRAL = GPTConfig(3, 32, 4, vocab_size=97, seq_length=16, ffn_hidden_size=48, group_query_attention=True,
                    num_query_groups=2, rotary_base=1e6, num_experts=4, moe_router_topk=2,
                    **_LLAMA_LAYERS)
# the middle layer dense (width 64), 6 fine-grained experts of width 16 top-3, shared expert 40
QWEN = GPTConfig(3, 32, 4, vocab_size=97, seq_length=16, ffn_hidden_size=64, add_qkv_bias=True,
                 num_experts=6, moe_router_topk=3, moe_ffn_hidden_size=16,
                 moe_shared_expert_intermediate_size=40, moe_shared_expert_gate=True,
                 moe_router_pre_softmax=True, moe_layer_freq=(1, 0, 1), **_LLAMA_LAYERS)


def random_moe_canonical(config: GPTConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random tensors of every canonical shape (MoE layers included)."""
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=g) for name, shape in canonical_shapes(config).items()}


@pytest.mark.parametrize("config,kind", [(MIXTRAL, "mixtral"), (QWEN, "qwen2_moe")],
                         ids=["mixtral", "qwen2-moe"])
def test_round_trip_through_directory(tmp_path, config, kind):
    canonical = random_moe_canonical(config)
    save_hf_directory(tmp_path / "hf", config, canonical)
    meta = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert meta["model_type"] == kind
    stored = load_file(str(tmp_path / "hf" / "model.safetensors"))
    if kind == "mixtral":   # the released names; w1 = gate, w3 = up, w2 = down
        key = "model.layers.1.block_sparse_moe.experts.3."
        gate, up = canonical["layers.1.mlp.experts.fc1.weight"][3].chunk(2)
        assert torch.equal(stored[key + "w1.weight"], gate) and torch.equal(stored[key + "w3.weight"], up)
        assert torch.equal(stored[key + "w2.weight"], canonical["layers.1.mlp.experts.fc2.weight"][3])
        assert torch.equal(stored["model.layers.0.block_sparse_moe.gate.weight"],
                           canonical["layers.0.mlp.router.weight"])
    else:
        assert meta["mlp_only_layers"] == [1] and meta["norm_topk_prob"] is False
        assert "model.layers.1.mlp.gate_proj.weight" in stored          # the dense layer
        assert torch.equal(stored["model.layers.2.mlp.shared_expert_gate.weight"],
                           canonical["layers.2.mlp.shared_expert_gate.weight"])
        assert torch.equal(stored["model.layers.0.self_attn.k_proj.bias"],
                           canonical["layers.0.attn.qkv.bias"][32:64])
        assert torch.equal(stored["model.layers.2.mlp.experts.5.down_proj.weight"],
                           canonical["layers.2.mlp.experts.fc2.weight"][5])
    back, back_config = load_hf_directory(tmp_path / "hf", make_vocab_size_divisible_by=1)
    assert back_config == config.replace(seq_length=config.max_position_embeddings,
                                         make_vocab_size_divisible_by=1)
    assert back.keys() == canonical.keys()
    assert all(torch.equal(back[k], canonical[k]) for k in canonical)


def test_transformers5_fused_experts_import():
    """transformers 5 holds experts as gate_up_proj [E, 2f, h] (gate then up) and down_proj [E, h, f]
    under mlp.experts: the same tensors as our fc1 / fc2."""
    canonical = random_moe_canonical(MIXTRAL, seed=1)
    released = to_hf_moe_state_dict(MIXTRAL, canonical)
    fused = {}
    for key, t in released.items():
        if ".experts." not in key:
            fused[key.replace(".block_sparse_moe.", ".mlp.")] = t
    for i in range(MIXTRAL.num_layers):
        p = f"model.layers.{i}.block_sparse_moe.experts."
        e = range(MIXTRAL.num_experts)
        fused[f"model.layers.{i}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([released[f"{p}{j}.w1.weight"], released[f"{p}{j}.w3.weight"]]) for j in e])
        fused[f"model.layers.{i}.mlp.experts.down_proj"] = torch.stack(
            [released[f"{p}{j}.w2.weight"] for j in e])
    back = from_hf_moe_state_dict(MIXTRAL, fused)
    assert all(torch.equal(back[k], canonical[k]) for k in canonical)


def test_leftover_and_missing_tensors_are_refused():
    hf = to_hf_moe_state_dict(MIXTRAL, random_moe_canonical(MIXTRAL))
    with pytest.raises(HFMoEError, match="do not have|does not have"):
        from_hf_moe_state_dict(MIXTRAL, {**hf, "model.layers.0.block_sparse_moe.experts.4.w1.weight":
                                         torch.zeros(48, 32)})
    del hf["model.layers.2.block_sparse_moe.experts.1.w2.weight"]
    with pytest.raises(HFMoEError, match="experts.1.w2.weight"):
        from_hf_moe_state_dict(MIXTRAL, hf)


@pytest.mark.parametrize("name,expected", [
    ("mixtral-8x7b", {"model_type": "mixtral", "num_local_experts": 8, "num_experts_per_tok": 2,
                      "intermediate_size": 14336, "hidden_size": 4096, "num_hidden_layers": 32,
                      "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 32000,
                      "rope_theta": 1e6, "rms_norm_eps": 1e-5, "max_position_embeddings": 32768,
                      "tie_word_embeddings": False}),
    ("qwen1.5-moe-a2.7b", {"model_type": "qwen2_moe", "num_experts": 60, "num_experts_per_tok": 4,
                           "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
                           "intermediate_size": 5632, "hidden_size": 2048, "num_hidden_layers": 24,
                           "num_attention_heads": 16, "num_key_value_heads": 16,
                           "vocab_size": 151936, "norm_topk_prob": False, "qkv_bias": True,
                           "decoder_sparse_step": 1, "mlp_only_layers": [], "rope_theta": 1e6,
                           "rms_norm_eps": 1e-6, "max_position_embeddings": 8192,
                           "tie_word_embeddings": False})])
def test_presets_map_to_the_released_configs_and_back(name, expected):
    """The presets' config.json carries the released hyperparameters, and reads back as the preset."""
    preset = get_config(name)
    meta = hf_moe_config(preset)
    assert {k: meta[k] for k in expected} == expected
    back = gpt_config_from_hf_moe(meta)
    assert back == preset.replace(seq_length=preset.max_position_embeddings)


def test_router_semantics_mapping():
    """norm_topk_prob true (renormalised top k) = softmax over the top-k logits, our
    pre_softmax False; Mixtral always renormalises."""
    meta = hf_moe_config(QWEN)
    assert gpt_config_from_hf_moe({**meta, "norm_topk_prob": True}).moe_router_pre_softmax is False
    assert gpt_config_from_hf_moe(meta).moe_router_pre_softmax is True
    assert gpt_config_from_hf_moe(hf_moe_config(MIXTRAL)).moe_router_pre_softmax is False
    # decoder_sparse_step 2: layers 1, 3, ... are MoE (HF counts (i + 1) % step == 0)
    sparse = gpt_config_from_hf_moe({**meta, "decoder_sparse_step": 2, "mlp_only_layers": []})
    assert sparse.moe_layer_pattern() == (False, True, False)


@pytest.mark.parametrize("change,match", [
    ({"moe_router_score_function": "sigmoid"}, "sigmoid router scores"),
    ({"moe_router_enable_expert_bias": True, "moe_router_score_function": "sigmoid"},
     "sigmoid router scores.*expert bias"),
    ({"moe_router_topk_scaling_factor": 2.5}, "scaling factor"),
    ({"moe_layer_freq": 2}, "dense layers between MoE layers"),
    ({"moe_router_pre_softmax": True}, "renormalises"),
    ({"moe_shared_expert_intermediate_size": 16}, "without the sigmoid gate"),
    ({"add_bias_linear": True}, "linear biases"),
], ids=["sigmoid", "expert-bias", "scaling", "dense-mixtral", "pre-softmax", "ungated", "biases"])
def test_options_no_hf_class_computes_are_refused(change, match):
    with pytest.raises(HFMoEError, match=match):
        hf_model_type(MIXTRAL.replace(**change))


def test_hf_configs_we_cannot_build_are_refused():
    meta = hf_moe_config(MIXTRAL)
    with pytest.raises(HFMoEError, match="sliding-window"):
        gpt_config_from_hf_moe({**meta, "sliding_window": 4})
    with pytest.raises(HFMoEError, match="silu"):
        gpt_config_from_hf_moe({**meta, "hidden_act": "gelu"})


# transformers' MixtralForCausalLM / Qwen2MoeForCausalLM of the released configs, counted on meta
# (total, active = total less E - k experts per layer); test_hf_moe_transformers.py recounts them
RELEASED_COUNTS = {"mixtral-8x7b": (46_702_792_704, 12_879_925_248),
                   "qwen1.5-moe-a2.7b": (14_315_784_192, 2_689_173_504)}


@pytest.mark.parametrize("name", RELEASED_COUNTS)
def test_presets_built_on_meta_count_the_released_parameters(name):
    """Our model at full size on meta: every parameter summed, and the expert-parallel ones (the
    routed experts) reduced to k of E, equal the released totals; so do the config's counts."""
    from hybrid.parallel_state import ParallelState
    from models.gpt.model import GPTModel
    config = get_config(name)
    model = GPTModel(config, ParallelState.single_process(), device="meta")
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for p in model.parameters() if getattr(p, "expert_parallel", False))
    active = total - experts + experts * config.moe_router_topk // config.num_experts
    assert (total, active) == RELEASED_COUNTS[name]
    assert (config.num_parameters(), config.num_active_parameters()) == RELEASED_COUNTS[name]


@pytest.mark.parametrize("config", [MIXTRAL, QWEN], ids=["mixtral", "qwen2-moe"])
def test_checkpoint_exports_through_tools(tmp_path, config):
    """A checkpoint of a MoE GPTModel (the trainer's format) -> tools/export_hf.py -> an HF directory
    holding the model's canonical tensors; tools/import_hf.py -> a canonical file, equal again."""
    from hybrid.checkpoint import save_checkpoint
    from hybrid.checkpoint.state import state_pieces
    from hybrid.parallel_state import ParallelState
    from models.gpt.weights import build_model, load_canonical
    from tools import export_hf, import_hf
    state = ParallelState.single_process()
    canonical = random_moe_canonical(config, seed=5)
    model = build_model(config, state, canonical)
    pieces = state_pieces(model, model.checkpoint_layout(), state, for_save=True)
    save_checkpoint(tmp_path / "ckpt", 1, pieces, {}, {"model_config": config.to_dict()}, state.world)
    assert export_hf.main(["--load", str(tmp_path / "ckpt"), "--out", str(tmp_path / "hf"),
                           "--no-tokenizer"]) == 0
    back, back_config = load_hf_directory(tmp_path / "hf", make_vocab_size_divisible_by=1)
    assert back_config.moe_layer_pattern() == config.moe_layer_pattern()
    assert import_hf.main(["--hf-dir", str(tmp_path / "hf"), "--out", str(tmp_path / "c.safetensors")]) == 0
    again, again_config = load_canonical(tmp_path / "c.safetensors")
    assert again_config.num_experts == config.num_experts
    for name, t in canonical.items():
        assert torch.equal(back[name], t) and torch.equal(again[name], t), name


def test_init_from_moe_directory_and_refusal_of_other_experts(tmp_path):
    """--init-from-hf's path: an HF Qwen2-MoE directory initialises a model of the same dims; one
    with other experts is refused naming the difference (not a shape error deep in the load)."""
    from hybrid.parallel_state import ParallelState
    from models.gpt.weights import build_model, init_from_pretrained
    canonical = random_moe_canonical(QWEN, seed=7)
    save_hf_directory(tmp_path / "hf", QWEN, canonical)
    model = build_model(QWEN, ParallelState.single_process(), random_moe_canonical(QWEN, seed=8))
    init_from_pretrained(model, tmp_path / "hf")
    back = model.canonical_state_dict()
    assert all(torch.equal(back[k], canonical[k]) for k in canonical)
    other = QWEN.replace(num_experts=4)
    wrong = build_model(other, ParallelState.single_process(), random_moe_canonical(other))
    with pytest.raises(ValueError, match="num_experts: 6 there vs 4 here"):
        init_from_pretrained(wrong, tmp_path / "hf")
