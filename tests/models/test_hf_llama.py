"""Hugging Face LlamaForCausalLM export/import (models/gpt/hf_llama.py through models/gpt/hf.py):
round trips of random Llama weights (GQA, untied, rope scaling; biases on and off), refusal of
option mixtures no HF class computes, the rotary permutation of Meta's interleaved layout checked
against an interleaved rotation, and - in transformers' own venv (tests/models/test_hf_transformers.py) -
our export loaded by LlamaForCausalLM gives our logits within 1e-4."""

import json
import subprocess

import pytest
import torch
from safetensors.torch import load_file

from hybrid.parallel_state import ParallelState
from models.gpt.hf import HFConversionError, load_hf_directory, save_hf_directory
from models.gpt.hf_llama import HFLlamaError, permute_for_rotate_half
from models.gpt.reference import apply_rotary
from models.gpt.weights import build_model
from tests.models.test_gpt_options import LLAMA, options_config
from tests.models.test_hf_export import random_canonical
from tests.models.test_hf_transformers import hf_python  # noqa: F401 (fixture)

LLAMA_HF = {**LLAMA, "norm_epsilon": 1e-6}


@pytest.mark.parametrize("options", [LLAMA_HF, {**LLAMA_HF, "add_bias_linear": True,
                                                "untie_embeddings_and_output_weights": False}],
                         ids=["gqa-untied-nobias", "tied-bias"])
def test_round_trip(tmp_path, options):
    config = options_config(options)
    canonical = random_canonical(config, seed=4)
    save_hf_directory(tmp_path / "hf", config, canonical)
    meta = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert meta["model_type"] == "llama" and meta["num_key_value_heads"] == config.query_groups
    back, back_config = load_hf_directory(tmp_path / "hf", make_vocab_size_divisible_by=1)
    assert back_config == config.replace(seq_length=config.max_position_embeddings)
    assert back.keys() == canonical.keys()
    assert all(torch.equal(back[k], canonical[k]) for k in canonical)


def test_mixtures_are_refused(tmp_path):
    rope_layernorm = options_config({"position_embedding_type": "rope"})
    with pytest.raises(HFConversionError, match="export as LlamaForCausalLM"):
        save_hf_directory(tmp_path / "a", rope_layernorm, random_canonical(rope_layernorm))
    from models.gpt.hf_llama import hf_llama_config
    with pytest.raises(HFLlamaError, match="needs rotary positions, RMSNorm and SwiGLU"):
        hf_llama_config(rope_layernorm)


