"""HF GPT-2 conversion without transformers (models/gpt/hf.py, tools/export_hf.py, tools/import_hf.py).

Oracles: (1) the exported model.safetensors, read back and mapped back, equals the canonical
tensors bit for bit; (2) a GPT-2 forward written here from the HF names and Conv1D convention
(``x @ W + b``, fused c_attn columns ``[q | k | v]``, gelu_new, tied wte) over the exported tensors
gives the single-device reference's logits; (3) GPTModel imported from the HF directory at TP 1 and
TP 2 gives the reference's logits; (4) a training checkpoint written at TP 2 exports through
tools/export_hf.py to the same tensors. Vocab 200 is padded (256 at TP 1, 2), so padding is crossed.
"""

import json
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from hybrid.parallel_state import ParallelState
from hybrid.tensor_parallel import RNGTracker
from hybrid.testing.multirank import run_on_ranks
from hybrid.topology import Topology
from models.gpt.config import GPTConfig
from models.gpt.hf import (HFConversionError, from_hf_state_dict, gpt_config_from_hf, hf_config,
                           load_hf_directory, save_hf_directory, to_hf_state_dict)
from models.gpt.reference import ReferenceGPT
from models.gpt.model import GPTModel
from models.gpt.weights import (build_model, init_from_pretrained, load_canonical, load_model,
                                pretrained_init_fn, save_canonical)

CONFIG = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=200, seq_length=16,
                   hidden_dropout=0.0, attention_dropout=0.0)


def random_canonical(config: GPTConfig, seed: int = 3, scale: float = 1.0) -> dict[str, torch.Tensor]:
    """Canonical weights with non-trivial biases and LayerNorm gains (init gives zeros / ones);
    ``scale`` multiplies the matrices so activations reach the range where GELU variants differ."""
    ref = ReferenceGPT(config)
    ref.init_weights(seed)
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, p in ref.state_dict().items():
        p = p + 0.1 * torch.randn(p.shape, generator=g) if p.dim() == 1 else p * scale
        out[name] = p.clone()
    return out


def reference_logits(config: GPTConfig, state_dict, tokens) -> torch.Tensor:
    ref = ReferenceGPT(config)
    ref.load_state_dict(state_dict)
    with torch.no_grad():
        return ref.eval()(tokens)