def test_rotate_half_permutation_of_interleaved_weights():
    """Meta's layout rotates pairs (2i, 2i+1); permuting q's rows per head gives rotate-half pairs
    (i, i + d/2), so the permuted projection under our rotation equals the interleaved one's."""
    config = options_config({"position_embedding_type": "rope"})
    heads, d, s = config.num_attention_heads, config.head_dim, 5
    w = torch.randn(config.hidden_size, config.hidden_size, dtype=torch.float64)
    x = torch.randn(s, config.hidden_size, dtype=torch.float64)
    q_meta = (x @ w.t()).view(s, heads, d).transpose(0, 1)                  # [heads, s, d]
    angles = torch.arange(s, dtype=torch.float64)[:, None] * config.rotary_base ** (
        -torch.arange(0, d, 2, dtype=torch.float64) / d)
    pairs = torch.view_as_complex(q_meta.reshape(heads, s, d // 2, 2).contiguous())
    rotated_meta = torch.view_as_real(pairs * torch.polar(torch.ones_like(angles), angles)).reshape(heads, s, d)
    q_ours = (x @ permute_for_rotate_half(w, heads).t()).view(s, heads, d).transpose(0, 1)
    rotated_ours = apply_rotary(q_ours[None].float(), config)[0].double()
    even_then_odd = torch.cat([rotated_meta[..., 0::2], rotated_meta[..., 1::2]], dim=-1)
    torch.testing.assert_close(rotated_ours, even_then_odd, rtol=1e-5, atol=1e-5)


SCRIPT = r"""
import json, sys, torch, transformers
from safetensors.torch import save_file
model_dir, tokens, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
model = transformers.LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
with torch.no_grad():
    logits = model(torch.tensor(tokens)).logits.contiguous()
save_file({"logits": logits}, out)
"""


def test_transformers_loads_llama_export_with_same_logits(tmp_path, hf_python):  # noqa: F811
    config = options_config(LLAMA_HF)   # GQA, untied, rope scaling, no biases
    canonical = random_canonical(config, seed=6, scale=4.0)
    save_hf_directory(tmp_path / "hf", config, canonical)
    tokens = torch.randint(0, config.vocab_size, (2, config.seq_length),
                           generator=torch.Generator().manual_seed(0))
    out = tmp_path / "logits.safetensors"
    run = subprocess.run([hf_python, "-c", SCRIPT, str(tmp_path / "hf"), json.dumps(tokens.tolist()),
                          str(out)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    theirs = load_file(str(out))["logits"]
    model = build_model(config, ParallelState.single_process(), canonical)
    with torch.no_grad():
        ours = model(tokens)[..., :config.vocab_size]
    diff = (theirs - ours).abs().max().item()
    assert diff < 1e-4, f"max |logits diff| = {diff}"


MAKE_RANDOM = r"""
import json, sys, torch, transformers
from safetensors.torch import save_file
out_dir, tokens = sys.argv[1], json.loads(sys.argv[2])
torch.manual_seed(0)
config = transformers.LlamaConfig(vocab_size=251, hidden_size=64, intermediate_size=96,
    num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=16,
    rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False, initializer_range=0.2,
    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
model = transformers.LlamaForCausalLM(config).eval()
with torch.no_grad():
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.uniform_(0.5, 1.5)   # non-trivial gains
    logits = model(torch.tensor(tokens)).logits.contiguous()
model.save_pretrained(out_dir, safe_serialization=True)
save_file({"logits": logits}, out_dir + "/logits.safetensors")
"""


def _import_tp2(rank, world_size, hf_dir, tokens):
    from hybrid.topology import Topology
    from hybrid.tensor_parallel import gather_from_tp
    state = ParallelState.initialize(Topology(world_size, 2, gpus_per_node=world_size))
    canonical, config = load_hf_directory(hf_dir, make_vocab_size_divisible_by=1)
    model = build_model(config, state, canonical)
    with torch.no_grad():
        logits = gather_from_tp(model(torch.tensor(tokens)).contiguous(), state.tp)
    return logits[..., :config.vocab_size].numpy()


def test_random_transformers_llama_imports_at_tp2(tmp_path, hf_python):  # noqa: F811
    from hybrid.testing.multirank import run_on_ranks
    tokens = torch.randint(0, 251, (2, 16), generator=torch.Generator().manual_seed(1)).tolist()
    hf_dir = str(tmp_path / "hf")
    run = subprocess.run([hf_python, "-c", MAKE_RANDOM, hf_dir, json.dumps(tokens)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    theirs = load_file(hf_dir + "/logits.safetensors")["logits"]
    ours = run_on_ranks(_import_tp2, 2, args=(hf_dir, tokens), timeout=300)
    for logits in ours:
        diff = (torch.from_numpy(logits) - theirs).abs().max().item()
        assert diff < 1e-4, f"max |logits diff| = {diff}"


def test_init_from_llama_directory_at_tp1_and_refusal_of_other_architecture(tmp_path):
    from models.gpt.weights import init_from_pretrained
    config = options_config(LLAMA_HF)
    canonical = random_canonical(config, seed=8)
    save_hf_directory(tmp_path / "hf", config, canonical)
    model = build_model(config, ParallelState.single_process(), random_canonical(config, seed=9))
    init_from_pretrained(model, tmp_path / "hf")
    back = model.canonical_state_dict()
    assert all(torch.equal(back[k], canonical[k]) for k in canonical)
    other = config.replace(swiglu=False, ffn_hidden_size=96)
    gelu_model = build_model(other, ParallelState.single_process(), random_canonical(other))
    with pytest.raises(ValueError, match="swiglu: True there vs False here"):
        init_from_pretrained(gelu_model, tmp_path / "hf")