def hf_forward(t: dict[str, torch.Tensor], cfg: dict, tokens: torch.Tensor,
               exact_gelu: bool = False) -> torch.Tensor:
    """GPT-2 from HF-named tensors (independent of our code): tokens [b, s] -> logits [b, s, V]."""
    b, s = tokens.shape
    h, heads, eps = cfg["n_embd"], cfg["n_head"], cfg["layer_norm_epsilon"]
    x = t["transformer.wte.weight"][tokens] + t["transformer.wpe.weight"][:s]       # [b, s, h]

    def ln(v, p):
        return F.layer_norm(v, (h,), t[p + ".weight"], t[p + ".bias"], eps)

    def conv1d(v, p):                                    # HF Conv1D: weight [in, out]
        return v @ t[p + ".weight"] + t[p + ".bias"]

    mask = torch.ones(s, s, dtype=torch.bool).tril()
    for i in range(cfg["n_layer"]):
        p = f"transformer.h.{i}."
        q, k, v = conv1d(ln(x, p + "ln_1"), p + "attn.c_attn").split(h, dim=-1)
        q, k, v = (z.view(b, s, heads, h // heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-1, -2)) / math.sqrt(h // heads)
        y = att.masked_fill(~mask, float("-inf")).softmax(-1) @ v              # [b, a, s, d]
        x = x + conv1d(y.transpose(1, 2).reshape(b, s, h), p + "attn.c_proj")
        u = conv1d(ln(x, p + "ln_2"), p + "mlp.c_fc")
        gelu_new = 0.5 * u * (1 + torch.tanh(math.sqrt(2 / math.pi) * (u + 0.044715 * u ** 3)))
        x = x + conv1d(F.gelu(u) if exact_gelu else gelu_new, p + "mlp.c_proj")
    return ln(x, "transformer.ln_f") @ t["transformer.wte.weight"].t()


def test_export_round_trip_and_hf_layout_forward(tmp_path):
    canonical = random_canonical(CONFIG, scale=8.0)
    out = save_hf_directory(tmp_path / "hf", CONFIG, canonical)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["activation_function"] == "gelu_new" and cfg["vocab_size"] == 200
    saved = load_file(str(out / "model.safetensors"))
    assert "lm_head.weight" not in saved                        # tied: HF re-ties it on load
    assert saved["transformer.h.0.attn.c_attn.weight"].shape == (32, 96)   # Conv1D [in, out]
    back = from_hf_state_dict(CONFIG, saved)
    assert set(back) == set(canonical)
    for name in canonical:
        assert torch.equal(back[name], canonical[name]), name
    assert gpt_config_from_hf(cfg) == CONFIG.replace(make_vocab_size_divisible_by=128)
    tokens = torch.randint(0, 200, (2, 16), generator=torch.Generator().manual_seed(0))
    expected = reference_logits(CONFIG, canonical, tokens)
    torch.testing.assert_close(hf_forward(saved, cfg, tokens), expected, rtol=0, atol=1e-5)
    # the checks can tell GELU variants apart: the erf GELU misses by more than their tolerances
    assert (hf_forward(saved, cfg, tokens, exact_gelu=True) - expected).abs().max() > 3e-4
    half = save_hf_directory(tmp_path / "bf16", CONFIG, canonical, dtype=torch.bfloat16)
    assert json.loads((half / "config.json").read_text())["torch_dtype"] == "bfloat16"
    bf16, _ = load_hf_directory(half)                         # read back as fp32
    for name, t in canonical.items():
        assert torch.equal(bf16[name], t.to(torch.bfloat16).float()), name
    # a sharded directory (model.safetensors.index.json), as save_pretrained writes big models
    keys = sorted(saved)
    (out / "model.safetensors").unlink()
    weight_map = {}
    for i, part in enumerate((keys[:10], keys[10:])):
        save_file({k: saved[k] for k in part}, str(out / f"model-0000{i + 1}-of-00002.safetensors"))
        weight_map.update({k: f"model-0000{i + 1}-of-00002.safetensors" for k in part})
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    sharded, _ = load_hf_directory(out)
    assert all(torch.equal(sharded[n], t) for n, t in canonical.items())


def test_conversion_refuses_what_it_cannot_represent():
    hf = to_hf_state_dict(CONFIG, random_canonical(CONFIG))
    with pytest.raises(HFConversionError, match="untied"):
        from_hf_state_dict(CONFIG, {**hf, "lm_head.weight": torch.zeros(200, 32)})
    # GPT2Model keys (no "transformer." prefix) and the old causal-mask buffers are accepted
    bare = {k.removeprefix("transformer."): v for k, v in hf.items()}
    bare["h.0.attn.bias"] = torch.ones(1, 1, 16, 16)
    from_hf_state_dict(CONFIG, bare)
    with pytest.raises(HFConversionError, match="lack"):
        from_hf_state_dict(CONFIG.replace(num_layers=3), hf)
    cfg = hf_config(CONFIG)
    for change, match in (({"activation_function": "gelu"}, "tanh"),
                          ({"scale_attn_by_inverse_layer_idx": True}, "does not implement"),
                          ({"model_type": "llama"}, "gpt2"), ({"n_head": 5}, "divisible")):
        with pytest.raises(HFConversionError, match=match):
            gpt_config_from_hf({**cfg, **change})


def _import_ranks(rank, world_size, hf_dir, tokens):
    from hybrid.generation import gather_vocab
    state = ParallelState.initialize(Topology(world_size, world_size, gpus_per_node=world_size))
    state_dict, config = load_canonical(hf_dir)
    model = build_model(config, state, state_dict)
    with torch.no_grad():
        local = model(tokens)                                             # [b, s, V_p/tp]
    full = gather_vocab(local.flatten(0, 1), state.tp, config.vocab_size)
    # the trainer's path: a randomly initialised TP model overwritten in place
    # (other dropout and vocab padding: 208 rows at TP 2 instead of 256)
    trained = GPTModel(config.replace(make_vocab_size_divisible_by=8, hidden_dropout=0.1), state,
                       rng=RNGTracker(0, state.tp_rank, state.device))
    init_from_pretrained(trained, hf_dir)
    with torch.no_grad():
        again = gather_vocab(trained.eval()(tokens).flatten(0, 1), state.tp, config.vocab_size)
    torch.testing.assert_close(again, full, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="other dims"):
        init_from_pretrained(GPTModel(config.replace(num_layers=1), state), hf_dir)
    # ZeRO stage 3 builds on meta and materialises partitions through init_fn
    from hybrid.zero import AdamWConfig, ZeroConfig
    from hybrid.zero.stage3 import ParameterPartitioning
    meta = GPTModel(config, state, device="meta")
    ParameterPartitioning(meta, state, ZeroConfig(stage=3), AdamWConfig(),
                    init_fn=pretrained_init_fn(hf_dir, meta))
    labels = tokens.roll(-1, dims=1)
    with torch.no_grad():
        stage3_loss = meta.eval()(tokens, labels).numpy()
    # numpy: tensors would travel through shared-memory handles that die with the rank
    gathered = {k: v.numpy() for k, v in model.canonical_state_dict().items()}
    return full.view(*tokens.shape, -1).numpy(), gathered, stage3_loss


def test_import_hf_at_tp1_and_tp2_matches_reference(tmp_path):
    canonical = random_canonical(CONFIG)
    hf_dir = str(save_hf_directory(tmp_path / "hf", CONFIG, canonical))
    tokens = torch.randint(0, 200, (2, 16), generator=torch.Generator().manual_seed(1))
    expected = reference_logits(CONFIG, canonical, tokens)
    state_dict, config = load_canonical(hf_dir)
    model = build_model(config, ParallelState.single_process(), state_dict)   # TP 1: V_p = 256
    with torch.no_grad():
        tp1 = model(tokens)[..., :200]
    torch.testing.assert_close(tp1, expected, rtol=0, atol=1e-5)
    expected_loss = F.cross_entropy(expected.flatten(0, 1), tokens.roll(-1, dims=1).flatten(),
                                    reduction="none").view_as(tokens)
    for logits, gathered, stage3_loss in run_on_ranks(_import_ranks, 2, args=(hf_dir, tokens)):
        torch.testing.assert_close(torch.from_numpy(logits), expected, rtol=0, atol=1e-5)
        torch.testing.assert_close(torch.from_numpy(stage3_loss), expected_loss, rtol=0, atol=1e-5)
        for name, t in canonical.items():                 # sharding (QKV interleave) undone exactly
            assert torch.equal(torch.from_numpy(gathered[name]), t), name


def test_checkpoint_to_hf_via_tools(tmp_path):
    """A TP 2 training checkpoint (F's format) -> tools/export_hf.py -> the same canonical tensors;
    tools/import_hf.py -> canonical file -> equal again."""
    from models.gpt.weights import canonical_state_dict
    from tests.tools.test_evaluate import write_training_checkpoint
    from tools import export_hf, import_hf
    ckpt = write_training_checkpoint(tmp_path / "ckpt", tp=2, iters=1)
    expected, _ = canonical_state_dict(ckpt)
    assert export_hf.main(["--load", ckpt, "--out", str(tmp_path / "hf"), "--no-tokenizer"]) == 0
    back, config = load_hf_directory(tmp_path / "hf")
    assert config.vocab_size == 200
    assert import_hf.main(["--hf-dir", str(tmp_path / "hf"),
                           "--out", str(tmp_path / "c.safetensors")]) == 0
    again, _ = load_canonical(tmp_path / "c.safetensors")
    for name, t in expected.items():
        assert torch.equal(back[name], t) and torch.equal(again[name], t), name
    save_canonical(tmp_path / "d.safetensors", again, config)
    assert load_canonical(tmp_path / "d.safetensors")[1] == config


def test_model_only_checkpoint_falls_back_to_model_weights(tmp_path):
    """A checkpoint without fp32 master weights (no optimizer) loads its model weights."""
    from hybrid.checkpoint import save_checkpoint
    from hybrid.checkpoint.state import state_pieces
    state = ParallelState.single_process()
    model = build_model(CONFIG, state, random_canonical(CONFIG))
    pieces = state_pieces(model, model.checkpoint_layout(), state, for_save=True)
    save_checkpoint(tmp_path / "ckpt", 1, pieces, {}, {"model_config": CONFIG.to_dict()}, state.world)
    loaded, config = load_canonical(tmp_path / "ckpt")
    assert config == CONFIG
    for name, t in random_canonical(CONFIG).items():
        assert torch.equal(loaded[name], t), name
    direct = load_model(tmp_path / "ckpt", state)            # shard-by-shard path of the reader
    for name, t in direct.canonical_state_dict().items():
        assert torch.equal(t, loaded[name]), name
